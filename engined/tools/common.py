"""What every operator command shares: endpoints, discovery, output modes and exit codes.

Output has three modes because the commands have two audiences: scripts and tests read
`--json` (one JSON object per line, stable keys, flushed per line so a pipe sees it at once);
people read rich tables and live views on a terminal, and plain lines when stdout is a file or
a pipe (no escape codes in logs). Errors always go to stderr as text; in JSON mode they are also
written to stdout as `{"error": {...}}`, so a consumer of the stream sees why it ended.

Exit codes: 0 success, 1 a failure at run time (no daemon, an `error` reply, a timeout),
2 a bad command line (typer's own code; `UsageError` also maps to it when a value can only be
judged after talking to the daemon, such as `--rank`), 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, Final, TextIO

import structlog
import zmq
import zmq.asyncio
from rich.console import Console, RenderableType

from engined.client import EngineClient, EngineError
from engined.wire.control import Welcome

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130


class ToolError(Exception):
    """A run-time failure to report as `error: <message>` with `exit_code`.

    Attributes:
        code: the daemon's error code when the failure is an `error` reply, else None.
    """

    def __init__(self, message: str, *, code: str | None = None, exit_code: int = EXIT_FAILURE):
        super().__init__(message)
        self.message = message
        self.code = code
        self.exit_code = exit_code


class UsageError(ToolError):
    """An option whose value turned out wrong once the daemon answered (exit code 2)."""

    def __init__(self, option: str | tuple[str, ...], message: str) -> None:
        super().__init__(message, exit_code=EXIT_USAGE)
        # Every spelling of the option, its name first, as typer names one it refuses.
        self.options = (option,) if isinstance(option, str) else option


# --- output ---------------------------------------------------------------------------------


class Mode(enum.Enum):
    JSON = "json"
    RICH = "rich"
    PLAIN = "plain"


class Output:
    """Where a command writes: JSON lines, rich renderables, or plain lines.

    Streams are looked up when the Output is built (not at import), so a test runner that
    swaps `sys.stdout` sees everything.
    """

    def __init__(self, mode: Mode, *, stdout: TextIO | None = None, stderr: TextIO | None = None):
        self.mode = mode
        self._out = sys.stdout if stdout is None else stdout
        self._err = sys.stderr if stderr is None else stderr
        self.console: Console | None = (
            Console(file=self._out, highlight=False) if mode is Mode.RICH else None
        )

    @classmethod
    def pick(cls, json_lines: bool) -> Output:
        """JSON when asked; otherwise rich on a terminal and plain text elsewhere."""
        if json_lines:
            return cls(Mode.JSON)
        return cls(Mode.RICH if sys.stdout.isatty() else Mode.PLAIN)

    @property
    def json(self) -> bool:
        return self.mode is Mode.JSON

    @property
    def stderr_is_tty(self) -> bool:
        return self._err.isatty()

    def record(self, obj: Mapping[str, Any]) -> None:
        """One JSON object on its own line, flushed (JSON mode)."""
        self._out.write(json.dumps(obj) + "\n")
        self._out.flush()

    def line(self, text: str, *, style: str | None = None) -> None:
        """A line of text; `style` (rich syntax) applies on a terminal only."""
        if self.console is not None:
            self.console.print(text, style=style, markup=False, soft_wrap=True)
        else:
            self._out.write(text + "\n")
            self._out.flush()

    def render(self, renderable: RenderableType) -> None:
        """A rich renderable (rich mode only)."""
        assert self.console is not None, "render() is for rich mode"
        self.console.print(renderable)

    def warning(self, text: str) -> None:
        """A warning in the flow of the output (stdout, so it stays in order with it)."""
        self.line(f"warning: {text}", style="bold yellow")

    def error(self, message: str, code: str | None = None) -> None:
        """Report a failure: text on stderr, plus `{"error": ...}` on stdout in JSON mode."""
        if self.json:
            self.record({"error": {"code": code, "message": message}})
        text = message if code is None else f"{code}: {message}"
        self._err.write(f"error: {text}\n")
        self._err.flush()

    def stderr_console(self) -> Console:
        """A console on stderr, for progress displays that must not mix with the results."""
        return Console(file=self._err)


def table_text(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A plain-text table: columns padded to their widest cell, numbers right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(cells, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return [fmt(headers), *(fmt(r) for r in rows)]


def _numeric(cell: str) -> bool:
    try:
        float(cell.removesuffix("%"))
    except ValueError:
        return False
    return True


# --- running --------------------------------------------------------------------------------


def run_tool(main: Callable[[], Coroutine[Any, Any, int]], out: Output) -> int:
    """Run a command's coroutine and turn its outcome into an exit code.

    `UsageError` is re-raised for the CLI to report as typer reports a bad option. Logging of
    the client library goes to stderr at warning level while the command runs, so nothing but
    results reaches stdout; the previous structlog configuration is restored afterwards (tests
    run commands in-process).
    """
    from engined.logs import configure_logging

    saved = structlog.get_config()
    configure_logging("auto", "warning")
    try:
        return asyncio.run(main())
    except UsageError:
        raise
    except ToolError as error:
        out.error(error.message, error.code)
        return error.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        structlog.configure(**saved)


@contextlib.asynccontextmanager
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    """A context for one command; every socket of the command must be closed inside it."""
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def control_client(ctx: zmq.asyncio.Context, endpoint: str) -> AsyncIterator[EngineClient]:
    """An EngineClient on the shared context, closed on exit."""
    try:
        client = await EngineClient.connect(endpoint, ctx=ctx)
    except ValueError as error:  # the CURVE key files the environment names
        raise ToolError(str(error)) from None
    try:
        yield client
    finally:
        await client.close()


def no_answer(endpoint: str, timeout: float) -> ToolError:
    return ToolError(
        f"no answer from the daemon at {endpoint} within {timeout:g} s "
        "(is `engined serve` running there? see --control-endpoint, --timeout)"
    )


def engine_failure(error: EngineError) -> ToolError:
    return ToolError(error.message, code=error.code)


async def discover(client: EngineClient, endpoint: str, timeout: float) -> Welcome:
    """The daemon's `welcome`: its per-rank KV, replay and FPM endpoints."""
    try:
        return await client.hello(timeout=timeout)
    except TimeoutError:
        raise no_answer(endpoint, timeout) from None
    except EngineError as error:
        raise engine_failure(error) from None


def pick_rank(endpoints: Sequence[str], rank: int, what: str) -> str:
    """The endpoint of `rank` among a welcome's per-rank list (`--dp-rank` out of range: usage)."""
    if not endpoints:
        raise ToolError(f"the daemon publishes no {what}")
    if not 0 <= rank < len(endpoints):
        raise UsageError(
            ("--dp-rank", "--rank"),
            f"rank {rank} does not exist: the daemon has {len(endpoints)} rank(s)",
        )
    return endpoints[rank]


def fmt_hash(value: int | bytes | None, hex_format: bool) -> int | str | None:
    """A block hash for output: int, `0x` + 16 hex digits, or vLLM's digest bytes in hex."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.hex()
    return f"0x{value:016x}" if hex_format else value
