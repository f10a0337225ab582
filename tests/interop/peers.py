"""Real third-party consumers (NVIDIA Dynamo 1.6.1) run next to a real daemon.

The peers live in their own venv (`.venv-peers`, made by `.ci/run`, see
`docs/upstream/dynamo-1.6.1.md` §2) so that Dynamo's pinned msgspec and pyzmq never
touch ours: tests run them as subprocesses of that venv's python. `INTEROP_PEERS_PYTHON`
points at another interpreter. Without peers the interop tests skip, except under CI
(`CI=true`) or with `INTEROP_PEERS_PYTHON` set, where missing peers fail them.

Everything stays on the loopback: the daemon's sockets are ipc:// (Dynamo's ZMQ listener
accepts any ZeroMQ endpoint), the indexer's HTTP API is reached on 127.0.0.1, and the
`DYN_*_HOST` variables pin every address Dynamo would otherwise pick from eth0.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final

import pytest

from tests.support import free_tcp_port

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
PEERS_PYTHON_ENV: Final = "INTEROP_PEERS_PYTHON"
DEFAULT_PEERS_PYTHON: Final = REPO_ROOT / ".venv-peers" / "bin" / "python"
# The README's "Behind NVIDIA Dynamo" install (and .ci/run's): engined with its dynamo extra
# (the worker, and `tokenizers` for the tiny model), the frontend, its few real dependencies.
INSTALL_HINT: Final = (
    "python3 -m venv .venv-peers && .venv-peers/bin/pip install -e '.[dynamo]' && "
    ".venv-peers/bin/pip install --no-deps ai-dynamo==1.6.1 && "
    ".venv-peers/bin/pip install pyyaml packaging aiohttp"
)
# What the tests use from the peers venv; importing it also proves the Rust core loads.
_PROBE: Final = (
    "import dynamo.llm, dynamo.indexer, dynamo.common.forward_pass_metrics as f; "
    "from importlib.metadata import version; print(version('ai-dynamo-runtime'))"
)
DYNAMO_VERSION: Final = "1.6.1"
HTTP_TIMEOUT_S: Final = 5.0
START_TIMEOUT_S: Final = 30.0


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@cache
def _probe_peers() -> tuple[Path | None, str]:
    """(interpreter, "") when the peers venv works, else (None, why not)."""
    configured = os.environ.get(PEERS_PYTHON_ENV)
    python = Path(configured) if configured else DEFAULT_PEERS_PYTHON
    where = f"{PEERS_PYTHON_ENV}={configured}" if configured else str(DEFAULT_PEERS_PYTHON)
    if not python.exists():
        return None, f"no peers interpreter at {where}; make it with: {INSTALL_HINT}"
    try:
        probe = subprocess.run(
            [str(python), "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=120,
            env=peer_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"peers interpreter {where} does not run: {exc}"
    if probe.returncode != 0:
        return None, f"peers interpreter {where} cannot import Dynamo:\n{probe.stderr[-2000:]}"
    installed = probe.stdout.strip()
    if installed != DYNAMO_VERSION:
        return None, f"peers venv has ai-dynamo-runtime {installed}, want {DYNAMO_VERSION}"
    return python, ""


def require_peers() -> Path:
    """The peers venv's python.

    Without a working one the test skips, or fails when the peers are expected: under CI
    (`CI=true`) or when `INTEROP_PEERS_PYTHON` names the interpreter (as `.ci/run` does).
    """
    python, why = _probe_peers()
    if python is None:
        if in_ci() or os.environ.get(PEERS_PYTHON_ENV):
            pytest.fail(f"the Dynamo peers are required here but unusable: {why}", pytrace=False)
        pytest.skip(why)
    return python


def peer_env(tmp: Path | None = None) -> dict[str, str]:
    """Environment of a Dynamo process: loopback only, JSON logs, nothing fetched."""
    env = dict(os.environ)
    # Proxies would only matter for HTTP clients inside Dynamo; none may be used here.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        env.pop(name, None)
    env.update(
        {
            # docs/upstream/dynamo-1.6.1.md §1: without these Dynamo binds and advertises on eth0.
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "NO_PROXY": "*",
            "no_proxy": "*",
            "DYN_LOG": "info",
            "DYN_LOGGING_JSONL": "1",
            "NO_COLOR": "1",
        }
    )
    if tmp is not None:
        env["DYN_DISCOVERY_BACKEND"] = "file"
        env["DYN_FILE_KV"] = str(tmp / "dynamo_store_kv")
    return env


# A direct opener: proxy settings of the environment must not route loopback calls.
_OPENER: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --- the standalone KV indexer --------------------------------------------------------------

# Fragments of indexer log lines that mean an event or batch was refused or lost, whatever
# the level they are logged at (docs/upstream/dynamo-1.6.1.md §7 and the listener's messages).
FORBIDDEN_FRAGMENTS: Final = (
    "Failed to decode",  # a live or replayed batch the decoder refused
    "did not match any variant",  # e.g. bytes block hashes
    "Failed to find parent block",
    "unknown parent block hash",
    "token_ids too short",
    "Block not published",
    "Failed to apply",
    "Unexpected ZMQ frame count",
    "Invalid sequence number length",
    "Unexpected replay frame count",
    "Invalid replay seq length",
    "Replay incomplete",
    "No replay endpoint configured",
    "batches lost",
    "Failed to send replay request",
    "Replay recv error",
    "ZMQ listener failed",
)
# Warnings the indexer gives for a normal late or slow join; each must be recovered.
ALLOWED_WARNING_PREFIXES: Final = ("Gap detected",)


@dataclass(frozen=True, slots=True)
class LogLine:
    level: str
    message: str
    fields: dict[str, Any]
    raw: str

    def key(self) -> tuple[Any, Any]:
        """(worker_id, dp_rank) of a listener line (some name them `self.worker_id`)."""
        f = self.fields
        return f.get("worker_id", f.get("self.worker_id")), f.get("dp_rank", f.get("self.dp_rank"))


class DynamoIndexer:
    """`python -m dynamo.indexer` on a loopback HTTP port, its log captured to a file.

    Workers are added with `register` (the `--workers` flag takes no replay endpoint; the
    HTTP `/register` does, docs/upstream/dynamo-1.6.1.md §7). Use as a context manager.
    """

    def __init__(
        self, python: Path, tmp_path: Path, name: str, *, block_size: int, model: str = "m"
    ) -> None:
        self.python = python
        self.name = name
        self.block_size = block_size
        self.model = model
        self.log_path = tmp_path / f"{name}.log"
        self._tmp = tmp_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DynamoIndexer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the indexer and wait for `/health`; retries if the chosen port was taken."""
        for _attempt in range(5):
            self.port = free_tcp_port()
            with self.log_path.open("wb") as log:
                self.proc = subprocess.Popen(
                    [
                        str(self.python),
                        "-m",
                        "dynamo.indexer",
                        "--block-size",
                        str(self.block_size),
                        "--port",
                        str(self.port),
                        "--threads",
                        "1",
                        "--model-name",
                        self.model,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=peer_env(self._tmp),
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    status, _ = self.http("GET", "/health")
                except (urllib.error.URLError, OSError):
                    # Not listening yet: the HTTP server's own start is the only signal.
                    time.sleep(0.05)
                    continue
                if status == 200:
                    return
            else:
                self.stop()
                raise AssertionError(f"{self.name}: no /health within {START_TIMEOUT_S} s")
            if "Address already in use" not in self.log_text():
                raise AssertionError(f"{self.name} exited early:\n{self.log_text()[-4000:]}")
        raise AssertionError(f"{self.name}: no free port after 5 attempts")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def http(self, method: str, path: str, body: object | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with _OPENER.open(request, timeout=HTTP_TIMEOUT_S) as reply:
                status, text = reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
            exc.close()
        try:
            return status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return status, text

    def register(
        self, instance_id: int, dp_rank: int, endpoint: str, replay_endpoint: str | None
    ) -> None:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": self.model,
            "block_size": self.block_size,
            "dp_rank": dp_rank,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        status, reply = self.http("POST", "/register", body)
        assert status == 201, f"{self.name}: /register {body} -> {status} {reply}"

    def workers(self) -> Any:
        status, reply = self.http("GET", "/workers")
        assert status == 200, (status, reply)
        return reply

    def query(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> dict[tuple[int, int], int]:
        """`POST /query`: matched device-tier TOKENS per (instance_id, dp_rank), zeros omitted;
        `lora_name` asks for the blocks of that LoRA adapter."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "model_name": self.model}
        if lora_name is not None:
            body["lora_name"] = lora_name
        status, reply = self.http("POST", "/query", body)
        assert status == 200, f"{self.name}: /query -> {status} {reply}"
        out: dict[tuple[int, int], int] = {}
        for worker, ranks in reply["scores"].items():
            for rank, tokens in ranks.items():
                if tokens:
                    out[(int(worker), int(rank))] = int(tokens)
        return out

    def query_tiers(self, token_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """`POST /query`'s per-instance detail: `gpu`, `cpu`, `disk`, ... matched TOKENS.

        The flat `scores` count the device tier only; the lower tiers (host-pinned `cpu`,
        `disk`) continue from where a worker's device match ends.
        """
        status, reply = self.http(
            "POST", "/query", {"token_ids": list(token_ids), "model_name": self.model}
        )
        assert status == 200, f"{self.name}: /query -> {status} {reply}"
        return {int(worker): detail for worker, detail in reply.get("instances", {}).items()}

    def dump_blocks(self) -> dict[tuple[int, int], set[int]]:
        """`GET /dump`: the device-tier block hashes per (instance_id, dp_rank), empty omitted.

        The dump is the indexer's tree as Dynamo JSON events; they are applied in order, so a
        removal or clear in it would be honoured too.
        """
        status, reply = self.http("GET", "/dump")
        assert status == 200, f"{self.name}: /dump -> {status} {reply}"
        blocks: dict[tuple[int, int], set[int]] = {}
        for model in reply.values():
            for item in model["events"]:
                if item.get("storage_tier", "device") != "device":
                    continue
                event = item["event"]
                key = (int(item["worker_id"]), int(event.get("dp_rank", 0)))
                data = event["data"]
                if data == "cleared":
                    blocks.pop(key, None)
                elif "stored" in data:
                    blocks.setdefault(key, set()).update(
                        int(b["block_hash"]) for b in data["stored"]["blocks"]
                    )
                elif "removed" in data:
                    blocks.setdefault(key, set()).difference_update(
                        int(h) for h in data["removed"]["block_hashes"]
                    )
                else:
                    raise AssertionError(f"{self.name}: unknown /dump event {item}")
        return {key: hashes for key, hashes in blocks.items() if hashes}

    # --- the log --------------------------------------------------------------------------

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_lines(self) -> tuple[list[LogLine], list[str]]:
        """(JSON log lines, lines that are not JSON)."""
        parsed: list[LogLine] = []
        other: list[str] = []
        for raw in self.log_text().splitlines():
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                other.append(raw)
                continue
            if not isinstance(record, dict):
                other.append(raw)
                continue
            parsed.append(
                LogLine(str(record.get("level", "")), str(record.get("message", "")), record, raw)
            )
        return parsed, other

    def log_problems(self) -> list[str]:
        """Every log line that shows a refused, undecodable or lost event.

        Problems: a line that is not JSON (e.g. a traceback), a WARN or ERROR other than a
        gap notice, a line naming a decode failure, an unknown parent, short token_ids, an
        incomplete or failed replay; a gap with no replay request after it, or a replay
        that brought fewer batches than the gap it was asked to fill.
        """
        lines, other = self.log_lines()
        problems = [f"not a JSON log line: {raw}" for raw in other]
        gaps: dict[tuple[Any, Any], LogLine] = {}
        requested: dict[tuple[Any, Any], LogLine] = {}
        for line in lines:
            forbidden = any(fragment in line.message for fragment in FORBIDDEN_FRAGMENTS)
            warning = line.level in {"WARN", "WARNING", "ERROR"}
            if forbidden or (warning and not line.message.startswith(ALLOWED_WARNING_PREFIXES)):
                problems.append(line.raw)
            if line.message.startswith("Gap detected"):
                if line.key() in gaps:
                    problems.append(f"gap without recovery: {gaps[line.key()].raw}")
                gaps[line.key()] = line
            elif line.message == "Requesting replay from engine":
                gaps.pop(line.key(), None)
                requested[line.key()] = line
            elif line.message == "Replay complete":
                request = requested.pop(line.key(), None)
                if request is None:
                    problems.append(f"replay without request: {line.raw}")
                    continue
                wanted = int(request.fields["end_seq"]) - int(request.fields["start_seq"])
                if int(line.fields.get("replayed", -1)) < wanted:
                    problems.append(f"replay short of {wanted} batches: {line.raw}")
        problems += [f"gap without recovery: {line.raw}" for line in gaps.values()]
        problems += [f"replay never completed: {line.raw}" for line in requested.values()]
        return problems

    def recovered_gaps(self) -> list[tuple[int, int, int]]:
        """(dp_rank, start_seq, end_seq) of every replay the indexer requested."""
        lines, _ = self.log_lines()
        return [
            (int(line.key()[1]), int(line.fields["start_seq"]), int(line.fields["end_seq"]))
            for line in lines
            if line.message == "Requesting replay from engine"
        ]
