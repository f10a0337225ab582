"""`engined submit`: send one request and stream its outputs as they arrive.

The operator's smoke test of a daemon: does it take a request, how many tokens come back,
how much of the prompt was cached. Each `output` entry is printed when it arrives (not at the
end), so a paced daemon's token timing is visible. Ctrl-C cancels the request on the daemon
before exiting, so an interrupted submit leaves no KV behind.

Exit status: 0 when the request finished with `length` (or `cancelled` by the daemon's
shutdown), 1 on an `error` reply, a `rejected` request or a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any, Final

from engined.client import EngineClient, EngineError
from engined.tools.common import (
    EXIT_FAILURE,
    EXIT_OK,
    Output,
    ToolError,
    control_client,
    engine_failure,
    no_answer,
    zmq_context,
)
from engined.tools.option_values import DEFAULT_TIMEOUT
from engined.wire.control import OutputEntry

# Random prompts draw from a Llama-sized vocabulary; the value only matters for realism.
VOCAB_SIZE: Final = 32_000
# How long a cancel on Ctrl-C may take before the command gives up on it.
_CANCEL_TIMEOUT_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class SubmitOptions:
    control_endpoint: str
    token_ids: list[int]
    max_tokens: int
    request_id: str | None = None
    dp_rank: int | None = None
    timeout: float = DEFAULT_TIMEOUT


def random_prompt(length: int, seed: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """`length` token ids in [0, vocab_size), the same for the same seed (reproducible runs)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


async def submit(options: SubmitOptions, out: Output) -> int:
    """Submit, stream every output entry, then summarise; returns the exit code."""
    async with zmq_context() as ctx, control_client(ctx, options.control_endpoint) as client:
        return await _submit(client, options, out)


async def _submit(client: EngineClient, options: SubmitOptions, out: Output) -> int:
    start = time.perf_counter()
    try:
        submitted = await client.submit(
            options.token_ids,
            options.max_tokens,
            request_id=options.request_id,
            dp_rank=options.dp_rank,
            timeout=options.timeout,
        )
    except TimeoutError:
        raise no_answer(options.control_endpoint, options.timeout) from None
    except EngineError as error:
        raise engine_failure(error) from None
    request_id = submitted.request_id
    prompt_tokens = len(options.token_ids)
    if out.json:
        out.record(
            {
                "type": "submitted",
                "request_id": request_id,
                "dp_rank": submitted.dp_rank,
                "prompt_tokens": prompt_tokens,
            }
        )
    else:
        out.line(
            f"submitted {request_id} to rank {submitted.dp_rank} "
            f"({prompt_tokens} prompt tokens, max_tokens {options.max_tokens})",
            style="bold",
        )

    tokens: list[int] = []
    cached: int | None = None
    first_token_s: float | None = None
    finish_reason: str | None = None
    entries = 0
    try:
        async for entry in client.outputs(request_id, timeout=options.timeout):
            elapsed = time.perf_counter() - start
            entries += 1
            if entry.cached_tokens is not None and cached is None:
                cached = entry.cached_tokens
            if entry.token_ids and first_token_s is None:
                first_token_s = elapsed
            tokens.extend(entry.token_ids)
            finish_reason = entry.finish_reason
            _print_entry(out, entry, elapsed)
    except asyncio.CancelledError:
        # Ctrl-C: asyncio.run cancels this task. Free the request's KV on the daemon first.
        with contextlib.suppress(Exception):
            await client.cancel(request_id, timeout=_CANCEL_TIMEOUT_S)
        raise
    except TimeoutError:
        raise ToolError(
            f"no output for request {request_id} within {options.timeout:g} s (see --timeout)"
        ) from None
    except EngineError as error:
        raise engine_failure(error) from None
    e2e_s = time.perf_counter() - start

    summary: dict[str, Any] = {
        "type": "done",
        "request_id": request_id,
        "dp_rank": submitted.dp_rank,
        "prompt_tokens": prompt_tokens,
        "num_tokens": len(tokens),
        "token_ids": tokens,
        "finish_reason": finish_reason,
        "cached_tokens": cached,
        "num_outputs": entries,
        "ttft_ms": None if first_token_s is None else first_token_s * 1000.0,
        "e2e_ms": e2e_s * 1000.0,
    }
    if out.json:
        out.record(summary)
    else:
        ttft = "-" if first_token_s is None else f"{first_token_s * 1000.0:.1f} ms"
        out.line(
            f"finished {request_id}: {finish_reason}, {len(tokens)} tokens in {entries} "
            f"outputs, cached {cached if cached is not None else 0}/{prompt_tokens} prompt "
            f"tokens, ttft {ttft}, e2e {e2e_s * 1000.0:.1f} ms (wall)",
            style="bold green" if finish_reason == "length" else "bold red",
        )
    if finish_reason in ("length", "cancelled"):
        return EXIT_OK
    if finish_reason == "rejected":
        out.error(f"request {request_id} was rejected by the engine", "rejected")
    return EXIT_FAILURE


def _print_entry(out: Output, entry: OutputEntry, elapsed_s: float) -> None:
    if out.json:
        out.record(
            {
                "type": "output",
                "request_id": entry.request_id,
                "token_ids": entry.token_ids,
                "finished": entry.finished,
                "finish_reason": entry.finish_reason,
                "cached_tokens": entry.cached_tokens,
                "elapsed_ms": elapsed_s * 1000.0,
            }
        )
        return
    parts = [f"{elapsed_s * 1000.0:9.1f} ms", f"+{len(entry.token_ids)}", str(entry.token_ids)]
    if entry.cached_tokens is not None:
        parts.append(f"cached_tokens={entry.cached_tokens}")
    if entry.finished:
        parts.append(f"finished ({entry.finish_reason})")
    out.line("  ".join(parts))
