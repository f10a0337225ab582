"""Real NVIDIA Dynamo 1.6.1 processes on the loopback: a frontend, mocker or engined workers.

For tests and benchmarks alike. By default everything runs without etcd or NATS
(`docs/upstream/dynamo-1.6.1.md` §1): file discovery in a store directory of the
cluster's work dir, the TCP request plane, the ZMQ event plane. A cluster given other
`Planes` (`tests.interop.dynamo_planes`; etcd discovery and the nats planes with
`tests.interop.etcd_nats`) hands the same planes to its frontend and every worker. The
`DYN_*_HOST` variables of `peers.peer_env` make Dynamo bind and advertise 127.0.0.1 (except
its event-plane PUB sockets, which bind 0.0.0.0 on random ports whatever the variables say).
Every port is picked free on 127.0.0.1.

    with DynamoCluster(peers_python, tmp_path) as cluster:    # builds the tiny model
        frontend = cluster.frontend(router_mode="kv")          # waits for its HTTP API
        mocker = cluster.mocker(block_size=16)                 # waits until frontends list it
        reply = completions(frontend, words(128), max_tokens=4)
        frontend.wait_route(reply)                             # its `route request completed`

Each process logs (JSON lines, `DYN_LOGGING_JSONL=1`) to `<name>.log` in the work dir; a
start that fails or times out raises AssertionError with the log's tail. `stop()` sends
SIGTERM, then SIGKILL after a timeout. Processes die with the process that started them
(`PR_SET_PDEATHSIG`), so start them from the main thread. Workers start one after the other:
a worker is ready once a new `generate` instance of its namespace/component is in the
discovery backend (its id is `instance_id`, the `worker_id` of the frontend's route lines)
and every running frontend of its namespace lists it on `/health` (and, for workers that
serve clients, the model on `/v1/models`).

The OpenAI helpers (`completions`, `chat`) use urllib only and return the parsed reply or the
list of SSE chunks. Mocker workers emit token ids outside the tiny vocabulary, which the
frontend decodes to "" and drops from streams: ask for
`nvext={"extra_fields": ["completion_token_ids"]}` (`TOKEN_IDS_NVEXT`) to get one chunk per
token with its ids (`chunk_token_ids`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, Literal, overload

from tests.interop.dynamo_planes import Planes
from tests.interop.peers import peer_env
from tests.interop.tiny_model import build_tiny_model
from tests.support import free_tcp_port

READY_TIMEOUT_S: Final = 60.0  # a cold Dynamo start on a busy 2-core machine is slow
STOP_TIMEOUT_S: Final = 15.0
HTTP_TIMEOUT_S: Final = 30.0
POLL_S: Final = 0.05
LOG_TAIL_CHARS: Final = 4000
READY_LINE: Final = "engined dynamo-worker ready"
TOKEN_IDS_NVEXT: Final = {"extra_fields": ["completion_token_ids"]}
# Variables a caller's environment may hold that would make processes collide or leave the
# loopback: each process gets its own values (or none) from the harness.
_SCRUBBED_ENV: Final = (
    "DYN_SYSTEM_PORT",
    "DYN_SYSTEM_ENABLED",
    "DYN_HTTP_PORT",
    "DYN_HTTP_HOST",
    "DYN_NAMESPACE",
    "ETCD_ENDPOINTS",
    "NATS_SERVER",
)

# A direct opener: proxy settings of the environment must not route loopback calls.
_OPENER: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_system_port() -> int:
    """A free port for `DYN_SYSTEM_PORT`, which Dynamo 1.6.1 parses as an i16: below 32768,
    so never one of the kernel's ephemeral ports (32768-60999 here)."""
    rng = random.Random()
    for _attempt in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-32767 for DYN_SYSTEM_PORT")


def dynamo_env(
    planes: Planes | Path,
    *,
    home: Path | None = None,
    system_port: int | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment of a Dynamo process of the cluster of `planes` (or of the file store at
    that path).

    No system server unless `system_port` (then `/health`, `/metrics` and the model files
    are served there, and the model card points the frontend at them; without it the card
    points at the model directory, and `DYN_SELF_HOST_METADATA=0` says so without a warning).
    The frontend copies model files to `$HOME/.cache/dynamo/mdc` (not XDG_CACHE_HOME): HOME
    is `home` (by default a directory next to a file store), so that nothing is left outside
    the work dir.
    """
    if home is None:
        assert isinstance(planes, Path), "a HOME is needed beside other planes than a file store"
        home = planes.parent / "home"
    env = peer_env()
    for name in _SCRUBBED_ENV:
        env.pop(name, None)
    env.update({**Planes.of(planes).env(), "HOME": str(home), "PYTHONUNBUFFERED": "1"})
    if system_port is None:
        env["DYN_SELF_HOST_METADATA"] = "0"
    else:
        env["DYN_SYSTEM_PORT"] = str(system_port)
    env.update(extra or {})
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent thread dies (Linux), so that no
    process outlives a crashed test or benchmark."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _poll_until(
    what: str, check: Callable[[], Any], timeout: float, describe: Callable[[], str]
) -> Any:
    """`check()` until it returns a truthy value; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{describe()}")
        time.sleep(POLL_S)


# --- HTTP and the OpenAI API -----------------------------------------------------------------


class OpenAIError(AssertionError):
    """A non-2xx reply (or an SSE error event) from the frontend."""

    def __init__(self, status: int, body: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def _base_url(target: Frontend | str) -> str:
    return target.url if isinstance(target, Frontend) else target.rstrip("/")


def http_json(
    method: str, url: str, body: object | None = None, *, timeout: float = HTTP_TIMEOUT_S
) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with _OPENER.open(request, timeout=timeout) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
        exc.close()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


# Called with each SSE chunk of a stream as it arrives, so a test can act mid-stream.
OnChunk = Callable[[dict[str, Any]], None]


def _read_sse(reply: IO[bytes], what: str, on_chunk: OnChunk | None = None) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    event = ""
    for raw in reply:
        line = raw.decode().rstrip("\r\n")
        if not line:
            event = ""
            continue
        if line.startswith(":"):
            continue  # a comment or keep-alive
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return chunks
        if event == "error":
            raise OpenAIError(200, payload, f"{what}: SSE error event")
        chunks.append(json.loads(payload))
        if on_chunk is not None:
            on_chunk(chunks[-1])
    raise OpenAIError(200, json.dumps(chunks[-3:]), f"{what}: stream ended without [DONE]")


def post_openai(
    target: Frontend | str,
    path: str,
    body: Mapping[str, Any],
    *,
    timeout: float = HTTP_TIMEOUT_S,
    on_chunk: OnChunk | None = None,
) -> Any:
    """POST an OpenAI request: the reply's JSON, or its SSE chunks when `body["stream"]`
    (each also given to `on_chunk` as it arrives, so a test can act mid-stream)."""
    url = f"{_base_url(target)}{path}"
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    what = f"POST {path}"
    try:
        with _OPENER.open(request, timeout=timeout) as reply:
            if body.get("stream"):
                return _read_sse(reply, what, on_chunk)
            return json.loads(reply.read().decode())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        exc.close()
        raise OpenAIError(exc.code, text, what) from None


@overload
def completions(
    target: Frontend | str,
    prompt: str | Sequence[int],
    *,
    model: str = ...,
    max_tokens: int = ...,
    stream: Literal[False] = ...,
    timeout: float = ...,
    on_chunk: OnChunk | None = ...,
    **fields: Any,
) -> dict[str, Any]: ...
@overload
def completions(
    target: Frontend | str,
    prompt: str | Sequence[int],
    *,
    model: str = ...,
    max_tokens: int = ...,
    stream: Literal[True],
    timeout: float = ...,
    on_chunk: OnChunk | None = ...,
    **fields: Any,
) -> list[dict[str, Any]]: ...
def completions(
    target: Frontend | str,
    prompt: str | Sequence[int],
    *,
    model: str = "tiny",
    max_tokens: int = 16,
    stream: bool = False,
    timeout: float = HTTP_TIMEOUT_S,
    on_chunk: OnChunk | None = None,
    **fields: Any,
) -> dict[str, Any] | list[dict[str, Any]]:
    """`POST /v1/completions`; `fields` are added to the body (e.g. `ignore_eos=True`,
    `nvext=TOKEN_IDS_NVEXT`). Streams ask for a final usage chunk unless told otherwise."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(fields)
    result: dict[str, Any] | list[dict[str, Any]] = post_openai(
        target, "/v1/completions", body, timeout=timeout, on_chunk=on_chunk
    )
    return result


@overload
def chat(
    target: Frontend | str,
    messages: str | Sequence[Mapping[str, Any]],
    *,
    model: str = ...,
    max_tokens: int = ...,
    stream: Literal[False] = ...,
    timeout: float = ...,
    on_chunk: OnChunk | None = ...,
    **fields: Any,
) -> dict[str, Any]: ...
@overload
def chat(
    target: Frontend | str,
    messages: str | Sequence[Mapping[str, Any]],
    *,
    model: str = ...,
    max_tokens: int = ...,
    stream: Literal[True],
    timeout: float = ...,
    on_chunk: OnChunk | None = ...,
    **fields: Any,
) -> list[dict[str, Any]]: ...
def chat(
    target: Frontend | str,
    messages: str | Sequence[Mapping[str, Any]],
    *,
    model: str = "tiny",
    max_tokens: int = 16,
    stream: bool = False,
    timeout: float = HTTP_TIMEOUT_S,
    on_chunk: OnChunk | None = None,
    **fields: Any,
) -> dict[str, Any] | list[dict[str, Any]]:
    """`POST /v1/chat/completions`; a str is one user message."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(fields)
    result: dict[str, Any] | list[dict[str, Any]] = post_openai(
        target, "/v1/chat/completions", body, timeout=timeout, on_chunk=on_chunk
    )
    return result


def stream_usage(chunks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The usage of a stream (its last chunk with a non-null `usage`)."""
    for chunk in reversed(chunks):
        if chunk.get("usage"):
            usage: dict[str, Any] = chunk["usage"]
            return usage
    return None


def chunk_token_ids(chunk: Mapping[str, Any]) -> list[int]:
    """Token ids a chunk carries in `nvext.completion_token_ids` (with `TOKEN_IDS_NVEXT`)."""
    nvext = chunk.get("nvext") or {}
    return [int(t) for t in nvext.get("completion_token_ids") or ()]


def sets_on_first_token(begun: threading.Event) -> OnChunk:
    """An `on_chunk` that sets `begun` once a chunk carries token ids: the stream's client
    then holds a token, so the frontend has passed one (a daemon's own counts come earlier),
    and a migration of the stream carries at least one."""

    def seen(chunk: dict[str, Any]) -> None:
        if chunk_token_ids(chunk):
            begun.set()

    return seen


def stream_text(chunks: Sequence[Mapping[str, Any]]) -> str:
    """The concatenated text (completions) or content deltas (chat) of a stream."""
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            if "text" in choice:
                out.append(choice["text"] or "")
            else:
                out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def request_id_of(reply: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
    """The frontend's request id of a reply or stream (`id` without `cmpl-`/`chatcmpl-`)."""
    first = reply if isinstance(reply, Mapping) else reply[0]
    reply_id = str(first["id"])
    for prefix in ("chatcmpl-", "cmpl-"):
        if reply_id.startswith(prefix):
            return reply_id[len(prefix) :]
    return reply_id


# --- processes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouteLine:
    """A frontend log line `route request completed ... overlap_blocks=N ... worker_id=W`."""

    request_id: str
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    phase: str
    outcome: str
    fields: dict[str, Any]


class DynamoProcess:
    """One subprocess with its log in `<workdir>/<name>.log`; a context manager."""

    stop_signal: signal.Signals = signal.SIGTERM  # the one its program shuts down cleanly on

    def __init__(self, name: str, workdir: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.workdir = workdir
        self.env = dict(env)
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.command: list[str] = []
        self.returncode: int | None = None

    def __enter__(self) -> DynamoProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def command_line(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def _spawn(self) -> None:
        self.command = self.command_line()
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"--- {self.name}: {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.returncode = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is None:
            raise AssertionError(f"{self.name} was never started")
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"{self.name} exited with {code}\n{self.describe()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """`stop_signal`, SIGKILL after `timeout` s; the exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.returncode = self.proc.returncode
        return self.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def describe(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The log's path and tail, for assertion messages."""
        tail = self.log_text()[-chars:]
        return f"--- {self.name} log {self.log_path} (last {chars} chars):\n{tail}"

    def log_records(self) -> list[dict[str, Any]]:
        """The JSON lines of the log (other lines, e.g. a traceback, are skipped)."""
        records = []
        for raw in self.log_text().splitlines():
            if not raw.startswith("{"):
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def wait_for_log(self, fragment: str, timeout: float = READY_TIMEOUT_S) -> str:
        """The first log line containing `fragment`; fails if the process exits first."""

        def check() -> str | None:
            for line in self.log_text().splitlines():
                if fragment in line:
                    return line
            self.check_alive()
            return None

        line: str = _poll_until(
            f"{self.name}: {fragment!r} in the log", check, timeout, self.describe
        )
        return line


class Frontend(DynamoProcess):
    """`python -m dynamo.frontend` with its OpenAI HTTP API on 127.0.0.1:`port`."""

    def __init__(
        self,
        python: Path,
        workdir: Path,
        planes: Planes | Path,
        *,
        router_mode: str = "kv",
        name: str = "frontend",
        namespace: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.planes = Planes.of(planes)
        home = workdir / "home"
        super().__init__(name, workdir, dynamo_env(self.planes, home=home, extra=env))
        self.python = python
        self.router_mode = router_mode
        self.namespace = namespace
        self.extra_args = list(extra_args)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command_line(self) -> list[str]:
        command = [
            str(self.python),
            "-m",
            "dynamo.frontend",
            *self.planes.args(),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.port),
            "--router-mode",
            self.router_mode,
        ]
        if self.namespace is not None:
            command += ["--namespace", self.namespace]
        return command + self.extra_args

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start and wait for the HTTP API; retried on another port if that one was taken."""
        for _attempt in range(5):
            self.port = free_tcp_port()
            self._spawn()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(urllib.error.URLError, OSError):
                    status, _ = http_json("GET", f"{self.url}/v1/models", timeout=2.0)
                    if status == 200:
                        return
                time.sleep(POLL_S)
            else:
                self.stop()
                raise AssertionError(
                    f"{self.name}: no HTTP API within {timeout:.0f} s\n{self.describe()}"
                )
            if "Address already in use" not in self.log_text():
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}\n{self.describe()}"
                )
        raise AssertionError(f"{self.name}: no free port after 5 attempts\n{self.describe()}")

    # --- what it serves ---------------------------------------------------------------------

    def get(self, path: str, timeout: float = HTTP_TIMEOUT_S) -> Any:
        status, body = http_json("GET", f"{self.url}{path}", timeout=timeout)
        if status != 200:
            raise OpenAIError(status, str(body), f"{self.name} GET {path}")
        return body

    def models(self) -> list[str]:
        """Ids listed by `/v1/models`."""
        return [str(m["id"]) for m in self.get("/v1/models")["data"]]

    def instances(self) -> list[dict[str, Any]]:
        """Worker endpoint instances the frontend discovered (`/health`'s `instances`)."""
        status, body = http_json("GET", f"{self.url}/health")
        if not isinstance(body, dict):
            raise OpenAIError(status, str(body), f"{self.name} GET /health")
        found: list[dict[str, Any]] = body.get("instances") or []
        return found

    def has_instance(
        self, instance_id: int, *, namespace: str, component: str, endpoint: str
    ) -> bool:
        return any(
            int(i["instance_id"]) == instance_id
            and i.get("namespace") == namespace
            and i.get("component") == component
            and i.get("endpoint") == endpoint
            for i in self.instances()
        )

    def metrics(self) -> str:
        status, body = http_json("GET", f"{self.url}/metrics")
        if status != 200:
            raise OpenAIError(status, str(body), f"{self.name} GET /metrics")
        return str(body)

    def wait_for_model(
        self, model: str, *, present: bool = True, timeout: float = READY_TIMEOUT_S
    ) -> None:
        """Until `/v1/models` lists `model` (or, with present=False, no longer does)."""

        def check() -> bool:
            self.check_alive()
            return (model in self.models()) == present

        verb = "list" if present else "drop"
        _poll_until(f"{self.name}: /v1/models to {verb} {model!r}", check, timeout, self.describe)

    # --- the router's log -------------------------------------------------------------------

    def route_lines(self) -> list[RouteLine]:
        """Every `route request completed` line so far, in log order."""
        out = []
        for record in self.log_records():
            if record.get("message") != "route request completed":
                continue
            out.append(
                RouteLine(
                    request_id=str(record.get("request_id", "")),
                    worker_id=int(record.get("worker_id", -1)),
                    dp_rank=int(record.get("dp_rank", 0)),
                    overlap_blocks=int(record.get("overlap_blocks", -1)),
                    phase=str(record.get("phase", "")),
                    outcome=str(record.get("request.outcome", "")),
                    fields=record,
                )
            )
        return out

    def wait_route(
        self,
        reply: Mapping[str, Any] | Sequence[Mapping[str, Any]] | str,
        *,
        count: int = 1,
        timeout: float = 10.0,
    ) -> list[RouteLine]:
        """The route lines of one request (a reply, its chunks or its request id): at least
        `count` of them (a request routed in phases, prefill then decode, may have one per
        phase). A line is written when the routed stream ends, a moment after the client saw
        the reply, hence the wait."""
        request_id = reply if isinstance(reply, str) else request_id_of(reply)

        def check() -> list[RouteLine] | None:
            lines = [line for line in self.route_lines() if line.request_id == request_id]
            return lines if len(lines) >= count else None

        lines: list[RouteLine] = _poll_until(
            f"{self.name}: {count} route line(s) of request {request_id}",
            check,
            timeout,
            self.describe,
        )
        return lines


class Worker(DynamoProcess):
    """A Dynamo worker: ready when its `generate` instance is in the discovery backend."""

    serves_clients = True

    def __init__(
        self,
        name: str,
        workdir: Path,
        planes: Planes | Path,
        *,
        python: Path,
        model_path: Path,
        model_name: str,
        namespace: str,
        component: str,
        endpoint: str,
        system_port: bool,
        env: Mapping[str, str] | None,
        extra_args: Sequence[str],
    ) -> None:
        self.system_port = free_system_port() if system_port else None
        self.planes = Planes.of(planes)
        env = dynamo_env(
            self.planes, home=workdir / "home", system_port=self.system_port, extra=env
        )
        super().__init__(name, workdir, env)
        self.python = python
        self.model_path = model_path
        self.model_name = model_name
        self.namespace = namespace
        self.component = component
        self.endpoint = endpoint
        self.extra_args = list(extra_args)
        self.instance_id: int | None = None

    def store_instances(self) -> set[int]:
        """Instance ids of this worker's namespace/component/endpoint in the discovery
        backend (the name is the file store's, kept for its callers)."""
        return self.planes.instances_of(self.namespace, self.component, self.endpoint)

    def _ready_signal(self, timeout: float) -> None:
        """A worker kind's own readiness (e.g. a log line), checked after registration."""

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        before = self.store_instances()
        self._spawn()
        deadline = time.monotonic() + timeout

        def registered() -> int | None:
            self.check_alive()
            new = self.store_instances() - before
            return min(new) if new else None

        self.instance_id = _poll_until(
            f"{self.name}: a new {self.namespace}.{self.component}.{self.endpoint} instance",
            registered,
            timeout,
            self.describe,
        )
        self._ready_signal(max(1.0, deadline - time.monotonic()))

    def wait_listed(self, frontend: Frontend, timeout: float = READY_TIMEOUT_S) -> None:
        """Until `frontend` knows this worker's instance (and lists its model)."""
        assert self.instance_id is not None, f"{self.name} is not started"
        instance_id = self.instance_id

        def check() -> bool:
            self.check_alive()
            frontend.check_alive()
            if not frontend.has_instance(
                instance_id,
                namespace=self.namespace,
                component=self.component,
                endpoint=self.endpoint,
            ):
                return False
            return not self.serves_clients or self.model_name in frontend.models()

        _poll_until(
            f"{frontend.name} to discover {self.name} (instance {instance_id})",
            check,
            timeout,
            lambda: f"{self.describe()}\n{frontend.describe()}",
        )


def _component_for(mode: str, component: str | None) -> str:
    if component is not None:
        return component
    return "prefill" if mode == "prefill" else "backend"


# The mocker's `--speedup-ratio 0` is documented as "infinite speedup" but runs at about
# real time in 1.6.1 (32 x (512 + 64) tokens: 1.0 s at 0 and at 1, 0.1 s at 1e6).
MOCKER_FAST: Final = 1e6


class MockerWorker(Worker):
    """`python -m dynamo.mocker`, one worker; as fast as it goes unless `speedup_ratio`."""

    def __init__(
        self,
        python: Path,
        workdir: Path,
        planes: Planes | Path,
        model_path: Path,
        *,
        model_name: str = "tiny",
        name: str = "mocker",
        block_size: int = 16,
        num_gpu_blocks: int = 16384,
        speedup_ratio: float = MOCKER_FAST,
        disaggregation_mode: str = "agg",
        namespace: str = "dynamo",
        component: str | None = None,
        endpoint: str = "generate",
        system_port: bool = False,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(
            name,
            workdir,
            planes,
            python=python,
            model_path=model_path,
            model_name=model_name,
            namespace=namespace,
            component=_component_for(disaggregation_mode, component),
            endpoint=endpoint,
            system_port=system_port,
            env=env,
            extra_args=extra_args,
        )
        self.serves_clients = disaggregation_mode != "prefill"
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.speedup_ratio = speedup_ratio
        self.disaggregation_mode = disaggregation_mode

    def command_line(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "dynamo.mocker",
            "--model-path",
            str(self.model_path),
            "--model-name",
            self.model_name,
            "--endpoint",
            f"dyn://{self.namespace}.{self.component}.{self.endpoint}",
            *self.planes.args(),
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks),
            "--speedup-ratio",
            str(self.speedup_ratio),
            "--disaggregation-mode",
            self.disaggregation_mode,
            *self.extra_args,
        ]


class EnginedDaemon(DynamoProcess):
    """`engined serve` (this interpreter's engined): control on tcp://127.0.0.1:free port,
    KV events, replay and FPM on ipc:// sockets in the work dir (rank r: path-r), no OpenAI
    API unless `args` ask for one (`--port`)."""

    def __init__(
        self,
        workdir: Path,
        args: Sequence[str] = (),
        *,
        name: str = "engined",
        python: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(name, workdir, {**os.environ, **(env or {})})
        self.python = python or Path(sys.executable)
        self.args = list(args)
        self.control = ""
        base = workdir / name
        self.kv = f"ipc://{base}-kv"
        self.replay = f"ipc://{base}-replay"
        self.fpm = f"ipc://{base}-fpm"

    def command_line(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "engined.cli",
            "serve",
            "--control-endpoint",
            self.control,
            "--kv-events-endpoint",
            self.kv,
            "--kv-replay-endpoint",
            self.replay,
            "--fpm-endpoint",
            self.fpm,
            "--log-format",
            "json",
            # No OpenAI API of its own (the frontend serves HTTP), as the README runs it: the
            # default port 8000 would be shared with whatever else runs on the machine.
            "--port",
            "",
            *self.args,
        ]

    def _answers(self) -> bool:
        from engined.client import EngineClient

        async def probe() -> None:
            async with await EngineClient.connect(self.control) as client:
                await client.ping(timeout=0.5)

        try:
            asyncio.run(probe())
        except (TimeoutError, OSError):
            return False
        return True

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start and wait until it answers `ping`; retried on another port if taken."""
        for _attempt in range(5):
            self.control = f"tcp://127.0.0.1:{free_tcp_port()}"
            self._spawn()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    break
                if self._answers():
                    return
            else:
                self.stop()
                raise AssertionError(
                    f"{self.name}: no answer within {timeout:.0f} s\n{self.describe()}"
                )
            if "Address already in use" not in self.log_text():
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}\n{self.describe()}"
                )
        raise AssertionError(f"{self.name}: no free port after 5 attempts\n{self.describe()}")

    def restart(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start again on the same endpoints (after `stop()` or a kill) and wait until it
        answers `ping`: a new daemon start, with a new `instance_id`, where the old one was."""
        assert self.control, f"{self.name} was never started"
        self._spawn()

        def answers() -> bool:
            self.check_alive()
            return self._answers()

        _poll_until(f"{self.name}: an answer after restarting", answers, timeout, self.describe)


class EnginedWorker(Worker):
    """`python -m engined.dynamo` (the peers venv, with engined installed) serving `generate`
    for an engined daemon; ready when also its log says `engined dynamo-worker ready`."""

    def __init__(
        self,
        python: Path,
        workdir: Path,
        planes: Planes | Path,
        model_path: Path,
        control_endpoint: str,
        *,
        model_name: str = "tiny",
        name: str = "engined-worker",
        disaggregation_mode: str = "agg",
        namespace: str = "dynamo",
        component: str | None = None,
        endpoint: str = "generate",
        system_port: bool = False,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(
            name,
            workdir,
            planes,
            python=python,
            model_path=model_path,
            model_name=model_name,
            namespace=namespace,
            component=_component_for(disaggregation_mode, component),
            endpoint=endpoint,
            system_port=system_port,
            env=env,
            extra_args=extra_args,
        )
        self.serves_clients = disaggregation_mode != "prefill"
        self.control_endpoint = control_endpoint
        self.disaggregation_mode = disaggregation_mode

    def command_line(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "engined.dynamo",
            "--control-endpoint",
            self.control_endpoint,
            "--model-path",
            str(self.model_path),
            "--served-model-name",
            self.model_name,
            "--disaggregation-mode",
            self.disaggregation_mode,
            "--namespace",
            self.namespace,
            "--component",
            self.component,
            "--endpoint",
            self.endpoint,
            *self.planes.args(),
            *self.extra_args,
        ]

    def _ready_signal(self, timeout: float) -> None:
        self.wait_for_log(READY_LINE, timeout)


class DynamoCluster:
    """Processes sharing one set of `planes` (by default: a file store in `workdir`, tcp
    requests, zmq events); `close()` (or leaving the `with`) stops them all, newest first, and
    returns their exit statuses by name.

    Start frontends before workers, or call `worker.wait_listed(frontend)` for a frontend
    started later. Names must be unique (they name the log files). Clusters may share an etcd:
    give each its own namespaces, and its frontends `namespace=`."""

    def __init__(
        self,
        python: Path,
        workdir: Path,
        *,
        model_path: Path | None = None,
        model_name: str = "tiny",
        planes: Planes | None = None,
    ) -> None:
        self.python = python
        self.workdir = workdir
        self.planes = planes or Planes.of(workdir / "dynamo_store_kv")
        self.model_name = model_name
        self._model_path = model_path
        self.processes: list[DynamoProcess] = []
        self.exit_codes: dict[str, int | None] = {}

    def __enter__(self) -> DynamoCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def model_path(self) -> Path:
        """The model directory (the tiny model, built on first use when none was given)."""
        if self._model_path is None:
            self._model_path = build_tiny_model(self.workdir / "tiny-model", python=self.python)
        return self._model_path

    @property
    def store(self) -> Planes:
        """The planes, under the name of the file store they once were (what the process
        classes take as their third argument)."""
        return self.planes

    def frontends(self) -> list[Frontend]:
        return [p for p in self.processes if isinstance(p, Frontend) and p.alive()]

    def _unique(self, name: str) -> str:
        taken = {p.name for p in self.processes}
        if name not in taken:
            return name
        return next(f"{name}-{i}" for i in range(2, 1000) if f"{name}-{i}" not in taken)

    def _add(self, process: DynamoProcess) -> None:
        self.processes.append(process)
        process.start()
        if isinstance(process, Worker):
            for frontend in self.frontends():
                if frontend.namespace in (None, process.namespace):
                    process.wait_listed(frontend)

    def frontend(
        self,
        *,
        router_mode: str = "kv",
        name: str = "frontend",
        namespace: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Frontend:
        """A started frontend; with `namespace`, it discovers that namespace's models only."""
        frontend = Frontend(
            self.python,
            self.workdir,
            self.planes,
            router_mode=router_mode,
            name=self._unique(name),
            namespace=namespace,
            extra_args=extra_args,
            env=env,
        )
        self._add(frontend)
        return frontend

    def mocker(self, *, name: str = "mocker", **options: Any) -> MockerWorker:
        """A started `MockerWorker` (options: its keyword arguments) every frontend lists."""
        worker = MockerWorker(
            self.python,
            self.workdir,
            self.planes,
            self.model_path,
            model_name=self.model_name,
            name=self._unique(name),
            **options,
        )
        self._add(worker)
        return worker

    def engined_daemon(
        self, *args: str, name: str = "engined", env: Mapping[str, str] | None = None
    ) -> EnginedDaemon:
        """A started `engined serve` with `args` (of this interpreter's engined)."""
        daemon = EnginedDaemon(self.workdir, args, name=self._unique(name), env=env)
        self._add(daemon)
        return daemon

    def engined_worker(
        self, daemon: EnginedDaemon | str, *, name: str = "engined-worker", **options: Any
    ) -> EnginedWorker:
        """A started `EnginedWorker` for a daemon (or a control endpoint)."""
        control = daemon.control if isinstance(daemon, EnginedDaemon) else daemon
        worker = EnginedWorker(
            self.python,
            self.workdir,
            self.planes,
            self.model_path,
            control,
            model_name=self.model_name,
            name=self._unique(name),
            **options,
        )
        self._add(worker)
        return worker

    def stop(self, process: DynamoProcess, timeout: float = STOP_TIMEOUT_S) -> int | None:
        code = process.stop(timeout)
        self.exit_codes[process.name] = code
        return code

    def close(self) -> dict[str, int | None]:
        for process in reversed(self.processes):
            if process.name not in self.exit_codes or process.alive():
                self.stop(process)
        return dict(self.exit_codes)

    def describe(self) -> str:
        """Every process's log tail, for assertion messages."""
        return "\n".join(p.describe() for p in self.processes)


@contextlib.contextmanager
def dynamo_cluster(
    python: Path,
    workdir: Path,
    *,
    model_path: Path | None = None,
    model_name: str = "tiny",
    planes: Planes | None = None,
) -> Iterator[DynamoCluster]:
    """A `DynamoCluster` stopped on exit (the form a pytest fixture yields from)."""
    cluster = DynamoCluster(
        python, workdir, model_path=model_path, model_name=model_name, planes=planes
    )
    try:
        yield cluster
    finally:
        cluster.close()
