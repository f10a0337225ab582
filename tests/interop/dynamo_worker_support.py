"""Helpers of `test_dynamo_worker.py`: engined daemons behind `engined dynamo-worker`s,
Dynamo frontends in front of them.

Every group of workers gets a namespace of its own (`EnginedGroup`), so one frontend serves
several models whose routers and route lines never mix. What `tests.interop.dynamo_cluster`
does not offer is here: a worker started under a model name other than the cluster's, a
frontend scoped to one namespace, the wait until a frontend's routers have taken workers
in, the daemon's `stats`/`welcome` over the control protocol, the frontend's KV event
counters, a stream the client abandons half-way, and a worker run to its (expected)
start-up failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.wire.control import RankStats, Welcome
from tests.interop.dynamo_cluster import (
    POLL_S,
    READY_LINE,
    READY_TIMEOUT_S,
    DynamoCluster,
    EnginedDaemon,
    EnginedWorker,
    Frontend,
)
from tests.interop.tiny_model import words

BLOCK_SIZE: Final = 16
# Every daemon has the block size the tests count in; all but the paced one run as fast as
# the CPU allows.
BLOCK_ARGS: Final = ("--block-size", str(BLOCK_SIZE))
FAST_ARGS: Final = (*BLOCK_ARGS, "--speedup-ratio", "0")
CONTROL_TIMEOUT_S: Final = 5.0
FPM_TIMEOUT_S: Final = 10.0
DECODE_HELPER: Final = Path(__file__).with_name("dynamo_fpm_decode.py")

T = TypeVar("T")


def poll_until(
    what: str,
    check: Callable[[], T | None],
    timeout: float,
    describe: Callable[[], str] = str,
) -> T:
    """`check()` until it returns something other than None/False; AssertionError at the
    deadline with `describe()`. (Between checks: the POLL_S pause of a polling loop.)"""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s\n{describe()}")
        time.sleep(POLL_S)


def cached_after_full_repeat(prompt_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """vLLM's prefix hit for a prompt seen before in full: whole blocks of all but its last
    token (the last one is always computed, to get logits)."""
    return (prompt_tokens - 1) // block_size * block_size


# --- the daemon over the control protocol -----------------------------------------------------


def _control(endpoint: str, call: Callable[[EngineClient], Any]) -> Any:
    async def run() -> Any:
        async with await EngineClient.connect(endpoint) as client:
            return await call(client)

    return asyncio.run(run())


def welcome(daemon: EnginedDaemon) -> Welcome:
    result: Welcome = _control(daemon.control, lambda c: c.hello(timeout=CONTROL_TIMEOUT_S))
    return result


def rank_stats(daemon: EnginedDaemon) -> list[RankStats]:
    reply = _control(daemon.control, lambda c: c.stats(timeout=CONTROL_TIMEOUT_S))
    ranks: list[RankStats] = list(reply.ranks)
    return ranks


async def _one_frame_per_rank(endpoints: list[str]) -> list[bytes]:
    """The first FPM payload each rank's PUB sends a new subscriber (a heartbeat while idle)."""
    ctx = zmq.asyncio.Context()
    try:
        subs = []
        for endpoint in endpoints:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(endpoint)
            subs.append(sub)
        frames = await asyncio.wait_for(
            asyncio.gather(*(sub.recv_multipart() for sub in subs)), FPM_TIMEOUT_S
        )
        return [payload for _topic, _seq, payload in frames]
    finally:
        ctx.destroy(linger=0)


def fpm_stamps(daemon: EnginedDaemon, peers_python: Path) -> list[tuple[str, int]]:
    """(worker_id, dp_rank) of each rank's next FPM frame, as Dynamo's own decoder reads it."""
    payloads = asyncio.run(_one_frame_per_rank(list(welcome(daemon).fpm_endpoints)))
    decoded = subprocess.run(
        [str(peers_python), str(DECODE_HELPER)],
        input=json.dumps([p.hex() for p in payloads]),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    results = json.loads(decoded.stdout)["results"]
    return [(r["metrics"]["worker_id"], r["metrics"]["dp_rank"]) for r in results]


def busy(stats: Sequence[RankStats]) -> list[dict[str, int]]:
    """What every rank still holds or runs (all zeros when idle)."""
    return [
        {
            "dp_rank": s.dp_rank,
            "active_blocks": s.active_blocks,
            "running": s.running,
            "waiting": s.waiting,
        }
        for s in stats
    ]


def is_idle(stats: Sequence[RankStats]) -> bool:
    return all(s.active_blocks == 0 and s.running == 0 and s.waiting == 0 for s in stats)


def wait_idle(daemon: EnginedDaemon, timeout: float) -> list[RankStats]:
    """Until no rank of `daemon` has an active block, a running or a waiting request."""
    last: list[RankStats] = []

    def check() -> list[RankStats] | None:
        daemon.check_alive()
        last[:] = rank_stats(daemon)
        return list(last) if is_idle(last) else None

    try:
        return poll_until(f"{daemon.name} idle", check, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}last stats: {busy(last)}\n{daemon.describe()}") from None


# --- workers --------------------------------------------------------------------------------


@dataclass
class EnginedGroup:
    """Daemons and their workers serving `model` in `namespace`."""

    model: str
    namespace: str
    daemons: list[EnginedDaemon]
    workers: list[EnginedWorker]

    def worker_ids(self) -> list[int]:
        ids = [w.instance_id for w in self.workers]
        assert all(i is not None for i in ids), ids
        return [int(i) for i in ids if i is not None]


def add_worker(
    cluster: DynamoCluster,
    daemon: EnginedDaemon,
    *,
    name: str,
    model: str,
    namespace: str,
    disaggregation_mode: str = "agg",
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    system_port: bool = False,
) -> EnginedWorker:
    """A started worker for `daemon` serving `model` (its own name, not the cluster's), which
    every running frontend of its namespace (or of all namespaces) lists. A decode worker's
    model is only listed once its prefill worker is up: start the prefill one first.
    `system_port`: Dynamo's system status server on a port of its own (`worker.system_port`)."""
    worker = _start_worker(
        cluster,
        daemon,
        name=name,
        model=model,
        namespace=namespace,
        disaggregation_mode=disaggregation_mode,
        env=env,
        extra_args=extra_args,
        system_port=system_port,
    )
    for frontend in cluster.frontends():
        if frontend.namespace in (None, namespace):
            worker.wait_listed(frontend)
    return worker


def _start_worker(
    cluster: DynamoCluster,
    daemon: EnginedDaemon,
    *,
    name: str,
    model: str,
    namespace: str,
    disaggregation_mode: str = "agg",
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    system_port: bool = False,
) -> EnginedWorker:
    """An `EnginedWorker` for `daemon` in `cluster`, started, and stopped (its exit status
    kept) by `cluster.close()`."""
    worker = EnginedWorker(
        cluster.python,
        cluster.workdir,
        cluster.store,
        cluster.model_path,
        daemon.control,
        model_name=model,
        name=name,
        namespace=namespace,
        disaggregation_mode=disaggregation_mode,
        env=env,
        extra_args=extra_args,
        system_port=system_port,
    )
    cluster.processes.append(worker)
    worker.start()
    return worker


# Prompts of distinct first words share no KV block: every caller draws its own.
_starts = itertools.count(0, 17)


def fresh_prompt(n: int) -> str:
    """`n` words no earlier prompt of this process began with."""
    return words(n, start=next(_starts))


def start_worker_per_rank(
    cluster: DynamoCluster,
    daemon: EnginedDaemon,
    *,
    name: str,
    model: str,
    namespace: str,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    system_port: bool = False,
) -> tuple[EnginedWorker, list[int]]:
    """A started `--worker-per-rank` worker for `daemon`, and its ranks' instance ids in
    rank order (its ready line's `worker_ids`). `system_port`: as `add_worker`'s."""
    worker = _start_worker(
        cluster,
        daemon,
        name=name,
        model=model,
        namespace=namespace,
        env=env,
        extra_args=["--worker-per-rank", *extra_args],
        system_port=system_port,
    )
    ready = json.loads(worker.wait_for_log(READY_LINE))
    return worker, [int(i) for i in ready["worker_ids"]]


# What a prefill daemon's handoff costs in the P/D tests: a transfer long enough to be seen.
HANDOFF_ARGS: Final = ("--kv-bytes-per-token", "131072", "--kv-transfer-bandwidth", "25")


def add_pd_group(
    cluster: DynamoCluster, namespace: str, daemon_args: Sequence[str]
) -> EnginedGroup:
    """A prefill and a decode daemon, each with its worker, serving `tiny-{namespace}`
    (listed by every running frontend of the namespace)."""
    model = f"tiny-{namespace}"
    prefill = cluster.engined_daemon(
        *daemon_args, "--worker-type", "prefill", *HANDOFF_ARGS, name=f"{namespace}-engined-prefill"
    )
    decode = cluster.engined_daemon(
        *daemon_args, "--worker-type", "decode", name=f"{namespace}-engined-decode"
    )
    # The decode worker's model is listed only once a prefill worker is there.
    workers = [
        add_worker(
            cluster,
            daemon,
            name=f"{namespace}-worker-{mode}",
            model=model,
            namespace=namespace,
            disaggregation_mode=mode,
        )
        for daemon, mode in ((prefill, "prefill"), (decode, "decode"))
    ]
    return EnginedGroup(model, namespace, [prefill, decode], workers)


def wait_routable(
    frontend: Frontend,
    worker_ids: Sequence[int],
    *,
    prefill_model: str | None = None,
    timeout: float = READY_TIMEOUT_S,
) -> None:
    """Until `frontend`'s routers have taken in every worker and its model manager serves
    their model (and, for a disaggregated model, has activated its prefill router).

    `/v1/models` and `/health` list a worker before its router has it: a request sent at
    once may get 503 "no backend worker available" (seen with a decode model whose prefill
    router was still activating, on a loaded machine). And the router may take in every
    worker before the model is committed to the HTTP service: a request sent then got 404
    (seen in CI with `--worker-per-rank`, 11 ms between the two). Dynamo 1.6.1 logs each
    moment."""
    wanted = [f"Adding worker WorkerWithDpRank {{ worker_id: {i}," for i in worker_ids]

    def check() -> bool:
        frontend.check_alive()
        messages = [str(r.get("message", "")) for r in frontend.log_records()]
        if not all(any(m.startswith(w) for m in messages) for w in wanted):
            return False
        committed = False  # as of the last commit or removal of a model group
        for message in messages:
            if message == "Committed discovered model group":
                committed = True
            elif message == "Removed discovered model group":
                committed = False
        if not committed:
            return False
        if prefill_model is None:
            return True
        return any(
            r.get("message") == "Prefill router target activated"
            and r.get("model_name") == prefill_model
            for r in frontend.log_records()
        )

    poll_until(
        f"{frontend.name} to route to workers {list(worker_ids)}"
        + (f" and activate the prefill router of {prefill_model}" if prefill_model else ""),
        check,
        timeout,
        frontend.describe,
    )


@dataclass(frozen=True)
class WorkerExit:
    returncode: int
    stdout: str
    stderr: str

    @property
    def last_stderr_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def run_failing_worker(
    cluster: DynamoCluster,
    control_endpoint: str,
    *,
    name: str,
    namespace: str,
    timeout: float,
    disaggregation_mode: str = "agg",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> WorkerExit:
    """Run a worker that is expected to give up at start-up; its exit within `timeout` s.
    `env` adds to (or overrides) the cluster's Dynamo environment."""
    worker = EnginedWorker(
        cluster.python,
        cluster.workdir,
        cluster.store,
        cluster.model_path,
        control_endpoint,
        model_name=name,
        name=name,
        namespace=namespace,
        disaggregation_mode=disaggregation_mode,
        env=env,
        extra_args=extra_args,
    )
    try:
        run = subprocess.run(
            worker.command_line(),
            env=worker.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{name} still running after {timeout:g} s (it should have given up)\n"
            f"stderr: {exc.stderr!r}"
        ) from None
    leftover = worker.store_instances()
    assert not leftover, f"{name} left instances {leftover} in the discovery store"
    return WorkerExit(run.returncode, run.stdout, run.stderr)


# --- the frontend ---------------------------------------------------------------------------


def kv_events_applied(frontend: Frontend) -> dict[tuple[str, str], int]:
    """The frontend's `dynamo_component_kv_cache_events_applied` counters, summed over their
    label sets: {(event_type, status): count}, e.g. ("stored", "ok") or
    ("stored", "parent_block_not_found").

    Dynamo 1.6.1 labels these counters with the namespace of the first model the frontend
    routed, whatever worker's events they count: only a frontend that sees one namespace
    (`--namespace`) tells its workers' events apart."""
    counts: dict[tuple[str, str], int] = {}
    for line in frontend.metrics().splitlines():
        if not line.startswith("dynamo_component_kv_cache_events_applied{"):
            continue
        labels, _, value = line.rpartition(" ")
        fields = dict(part.split("=", 1) for part in labels.split("{", 1)[1].rstrip("}").split(","))
        key = (fields["event_type"].strip('"'), fields["status"].strip('"'))
        counts[key] = counts.get(key, 0) + int(float(value))
    return counts


def add_frontend(cluster: DynamoCluster, *, name: str, namespace: str) -> Frontend:
    """A started KV-routing frontend that discovers the models of `namespace` only."""
    frontend = Frontend(
        cluster.python,
        cluster.workdir,
        cluster.store,
        router_mode="kv",
        name=name,
        namespace=namespace,
    )
    cluster.processes.append(frontend)
    frontend.start()
    return frontend


def completion_words(text: str) -> list[str]:
    """The generated words of a completion text (" w12 w7" -> ["w12", "w7"])."""
    return text.split()


class AbandonedStream:
    """A streaming `/v1/completions` whose client reads a few chunks, then hangs up."""

    def __init__(self, frontend: Frontend, body: dict[str, Any], timeout: float) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", frontend.port, timeout=timeout)
        self.conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({**body, "stream": True}),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        self.response = self.conn.getresponse()
        self.sock = self.conn.sock

    def read_chunks(self, count: int) -> list[dict[str, Any]]:
        """The next `count` SSE data chunks (fails on [DONE] or an error payload)."""
        chunks: list[dict[str, Any]] = []
        while len(chunks) < count:
            raw = self.response.readline()
            if not raw:
                raise AssertionError(f"the stream ended after {chunks}")
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            assert payload != "[DONE]", f"the stream finished after {chunks}"
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            chunks.append(chunk)
        return chunks

    def hang_up(self) -> None:
        """Close the TCP connection at once (FIN now, whatever still references it)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):  # already reset by the peer
                self.sock.shutdown(socket.SHUT_RDWR)
        self.response.close()
        self.conn.close()
