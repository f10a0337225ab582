"""Ranks in worker processes (`Daemon(rank_processes=N)`) look to clients as ranks in process.

Each test starts a real daemon on ipc:// endpoints under tmp_path, in this test's event loop
(its ranks in worker processes), or as a subprocess where the daemon must own its signals,
and drives it with `EngineClient`. Every wait is bounded: replies by timeouts, processes by
`wait` with a timeout, each scenario by `asyncio.wait_for`. No sleep synchronises anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import structlog
import zmq
import zmq.asyncio

from engined.client import EngineClient, EngineError, Generation
from engined.config import DaemonConfig, load_config
from engined.server.daemon import EXIT_FAILURE, EXIT_OK, Daemon
from engined.server.ops.systemd import NullNotifier, keepalive
from engined.server.ranks import rank_layouts
from engined.server.ranks.engine_loop import EngineLoop
from engined.server.ranks.rank_proxy import RankProxy
from engined.wire.control import Applied, DestinationReservedEvent, ErrorReply, Load, Pong
from tests.reference_indexer import ReferenceIndexer
from tests.server.daemon_harness import KvStream, assert_each_prompt_on_its_rank, to_core_events
from tests.support import free_tcp_port

T = TypeVar("T")

SCENARIO_TIMEOUT_S = 90.0
WAIT_S = 20.0
BLOCK_SIZE = 16


def run(scenario: Awaitable[T], timeout: float = SCENARIO_TIMEOUT_S) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(scenario, timeout)

    return asyncio.run(bounded())


def config(tmp_path: Path, dp_size: int, **flags: Any) -> DaemonConfig:
    base = tmp_path / "e"
    return load_config(
        config_path=None,
        env={},
        flags={
            "control_endpoint": f"ipc://{base}-control",
            "kv_events_endpoint": f"ipc://{base}-kv",
            "kv_replay_endpoint": f"ipc://{base}-replay",
            "fpm_endpoint": f"ipc://{base}-fpm",
            "engine.dp_size": dp_size,
            "engine.block_size": BLOCK_SIZE,
            "engine.speedup_ratio": 0,
            "drain_timeout": 10,
            "api_port": None,
            **flags,
        },
    )


class Running:
    def __init__(self, daemon: Daemon, task: asyncio.Task[int]) -> None:
        self.daemon = daemon
        self.task = task

    @property
    def endpoint(self) -> str:
        return self.daemon.config.control_endpoint

    async def stop(self) -> int:
        if not self.task.done():
            self.daemon.handle_exit(signal.SIGTERM)
        return await asyncio.wait_for(self.task, WAIT_S)


@contextlib.asynccontextmanager
async def serving(cfg: DaemonConfig, processes: int, **kwargs: Any) -> AsyncIterator[Running]:
    """A started daemon; on exit it is stopped as by SIGTERM and must have exited 0."""
    ready = asyncio.Event()
    daemon = Daemon(cfg, on_ready=lambda _: ready.set(), rank_processes=processes, **kwargs)
    task = asyncio.create_task(daemon.serve())
    waiter = asyncio.ensure_future(ready.wait())
    await asyncio.wait((waiter, task), timeout=60, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    assert ready.is_set(), f"daemon did not start: {task.result() if task.done() else 'hung'}"
    running = Running(daemon, task)
    try:
        yield running
    finally:
        code = await running.stop()
    assert code == EXIT_OK


def prompt(seed: int, length: int = 40) -> list[int]:
    return [seed * 1000 + i for i in range(length)]


async def sequential(client: EngineClient, dp_size: int, per_rank: int) -> list[Generation]:
    """Requests submitted one at a time with explicit ranks: a deterministic arrival order."""
    gens = []
    for i in range(per_rank * dp_size):
        gens.append(await client.generate(prompt(i), 5 + i, dp_rank=i % dp_size, timeout=WAIT_S))
    return gens


@pytest.mark.parametrize(("dp_size", "processes"), [(2, 2), (4, 2)])
def test_every_rank_answers_from_its_process(tmp_path: Path, dp_size: int, processes: int) -> None:
    """Submit to each rank, one at a time and all at once: exact outputs per rank; welcome
    lists the per-rank endpoints an in-process daemon binds."""

    async def scenario() -> None:
        cfg = config(tmp_path, dp_size)
        async with serving(cfg, processes) as running:
            assert len(running.daemon.workers) == processes
            async with await EngineClient.connect(running.endpoint) as client:
                welcome = await client.hello()
                base = tmp_path / "e"
                suffix = ["", *(f"-{r}" for r in range(1, dp_size))]
                assert welcome.dp_size == dp_size
                assert welcome.kv_events_endpoints == [f"ipc://{base}-kv{s}" for s in suffix]
                assert welcome.kv_replay_endpoints == [f"ipc://{base}-replay{s}" for s in suffix]
                assert welcome.fpm_endpoints == [f"ipc://{base}-fpm{s}" for s in suffix]
                gens = await sequential(client, dp_size, 2)
                together = await asyncio.gather(
                    *(
                        client.generate(prompt(100 + i), 7, dp_rank=i % dp_size, timeout=WAIT_S)
                        for i in range(4 * dp_size)
                    )
                )
            for i, gen in enumerate(gens):
                assert (gen.dp_rank, len(gen.token_ids), gen.finish_reason) == (
                    i % dp_size,
                    5 + i,
                    "length",
                )
            for i, gen in enumerate(together):
                assert (gen.dp_rank, len(gen.token_ids), gen.finish_reason) == (
                    i % dp_size,
                    7,
                    "length",
                )

    run(scenario())


def test_stats_lateness_is_current_not_a_heartbeat_old(tmp_path: Path) -> None:
    """Paced ranks whose passes run longer than modelled (0.001 ms each) start every pass
    late. `stats` asks the workers for their figures first: the lateness of passes run since
    the last heartbeat (a second apart) is in the reply."""

    async def scenario() -> None:
        cfg = config(
            tmp_path,
            2,
            **{
                "engine.speedup_ratio": 1,
                "engine.perf_model": "fixed",
                "engine.fixed_prefill_ms_per_token": 0.0,
                "engine.fixed_pass_overhead_ms": 0.0,
                "engine.fixed_decode_ms_per_pass": 0.001,
            },
        )
        async with (
            serving(cfg, 2) as running,
            await EngineClient.connect(running.endpoint) as client,
        ):
            submitted = [await client.submit(prompt(i), 2000, dp_rank=i % 2) for i in range(8)]
            for request in submitted[:2]:  # several passes on both ranks
                seen = 0
                async for entry in client.outputs(request.request_id, timeout=WAIT_S):
                    seen += len(entry.token_ids)
                    if seen >= 20:
                        break
            stats = await client.stats()
            assert all(rank.lateness_max_ms > 0 for rank in stats.ranks), stats
            assert all(rank.passes_total >= 20 for rank in stats.ranks), stats
            for request in submitted:
                await client.cancel(request.request_id)

    run(scenario())


def test_same_tokens_stats_metrics_and_errors_as_in_process(tmp_path: Path) -> None:
    """The same seeded sequential workload in process and in 2 worker processes (4 ranks):
    identical token ids, stats, `load` messages per rank, Prometheus tallies (the pass and
    command observers, fed from the workers) and error replies (a core refusal included)."""

    async def workload(processes: int) -> tuple[list[Generation], object, list[object]]:
        path = tmp_path / f"p{processes}"
        path.mkdir()
        cfg = config(path, 4, http_port=free_tcp_port())
        loads: list[Load] = []
        async with (
            serving(cfg, processes) as running,
            await EngineClient.connect(running.endpoint) as client,
            await EngineClient.connect(running.endpoint) as watcher,
        ):
            await watcher.watch_load(loads.append)
            gens = await sequential(client, 4, 3)
            await watcher.ping()  # after every load sent before it
            per_rank = [[load for load in loads if load.dp_rank == r] for r in range(4)]
            assert all(len(rank) > 2 for rank in per_rank), per_rank
            errors: list[object] = []
            for call in (
                lambda: client.set_vocabulary(4, [0, 1, 2, 3]),
                lambda: client.submit(prompt(1), 3, dp_rank=7),
                lambda: client.reset_prefix_cache(dp_rank=9),
            ):
                with pytest.raises(EngineError) as caught:
                    await call()
                errors.append((caught.value.code, str(caught.value)))
            stats = await client.stats()
            welcome = await client.hello()
            shape = (type(welcome), sorted(msgspec_fields(welcome)))
            metrics = running.daemon.metrics
            assert metrics is not None
            tallies = [
                (
                    rank.generation_tokens,
                    rank.prompt_tokens,
                    rank.prefix_cache_queries,
                    rank.prefix_cache_hits,
                    dict(rank.finished),
                    *((h.counts, h.sum) for h in (rank.ttft, rank.itl, rank.e2e, rank.queue)),
                    rank.gauges(),
                )
                for rank in metrics.ranks
            ]
            publishers = [
                (family.name, sorted((s.labels["engine"], s.value) for s in family.samples))
                for family in metrics.registry.collect()
                if family.name.startswith("engined:kv_")
            ]
            assert len(publishers) == 4, publishers
            return gens, (stats, shape, tallies, publishers, per_rank), errors

    async def scenario() -> None:
        in_process = await workload(0)
        in_workers = await workload(2)
        assert [g.token_ids for g in in_workers[0]] == [g.token_ids for g in in_process[0]]
        assert in_workers[1] == in_process[1]
        tallies = in_process[1][2]  # type: ignore[index]
        assert all(rank[0] > 0 for rank in tallies)  # every rank generated and was tallied
        assert in_workers[2] == in_process[2]

    run(scenario())


def msgspec_fields(struct: object) -> tuple[str, ...]:
    fields: tuple[str, ...] = getattr(struct, "__struct_fields__", ())
    return fields


def test_cancel_ends_the_owners_stream_once(tmp_path: Path) -> None:
    """A long request per rank: its owner cancels one, another client cancels the other;
    each owner's stream ends with exactly one `cancelled` terminal, and the ranks go idle."""

    async def scenario() -> None:
        async with (
            serving(config(tmp_path, 2), 2) as running,
            await EngineClient.connect(running.endpoint) as owner,
            await EngineClient.connect(running.endpoint) as other,
        ):
            for rank, canceller in ((0, owner), (1, other)):
                submitted = await owner.submit(prompt(rank), 10_000_000, dp_rank=rank)
                entries = []
                async for entry in owner.outputs(submitted.request_id, timeout=WAIT_S):
                    entries.append(entry)
                    if len(entries) == 1:
                        assert isinstance(await canceller.cancel(submitted.request_id), Applied)
                reasons = [e.finish_reason for e in entries]
                assert reasons[-1] == "cancelled"
                assert reasons.count("cancelled") == 1 and None not in reasons[-1:]
                assert all(r is None for r in reasons[:-1]), reasons
            deadline = time.monotonic() + WAIT_S
            while True:
                stats = await owner.stats()
                if all(r.running == r.waiting == r.active_blocks == 0 for r in stats.ranks):
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.01)  # a poll interval, not synchronisation

    run(scenario())


def test_kv_event_streams_are_consistent_per_rank(tmp_path: Path) -> None:
    """Each rank's KV stream (live + replay) from its worker process is clean and holds
    exactly the blocks of the prompts that rank served."""

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        async with (
            serving(config(tmp_path, 2), 2) as running,
            await EngineClient.connect(running.endpoint) as client,
        ):
            welcome = await client.hello()
            streams = [
                KvStream(ctx, kv, replay)
                for kv, replay in zip(
                    welcome.kv_events_endpoints, welcome.kv_replay_endpoints, strict=True
                )
            ]
            try:
                served = []
                for i in range(6):
                    tokens = prompt(i, 64)
                    gen = await client.generate(tokens, 4, dp_rank=i % 2, timeout=WAIT_S)
                    served.append((tokens, gen.dp_rank))
                indexer = ReferenceIndexer(BLOCK_SIZE, vllm=True)
                for rank, stream in enumerate(streams):
                    await stream.catch_up()
                    assert stream.batches and stream.next_seq == len(stream.batches)
                    assert {b.data_parallel_rank for b in stream.batches} == {rank}
                    indexer.apply(to_core_events(stream.batches))
                indexer.assert_clean()
                assert_each_prompt_on_its_rank(indexer, served, BLOCK_SIZE)
            finally:
                for stream in streams:
                    stream.close()
        ctx.term()

    run(scenario())


def test_handoff_between_two_worker_processes(tmp_path: Path) -> None:
    """A prefill daemon and a decode daemon, each with its rank in a worker process: the
    coordinator's handoff goes through (source_held, destination_reserved, outputs)."""
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    timing = {"engine.kv_bytes_per_token": 131072, "engine.kv_transfer_bandwidth": 25.0}
    prefill = config(tmp_path / "p", 1, **{"engine.worker_type": "prefill", **timing})
    decode = config(tmp_path / "d", 1, **{"engine.worker_type": "decode"})

    async def scenario() -> None:
        async with (
            serving(prefill, 1) as p,
            serving(decode, 1) as d,
            await EngineClient.connect(p.endpoint) as pc,
            await EngineClient.connect(d.endpoint) as dc,
        ):
            tokens = prompt(3, 100)
            submitted = await pc.submit_handoff_prefill("h-1", tokens, 1, request_id="r-1")
            held = await pc.next_lifecycle("h-1", timeout=WAIT_S)
            assert (held.handoff_id, held.request_id) == ("h-1", "r-1")
            first = await pc.collect(submitted, timeout=WAIT_S)
            assert (len(first.token_ids), first.finish_reason) == (1, "length")
            accepted = await dc.reserve_destination("h-1", tokens, 6, request_id="r-1")
            reserved = await dc.next_lifecycle("h-1", timeout=WAIT_S)
            assert isinstance(reserved, DestinationReservedEvent)
            assert isinstance(await dc.activate_destination("h-1"), Applied)
            rest = await dc.collect(accepted, timeout=WAIT_S)
            assert (len(rest.token_ids), rest.finish_reason) == (6, "length")
            assert isinstance(await pc.release_source("h-1"), Applied)

    run(scenario())


def test_malformed_message_is_answered_and_the_daemon_goes_on(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            serving(config(tmp_path, 2), 2) as running,
            await EngineClient.connect(running.endpoint) as client,
        ):
            for body in (b"\xc1garbage", b'{"type": "submit"}', b"\x81\xa4type\xa6submit"):
                reply = await client.send_raw(body, timeout=WAIT_S)
                assert isinstance(reply, ErrorReply), reply
            assert isinstance(await client.ping(), Pong)
            gen = await client.generate(prompt(1), 3, dp_rank=1, timeout=WAIT_S)
            assert (len(gen.token_ids), gen.finish_reason) == (3, "length")

    run(scenario())


def test_a_killed_worker_ends_the_daemon_non_zero(tmp_path: Path) -> None:
    """SIGKILL one of two workers while a request runs: the daemon exits 1 within a bound,
    logging the dead worker's ranks, and the other worker is gone too."""

    async def scenario() -> None:
        ready = asyncio.Event()
        daemon = Daemon(config(tmp_path, 4), on_ready=lambda _: ready.set(), rank_processes=2)
        task = asyncio.create_task(daemon.serve())
        await asyncio.wait_for(ready.wait(), 60)
        async with await EngineClient.connect(daemon.config.control_endpoint) as client:
            submitted = await client.submit(prompt(0), 10_000_000, dp_rank=3)
            async for _ in client.outputs(submitted.request_id, timeout=WAIT_S):
                break
            victim, survivor = daemon.workers[1], daemon.workers[0]
            assert victim.ranks == [2, 3]
            assert victim.pid is not None and survivor.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            code = await asyncio.wait_for(task, WAIT_S)
        assert code == EXIT_FAILURE
        with pytest.raises(ProcessLookupError):
            os.kill(survivor.pid, 0)

    with structlog.testing.capture_logs() as logs:
        run(scenario())
    died = [entry for entry in logs if entry["event"] == "rank worker died"]
    assert [(d["ranks"], d["reason"]) for d in died] == [([2, 3], "killed by signal 9")]
    assert any(
        "ranks [2, 3]" in str(e.get("exc_info")) for e in logs if e["event"] == "fatal error"
    )


def test_watchdog_pings_only_while_every_worker_answers(tmp_path: Path) -> None:
    """A worker stopped with SIGSTOP stops answering its heartbeat: `workers_healthy` turns
    False within the watchdog interval and the keepalive withholds WATCHDOG=1 until SIGCONT."""

    class Recorder(NullNotifier):
        enabled = True

        def __init__(self) -> None:
            self.pings = 0

        def notify(self, **fields: object) -> bool:
            self.pings += "WATCHDOG" in fields
            return True

    async def until(predicate: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)  # a poll interval, not synchronisation

    async def scenario() -> None:
        async with serving(config(tmp_path, 2), 2, watchdog_s=0.4) as running:
            daemon = running.daemon
            await until(daemon.workers_healthy, "workers heard")
            pid = daemon.workers[0].pid
            assert pid is not None
            recorder = Recorder()
            pinger = asyncio.ensure_future(
                keepalive(recorder, str, watchdog_s=0.1, healthy=daemon.workers_healthy)
            )
            os.kill(pid, signal.SIGSTOP)
            try:
                await until(lambda: not daemon.workers_healthy(), "worker seen silent")
                withheld = recorder.pings
                await asyncio.sleep(0.3)  # an observation window: no ping may go out in it
                assert recorder.pings == withheld
            finally:
                os.kill(pid, signal.SIGCONT)
            await until(daemon.workers_healthy, "worker heard again")
            await until(lambda: recorder.pings > withheld, "pings resumed")
            pinger.cancel()

    run(scenario())


WRAPPER = """
import sys
import msgspec
from engined.config import DaemonConfig
from engined.server.daemon import run
config = msgspec.json.decode(sys.argv[1], type=DaemonConfig)
sys.exit(run(msgspec.structs.replace(config, rank_processes=2)))
"""


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    """The daemon as its own process (it owns the signals): SIGTERM while requests run on
    both workers lets them finish (`length`, every token), then it exits 0 and so do they;
    a SIGINT sent to the workers alone changes nothing (only the daemon owns signals)."""
    cfg = config(tmp_path, 2, log_format="json", **{"engine.speedup_ratio": 1000})
    log_path = tmp_path / "daemon.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, json.dumps(json.loads(encode(cfg)))],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        async def scenario() -> list[int]:
            deadline = time.monotonic() + 60
            while True:
                try:
                    async with await EngineClient.connect(cfg.control_endpoint) as client:
                        await client.ping(timeout=0.5)
                    break
                except TimeoutError:
                    assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            pids = started_workers(log_path)
            for pid in pids:
                os.kill(pid, signal.SIGINT)
            async with await EngineClient.connect(cfg.control_endpoint) as client:
                submitted = [
                    await client.submit(prompt(r), 200, dp_rank=r, timeout=WAIT_S) for r in (0, 1)
                ]
                proc.send_signal(signal.SIGTERM)
                gens = [await client.collect(s, timeout=WAIT_S) for s in submitted]
            for gen in gens:
                assert (len(gen.token_ids), gen.finish_reason) == (200, "length")
            return pids

        pids = run(scenario())
        assert proc.wait(WAIT_S) == EXIT_OK, log_path.read_text()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def encode(cfg: DaemonConfig) -> bytes:
    import msgspec

    return msgspec.json.encode(cfg)


def started_workers(log_path: Path) -> list[int]:
    for line in log_path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == "engined started":
                pids: list[int] = record["rank_processes"]
                return pids
    raise AssertionError(f"no start-up line:\n{log_path.read_text()}")


def test_a_worker_that_cannot_bind_is_a_startup_failure(tmp_path: Path) -> None:
    """Rank 1's KV endpoint is taken: the daemon reports a start-up failure (3), as in
    process, and leaves no worker behind."""

    async def scenario() -> None:
        cfg = config(tmp_path, 2)
        ctx = zmq.Context()
        squatter = ctx.socket(zmq.PUB)
        squatter.bind(f"ipc://{tmp_path / 'e'}-kv-1")
        try:
            daemon = Daemon(cfg, rank_processes=2)
            code = await asyncio.wait_for(daemon.serve(), 60)
        finally:
            squatter.close(0)
            ctx.term()
        assert code == 3
        for worker in daemon.workers:
            assert worker.pid is not None
            with pytest.raises(ProcessLookupError):
                os.kill(worker.pid, 0)

    run(scenario())


def test_second_sigterm_skips_the_drain(tmp_path: Path) -> None:
    """Two SIGTERMs (as `handle_exit` receives them) while long requests run on both workers:
    no drain; each owner's stream ends with one `cancelled` terminal and the daemon exits 0."""

    async def scenario() -> None:
        ready = asyncio.Event()
        cfg = config(tmp_path, 2, drain_timeout=60)
        daemon = Daemon(cfg, on_ready=lambda _: ready.set(), rank_processes=2)
        task = asyncio.create_task(daemon.serve())
        await asyncio.wait_for(ready.wait(), 60)
        async with await EngineClient.connect(cfg.control_endpoint) as client:
            submitted = [
                await client.submit(prompt(r), 10_000_000, dp_rank=r, timeout=WAIT_S)
                for r in (0, 1)
            ]
            daemon.handle_exit(signal.SIGTERM)
            daemon.handle_exit(signal.SIGTERM)
            gens = [await client.collect(s, timeout=WAIT_S) for s in submitted]
        assert [g.finish_reason for g in gens] == ["cancelled", "cancelled"]
        assert await asyncio.wait_for(task, WAIT_S) == EXIT_OK

    run(scenario())


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_workers_die_with_the_daemon(tmp_path: Path) -> None:
    """SIGKILL the daemon process: its workers do not outlive it (PR_SET_PDEATHSIG)."""
    cfg = config(tmp_path, 2, log_format="json")
    log_path = tmp_path / "daemon.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, encode(cfg).decode()],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not (log_path.read_text() and "engined started" in log_path.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)  # a poll interval for the log line, not synchronisation
        pids = started_workers(log_path)
        proc.kill()
        proc.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not all(gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"workers {pids} outlived the daemon"
            time.sleep(0.02)  # a poll interval, not synchronisation
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_wait_idle_follows_every_output_from_the_workers(tmp_path: Path) -> None:
    """`wait_idle` across processes: its stats reply comes after the last output of every
    request submitted before it, and shows the ranks idle."""

    async def scenario() -> None:
        async with (
            serving(config(tmp_path, 4), 2) as running,
            await EngineClient.connect(running.endpoint) as client,
        ):
            submitted = [
                await client.submit(prompt(n), 5 + n, dp_rank=n % 4, timeout=WAIT_S)
                for n in range(8)
            ]
            stats = await client.wait_idle(timeout=WAIT_S)
            assert all(r.running == r.waiting == r.active_blocks == 0 for r in stats.ranks)
            for n, request in enumerate(submitted):
                generation = await client.collect(request, timeout=0)
                assert (len(generation.token_ids), generation.finish_reason) == (5 + n, "length")
            request = await client.submit(prompt(9), 3, dp_rank=3, timeout=WAIT_S)
            stats = await client.wait_idle(dp_rank=3, timeout=WAIT_S)
            assert stats.ranks[3].running == 0
            assert (await client.collect(request, timeout=0)).finish_reason == "length"

    run(scenario())


@pytest.mark.parametrize(
    ("dp_size", "cores", "processes"),
    [(1, 8, 0), (8, 1, 0), (8, 2, 2), (2, 16, 2), (8, 16, 8), (3, 2, 2)],
)
def test_the_default_takes_a_worker_per_core_where_there_is_something_to_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dp_size: int, cores: int, processes: int
) -> None:
    """`rank_processes` -1 (the default): one worker per core the daemon may run on, at most
    one per rank; none for a single rank or a single core. Set, the number is taken as is."""
    monkeypatch.setattr(rank_layouts, "available_cores", lambda: cores)
    cfg = config(tmp_path, dp_size)
    assert cfg.rank_processes == -1
    assert Daemon(cfg).rank_processes == processes
    assert Daemon(config(tmp_path, dp_size, rank_processes=0)).rank_processes == 0
    assert Daemon(cfg, rank_processes=1).rank_processes == 1


@pytest.mark.parametrize("processes", [0, 2])
def test_every_rank_of_a_daemon_maps_time_with_the_layouts_one_clock(
    tmp_path: Path, processes: int
) -> None:
    """One `ModelClock` per daemon: its layout's, built from the config, is what every rank
    handle (an `EngineLoop`, or a proxy's `now_ms`) maps modelled time to the wall with."""

    async def scenario() -> None:
        cfg = config(tmp_path, 2, **{"engine.speedup_ratio": 4})
        async with serving(cfg, processes) as running:
            layout = running.daemon.ranks
            assert layout.model_clock.speedup_ratio == 4.0
            kind = EngineLoop if processes == 0 else RankProxy
            for handle in layout.handles:
                assert isinstance(handle, kind)
                assert handle.model_clock is layout.model_clock

    run(scenario())
