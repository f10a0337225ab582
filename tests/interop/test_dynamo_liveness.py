"""A daemon behind `engined dynamo-worker` dies or restarts: nothing fails, nothing is empty.

A real Dynamo 1.6.1 frontend with `--migration-limit 3` in front of two aggregated engined
pairs paced in real time (20 ms per decode pass, speedup 1). Streaming completions run
long enough (`MAX_TOKENS` passes) to be mid-stream when one pair's DAEMON (not its worker)
is killed with SIGKILL (or stopped with SIGSTOP): its worker ends their streams with
`EngineShutdown`, the frontend migrates them to the other pair, and every one completes with
200 and all its tokens. The worker stays up; once the daemon is back on the same endpoint
with a new `instance_id`, the worker sets the vocabulary and FPM worker id on it again and
serves non-empty text. The same for a `--worker-per-rank` worker of a two-rank daemon
beside a plain pair of its model: every rank's streams migrate, every rank is set up again.

Every wait is a condition polled under a deadline (the daemon's stats, the worker's log, the
frontend's route lines), never a sleep.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import pytest

from tests.interop.dynamo_cluster import (
    TOKEN_IDS_NVEXT,
    DynamoCluster,
    EnginedDaemon,
    EnginedWorker,
    Frontend,
    chunk_token_ids,
    completions,
    dynamo_cluster,
    sets_on_first_token,
    stream_text,
    stream_usage,
)
from tests.interop.dynamo_worker_support import (
    BLOCK_ARGS,
    BLOCK_SIZE,
    EnginedGroup,
    add_worker,
    fpm_stamps,
    kv_events_applied,
    poll_until,
    rank_stats,
    start_worker_per_rank,
    wait_routable,
    welcome,
)
from tests.interop.peers import require_peers
from tests.interop.tiny_model import words

PACING: Final = ("--speedup-ratio", "1", "--perf-model", "fixed", "--fixed-decode-ms-per-pass")
DECODE_MS: Final = "20"
MAX_TOKENS: Final = 150  # 3 s of decode passes: every stream is mid-way at the kill
STREAMS: Final = 8
HTTP_TIMEOUT_S: Final = 90.0
BUSY_TIMEOUT_S: Final = 30.0
BACK_TIMEOUT_S: Final = 60.0
MODEL: Final = "tiny-live"
NAMESPACE: Final = "live"
BACK_LINE: Final = "the engined daemon is back; serving again"
LOST_LINE: Final = "the engined daemon is gone"

_starts = iter(range(0, 10_000, 13))


@dataclass
class Pairs:
    cluster: DynamoCluster
    frontend: Frontend
    group: EnginedGroup


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pairs]:
    python = require_peers()
    with dynamo_cluster(python, tmp_path_factory.mktemp("dynamo-liveness")) as cluster:
        frontend = cluster.frontend(extra_args=["--migration-limit", "3"])
        group = EnginedGroup(MODEL, NAMESPACE, [], [])
        for i in range(2):
            daemon = cluster.engined_daemon(
                *BLOCK_ARGS, *PACING, DECODE_MS, name=f"live-engined-{i}"
            )
            group.daemons.append(daemon)
            group.workers.append(
                add_worker(
                    cluster, daemon, name=f"live-worker-{i}", model=MODEL, namespace=NAMESPACE
                )
            )
        wait_routable(frontend, group.worker_ids())
        yield Pairs(cluster, frontend, group)


def _stream(
    frontend: Frontend, model: str = MODEL, begun: threading.Event | None = None
) -> list[dict[str, Any]]:
    """One stream; `begun`, if given, is set once its client holds a token."""
    return completions(
        frontend,
        words(12, start=next(_starts)),
        model=model,
        max_tokens=MAX_TOKENS,
        stream=True,
        ignore_eos=True,
        nvext=TOKEN_IDS_NVEXT,
        timeout=HTTP_TIMEOUT_S,
        on_chunk=None if begun is None else sets_on_first_token(begun),
    )


def _assert_complete(chunks: list[dict[str, Any]]) -> None:
    """200 (no exception), every token streamed once, and a text of MAX_TOKENS words."""
    usage = stream_usage(chunks)
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS, usage
    assert len([t for c in chunks for t in chunk_token_ids(c)]) == MAX_TOKENS
    assert len(stream_text(chunks).split()) == MAX_TOKENS, stream_text(chunks)[:200]


MID_STREAM_PASSES: Final = 20


def _wait_mid_stream(daemon: EnginedDaemon, begun: list[threading.Event]) -> None:
    """Until every stream has begun, and at least two requests run on `daemon` and have
    decoded MID_STREAM_PASSES tokens (passes of a paced rank: one token each per running
    request). The daemon's counts alone come before its tokens reach the frontend."""
    start = sum(rank.passes_total for rank in rank_stats(daemon))

    def mid_stream() -> bool:
        if not all(b.is_set() for b in begun):
            return False
        stats = rank_stats(daemon)
        passes = sum(rank.passes_total for rank in stats) - start
        return sum(rank.running for rank in stats) >= 2 and passes >= MID_STREAM_PASSES

    poll_until(f"{daemon.name} mid-stream", mid_stream, BUSY_TIMEOUT_S)


def _migrated_from(frontend: Frontend, worker: EnginedWorker | list[int]) -> list[dict[str, Any]]:
    """The frontend's migrations of streams that `worker` (or these instances) ended with
    EngineShutdown."""
    ids = worker if isinstance(worker, list) else [worker.instance_id]
    return [
        record
        for record in frontend.log_records()
        if record.get("message") == "migration retry scheduled"
        and record.get("migration.from_worker_id") in ids
        and record.get("migration.reason") == "engine_shutdown"
    ]


def _start_streams(
    frontend: Frontend, pool: ThreadPoolExecutor, model: str = MODEL
) -> tuple[list[Future[list[dict[str, Any]]]], list[threading.Event]]:
    """STREAMS streams, and for each the event set once it has begun."""
    begun = [threading.Event() for _ in range(STREAMS)]
    return [pool.submit(_stream, frontend, model, b) for b in begun], begun


def _log_lines(worker: EnginedWorker, message: str) -> list[dict[str, Any]]:
    return [r for r in worker.log_records() if str(r.get("event", "")).startswith(message)]


def _serves_again(pairs: Pairs, index: int, backs_before: int, *, restarted: bool = True) -> None:
    """The returned daemon's worker (set it up again if `restarted`, and) serves full text."""
    daemon, worker = pairs.group.daemons[index], pairs.group.workers[index]

    def back() -> bool:
        worker.check_alive()
        return len(_log_lines(worker, BACK_LINE)) > backs_before

    poll_until(f"{worker.name} serving again", back, BACK_TIMEOUT_S, worker.describe)
    line = _log_lines(worker, BACK_LINE)[-1]
    assert line["restarted"] is restarted, line
    state = welcome(daemon)
    assert state.vocab_size == 1000, state
    assert state.fpm_worker_id == str(worker.instance_id), state
    routed: set[int] = set()

    def routed_to_it() -> bool:
        with ThreadPoolExecutor(4) as pool:
            for chunks in pool.map(lambda _: _stream(pairs.frontend), range(4)):
                _assert_complete(chunks)
                routed.update(
                    line.worker_id for line in pairs.frontend.wait_route(chunks, timeout=10.0)
                )
        return worker.instance_id in routed

    poll_until(f"a request routed to {worker.name}", routed_to_it, BACK_TIMEOUT_S)


WARM_TOKENS: Final = 64  # 4 blocks


def _warm(frontend: Frontend, prompt: str, instance_id: int) -> None:
    """`prompt` cached on `instance_id` and known so to the frontend's router: a repeat is
    routed there with every block of overlap."""

    def stored() -> int:
        return kv_events_applied(frontend).get(("stored", "ok"), 0)

    before = stored()
    completions(
        frontend, prompt, model=MODEL, max_tokens=4, nvext={"backend_instance_id": instance_id}
    )
    poll_until("the warm prompt's stored event", lambda: stored() > before, BACK_TIMEOUT_S)
    (route,) = frontend.wait_route(completions(frontend, prompt, model=MODEL, max_tokens=4))
    assert (route.worker_id, route.overlap_blocks) == (instance_id, WARM_TOKENS // BLOCK_SIZE)


def test_killed_daemon_streams_migrate_and_its_restart_serves_again(pairs: Pairs) -> None:
    """... and the router forgets what the dead daemon held: its cache died with it."""
    daemon, worker = pairs.group.daemons[0], pairs.group.workers[0]
    assert worker.instance_id is not None
    warm = words(WARM_TOKENS, start=9001)
    _warm(pairs.frontend, warm, worker.instance_id)
    backs = len(_log_lines(worker, BACK_LINE))
    with ThreadPoolExecutor(STREAMS) as pool:
        streams, begun = _start_streams(pairs.frontend, pool)
        _wait_mid_stream(daemon, begun)
        assert daemon.proc is not None
        daemon.proc.kill()
        daemon.proc.wait(30)
        for future in streams:
            _assert_complete(future.result(HTTP_TIMEOUT_S))
    assert worker.alive(), worker.describe()
    assert _log_lines(worker, LOST_LINE), worker.describe()
    migrations = _migrated_from(pairs.frontend, worker)
    assert len(migrations) >= 2, pairs.frontend.describe()
    assert all(m["migration.tokens_completed"] >= 1 for m in migrations), migrations
    daemon.restart()
    _serves_again(pairs, 0, backs)
    (route,) = pairs.frontend.wait_route(
        completions(pairs.frontend, warm, model=MODEL, max_tokens=4)
    )
    assert route.overlap_blocks == 0, route


def test_daemon_restarted_at_once_loses_nothing(pairs: Pairs) -> None:
    """Killed and restarted at once (long before any ping-based check would notice)."""
    daemon, worker = pairs.group.daemons[1], pairs.group.workers[1]
    before = welcome(daemon).instance_id
    backs = len(_log_lines(worker, BACK_LINE))
    with ThreadPoolExecutor(STREAMS) as pool:
        streams, begun = _start_streams(pairs.frontend, pool)
        _wait_mid_stream(daemon, begun)
        assert daemon.proc is not None
        daemon.proc.kill()
        daemon.proc.wait(30)
        daemon.restart()
        for future in streams:
            _assert_complete(future.result(HTTP_TIMEOUT_S))
    assert len(_migrated_from(pairs.frontend, worker)) >= 2, pairs.frontend.describe()
    assert welcome(daemon).instance_id not in (None, before)
    _serves_again(pairs, 1, backs)


RANKS: Final = 2
RANKS_MODEL: Final = "tiny-live-ranks"
RANKS_NAMESPACE: Final = "live-ranks"


def _adds(frontend: Frontend, instance_id: int) -> int:
    """How often the frontend's router took `instance_id` in (again after each return)."""
    wanted = f"Adding worker WorkerWithDpRank {{ worker_id: {instance_id},"
    return sum(str(r.get("message", "")).startswith(wanted) for r in frontend.log_records())


def test_worker_per_rank_streams_migrate_and_every_rank_is_set_up_again(pairs: Pairs) -> None:
    """One daemon of RANKS ranks behind one `--worker-per-rank` worker, and a plain pair
    serving the same model. The daemon killed mid-stream: every rank's streams end
    migratable and complete on the pair. After its restart each rank's FPM carries its own
    instance id again, the vocabulary is back, and every rank's instance serves full text."""
    cluster, frontend = pairs.cluster, pairs.frontend
    daemon = cluster.engined_daemon(
        *BLOCK_ARGS, *PACING, DECODE_MS, "--data-parallel-size", str(RANKS), name="ranks"
    )
    worker, ids = start_worker_per_rank(
        cluster, daemon, name="ranks-worker", model=RANKS_MODEL, namespace=RANKS_NAMESPACE
    )
    plain_daemon = cluster.engined_daemon(*BLOCK_ARGS, *PACING, DECODE_MS, name="ranks-plain")
    plain = add_worker(
        cluster,
        plain_daemon,
        name="ranks-plain-worker",
        model=RANKS_MODEL,
        namespace=RANKS_NAMESPACE,
    )
    assert plain.instance_id is not None
    wait_routable(frontend, [*ids, plain.instance_id])
    adds = {i: _adds(frontend, i) for i in ids}
    stamps = [(str(instance_id), rank) for rank, instance_id in enumerate(ids)]
    assert fpm_stamps(daemon, cluster.python) == stamps
    before = welcome(daemon).instance_id

    assert daemon.proc is not None
    with ThreadPoolExecutor(STREAMS) as pool:
        streams, begun = _start_streams(frontend, pool, RANKS_MODEL)
        _wait_mid_stream(daemon, begun)
        daemon.proc.kill()
        daemon.proc.wait(30)
        for future in streams:
            _assert_complete(future.result(HTTP_TIMEOUT_S))
    assert len(_migrated_from(frontend, ids)) >= 2, frontend.describe()
    assert _log_lines(worker, LOST_LINE), worker.describe()
    daemon.restart()

    def back() -> bool:
        worker.check_alive()
        return bool(_log_lines(worker, BACK_LINE))

    poll_until(f"{worker.name} serving again", back, BACK_TIMEOUT_S, worker.describe)
    assert [line["restarted"] for line in _log_lines(worker, BACK_LINE)] == [True]
    state = welcome(daemon)
    assert state.instance_id not in (None, before)
    assert state.vocab_size == 1000, state
    assert fpm_stamps(daemon, cluster.python) == stamps
    poll_until(
        "the frontend taking every rank in again",
        lambda: all(_adds(frontend, i) > adds[i] for i in ids),
        BACK_TIMEOUT_S,
        frontend.describe,
    )
    for rank, instance_id in enumerate(ids):
        reply = completions(
            frontend,
            words(12, start=500 + rank),
            model=RANKS_MODEL,
            max_tokens=8,
            ignore_eos=True,
            nvext={"backend_instance_id": instance_id},
        )
        assert reply["usage"]["completion_tokens"] == 8, reply
        assert len(reply["choices"][0]["text"].split()) == 8, reply
        (route,) = frontend.wait_route(reply)
        assert (route.worker_id, route.dp_rank) == (instance_id, rank), route


def test_a_daemon_back_with_another_shape_ends_its_worker(pairs: Pairs) -> None:
    """The registered model card says block size 16: a daemon restarted with 32 cannot be
    served under it, so the worker ends with exit 1 naming the change."""
    cluster = pairs.cluster
    daemon = cluster.engined_daemon(*BLOCK_ARGS, "--speedup-ratio", "0", name="shape")
    worker = add_worker(cluster, daemon, name="shape-worker", model="tiny-shape", namespace="shape")
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait(30)
    daemon.args += ["--block-size", "32"]
    daemon.restart()
    assert worker.proc is not None
    assert worker.proc.wait(BACK_TIMEOUT_S) == 1, worker.describe()
    ends = _log_lines(worker, "the engined daemon came back with another shape")
    assert len(ends) == 1 and "block_size 16 -> 32" in ends[0]["event"], worker.describe()


def test_stopped_daemon_streams_migrate_and_it_serves_again_when_continued(pairs: Pairs) -> None:
    """A hung daemon (SIGSTOP) is noticed by its heartbeats alone: its streams migrate; once
    it runs again (SIGCONT) it is the same start, so the worker only rejoins."""
    daemon, worker = pairs.group.daemons[0], pairs.group.workers[0]
    before = welcome(daemon).instance_id
    losses, backs = len(_log_lines(worker, LOST_LINE)), len(_log_lines(worker, BACK_LINE))
    migrated = len(_migrated_from(pairs.frontend, worker))
    assert daemon.proc is not None
    with ThreadPoolExecutor(STREAMS) as pool:
        streams, begun = _start_streams(pairs.frontend, pool)
        _wait_mid_stream(daemon, begun)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            for future in streams:
                _assert_complete(future.result(HTTP_TIMEOUT_S))
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    assert len(_log_lines(worker, LOST_LINE)) == losses + 1, worker.describe()
    assert len(_migrated_from(pairs.frontend, worker)) >= migrated + 2, pairs.frontend.describe()
    _serves_again(pairs, 0, backs, restarted=False)
    assert welcome(daemon).instance_id == before
