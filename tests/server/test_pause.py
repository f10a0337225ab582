"""`pause`, `resume`, `sleep` and `wake_up` against a running daemon (PROTOCOL.md §1.1).

vLLM's pause_generation / sleep on every rank: the reply (`stats`) comes once every rank's
pause completed; an `abort` ends requests as a cancel does; a submit while generation is
paused (abort, wait) is refused `paused`, and queued under `keep`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from engined.client import EngineClient, EngineError
from engined.core.pausing import RELEASE_BEFORE_PAUSE, RELEASE_WHILE_ASLEEP
from engined.server.control.pauses import PAUSE_CLIENT_LIMIT, PAUSED_MESSAGE
from engined.wire.control import StatsReply
from tests.server.daemon_harness import (
    DaemonProcess,
    expect_refusals,
    free_tcp_port,
    start_daemon,
    start_tcp_daemon,
)
from tests.support import run

FLAGS = ("--speedup-ratio", "1", "--data-parallel-size", "2")
PROMPT = list(range(1, 33))
# Long enough to be running whenever a pause arrives; a test ends it itself.
LONG = 1000


def _states(stats: StatsReply) -> set[tuple[int, bool, bool, bool, int]]:
    return {
        (r.pause_state, r.pause_pending, r.rejecting, r.asleep, r.sleep_level) for r in stats.ranks
    }


@pytest.fixture(params=["0", "2"], ids=["in-process-ranks", "rank-processes"])
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    # Both layouts, whatever the machine's cores: the ranks in the daemon's loop, and one
    # worker process per rank (the commands and their gauges cross the rank boundary).
    # An HTTP port, so that the daemon keeps the metrics `metrics` answers with.
    flags = (*FLAGS, "--rank-processes", request.param, "--http-port", str(free_tcp_port()))
    with start_daemon(tmp_path, *flags) as process:
        yield process


def test_abort_ends_every_request_as_a_cancel_and_refuses_submits(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with (
            await EngineClient.connect(daemon.control) as owner,
            await EngineClient.connect(daemon.control) as operator,
        ):
            running = [await owner.submit(PROMPT, LONG, dp_rank=r) for r in (0, 1)]
            stats = await operator.pause()
            assert len(stats.ranks) == 2 and _states(stats) == {(1, False, True, False, 0)}
            for request in running:
                got = await owner.collect(request)
                assert got.finish_reason == "cancelled" and len(got.token_ids) < LONG
            with pytest.raises(EngineError) as refused:
                await owner.submit(PROMPT, 4)
            assert (refused.value.code, refused.value.message) == ("paused", PAUSED_MESSAGE)
            assert _states(await operator.resume()) == {(0, False, False, False, 0)}
            got = await owner.generate(PROMPT, 4)
            assert (len(got.token_ids), got.finish_reason) == (4, "length")

    run(scenario())


def test_abort_ends_a_reserved_destination_and_completes(daemon: DaemonProcess) -> None:
    """A destination reserved and never activated holds KV (vLLM's request waiting for
    remote KV): the abort ends it, so the pause completes without its transfer."""

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            accepted = await client.reserve_destination("h1", PROMPT, 4, dp_rank=1)
            await client.next_lifecycle("h1")
            stats = await client.pause()
            assert _states(stats) == {(1, False, True, False, 0)}
            assert stats.ranks[1].active_blocks == 0
            got = await client.collect(accepted)
            assert (got.token_ids, got.finish_reason) == ([], "cancelled")
            await client.resume()
            assert type(await client.activate_destination("h1")).__name__ == "Noop"

    run(scenario())


def test_wait_replies_once_the_running_requests_finished(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            running = await client.submit(PROMPT, 20, dp_rank=1)
            stats = await client.pause("wait", clear_cache=False)
            assert _states(stats) == {(1, False, True, False, 0)}
            # Its last output came before the reply.
            got = await client.collect(running, timeout=0)
            assert (len(got.token_ids), got.finish_reason) == (20, "length")
            await client.resume()

    run(scenario())


def test_keep_queues_new_requests_until_resume(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            frozen = await client.submit(PROMPT, 8, dp_rank=0)
            assert _states(await client.pause("keep")) == {(2, False, False, False, 0)}
            queued = await client.submit(PROMPT[::-1], 8, dp_rank=1)
            stats = await client.stats()
            assert stats.ranks[1].waiting == 1 and stats.ranks[1].running == 0
            await client.resume()
            for request in (frozen, queued):
                got = await client.collect(request)
                assert (len(got.token_ids), got.finish_reason) == (8, "length")

    run(scenario())


def test_sleep_and_wake_up_follow_vllms_tags_and_metrics(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            assert "sleep_mode" not in (await client.metrics()).text
            stats = await client.sleep(2)
            assert _states(stats) == {(1, False, False, True, 2)}
            assert {r.sleeping_tags for r in stats.ranks} == {("kv_cache", "weights")}
            text = (await client.metrics()).text
            assert 'sleep_state="discard_all"} 1.0' in text
            assert 'sleep_state="awake"} 0.0' in text
            # A tag that does not sleep wakes nothing; "scheduling" alone wakes nothing.
            for tags in (["weights", "nope"], ["scheduling"]):
                assert {r.asleep for r in (await client.wake_up(tags)).ranks} == {True}
            stats = await client.wake_up(["weights"])
            assert {(r.sleeping_tags, r.asleep) for r in stats.ranks} == {(("kv_cache",), True)}
            stats = await client.wake_up()
            assert _states(stats) == {(0, False, False, False, 0)}
            text = (await client.metrics()).text
            assert 'sleep_state="awake"} 1.0' in text
            # vLLM's sleep-mode operation metrics: one sleep, four wake-ups, none awaited.
            for operation, count in (("sleep", 1), ("wake", 4)):
                assert (
                    "vllm:sleep_mode_operation_duration_seconds_count"
                    f'{{operation="{operation}"}} {count}.0'
                ) in text
                assert (
                    f'vllm:sleep_mode_operations_in_flight{{operation="{operation}"}} 0.0' in text
                )
            got = await client.generate(PROMPT, 3)
            assert got.finish_reason == "length"

    run(scenario())


def test_release_kv_cache_memory_after_a_pause_until_the_kv_cache_wakes(
    daemon: DaemonProcess,
) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            with pytest.raises(EngineError) as early:
                await client.release_kv_cache_memory()
            assert (early.value.code, early.value.message) == (
                "invalid_request",
                RELEASE_BEFORE_PAUSE,
            )
            frozen = await client.submit(PROMPT, 8, dp_rank=0)
            await client.pause("keep", clear_cache=False)
            stats = await client.release_kv_cache_memory()
            assert _states(stats) == {(2, False, False, True, 0)}
            assert {r.sleeping_tags for r in stats.ranks} == {("kv_cache",)}
            assert {(r.active_blocks, r.inactive_blocks) for r in stats.ranks} == {(0, 0)}
            text = (await client.metrics()).text
            assert 'sleep_state="awake"} 0.0' in text
            assert 'sleep_state="weights_offloaded"} 0.0' in text
            with pytest.raises(EngineError) as again:
                await client.release_kv_cache_memory()
            assert (again.value.code, again.value.message) == (
                "invalid_request",
                RELEASE_WHILE_ASLEEP,
            )
            stats = await client.wake_up(["kv_cache"])
            assert _states(stats) == {(0, False, False, False, 0)}
            # The frozen request was preempted by the release, and runs to its end.
            got = await client.collect(frozen)
            assert (len(got.token_ids), got.finish_reason) == (8, "length")
            assert (await client.stats()).ranks[0].preemptions_total == 1

    run(scenario())


def test_reset_running_requests_preempts_them_and_clears(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            running = await client.submit(PROMPT, LONG, dp_rank=1)
            async with contextlib.aclosing(client.outputs(running.request_id)) as outputs:
                await anext(outputs)  # scheduled: it holds KV blocks
            with pytest.raises(EngineError, match="still hold KV blocks"):
                await client.reset_prefix_cache(1)
            await client.reset_prefix_cache(1, reset_running_requests=True)
            stats = await client.stats()
            assert stats.ranks[1].preemptions_total == 1
            # It runs on after its preemption; its stream ends with the cancel.
            collecting = asyncio.ensure_future(client.collect(running))
            await client.cancel(running.request_id)
            got = await collecting
            assert got.finish_reason == "cancelled" and got.token_ids

    run(scenario())


def test_a_disconnect_while_a_pause_waits_leaves_the_daemon_serving(
    daemon: DaemonProcess,
) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as owner:
            running = await owner.submit(PROMPT, LONG, dp_rank=0)
            async with await EngineClient.connect(daemon.control) as waiter:
                calls = [asyncio.ensure_future(waiter.pause("wait")) for _ in range(20)]
                # One client may hold PAUSE_CLIENT_LIMIT waiting replies; the rest are refused
                # at once, and are the first to complete.
                for completed in asyncio.as_completed(calls):
                    with pytest.raises(EngineError) as refused:
                        await completed
                    assert refused.value.code == "overloaded"
                    if sum(call.done() for call in calls) == 20 - PAUSE_CLIENT_LIMIT:
                        break
                assert sum(call.done() for call in calls) == 20 - PAUSE_CLIENT_LIMIT
                for call in calls:
                    call.cancel()
            # The waiter is gone; its pauses hold until the request ends. A command to rank 0
            # read after them is applied after them (refused: the request holds its blocks).
            with pytest.raises(EngineError, match="still hold KV blocks"):
                await owner.reset_prefix_cache(0)
            stats = await owner.stats()
            assert stats.ranks[0].pause_pending and stats.ranks[0].rejecting
            await owner.cancel(running.request_id)
            stats = await owner.pause("keep")
            assert _states(stats) == {(2, False, False, False, 0)}
            await owner.resume()
            assert (await owner.generate(PROMPT, 2)).finish_reason == "length"

    run(scenario())


def test_malformed_and_huge_pause_messages_are_refused(daemon: DaemonProcess) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"type": "sleep", "level": 3}, "invalid_request"),
        ({"type": "pause", "mode": "drain"}, "bad_message"),
        ({"type": "wake_up", "tags": ["t" * 10_000_000]}, "invalid_request"),
        ({"type": "wake_up", "tags": ["t"] * 100_000}, "invalid_request"),
        ({"type": "pause", "k" * 5_000_000: 1}, "bad_message"),
        ({"type": "release_kv_cache_memory", "level": 1}, "bad_message"),
        ({"type": "reset_prefix_cache", "reset_running_requests": "yes"}, "bad_message"),
    ]

    async def scenario() -> None:
        await expect_refusals(daemon.control, cases)
        async with await EngineClient.connect(daemon.control) as client:
            assert _states(await client.stats()) == {(0, False, False, False, 0)}

    run(scenario())


def test_the_mocker_semantics_refuses_pause_and_sleep(tmp_path: Path) -> None:
    async def scenario(daemon: DaemonProcess) -> None:
        async with await EngineClient.connect(daemon.control) as client:
            for call in (
                client.pause(),
                client.sleep(),
                client.resume(),
                client.wake_up(),
                client.release_kv_cache_memory(),
                client.reset_prefix_cache(reset_running_requests=True),
            ):
                with pytest.raises(EngineError) as refused:
                    await call
                assert refused.value.code == "unsupported"

    with start_daemon(tmp_path, *FLAGS, "--semantics", "mocker-1.3.0") as daemon:
        run(scenario(daemon))


def test_async_scheduling_pauses_once_the_batch_in_flight_resolved(tmp_path: Path) -> None:
    """With `--async-scheduling` a `keep` pause completes once the batch in flight has
    resolved (EngineCore's `has_work()` counts its batch queue); a reset of the running
    requests preempts it; resumed, it runs to its end."""

    async def scenario(daemon: DaemonProcess) -> None:
        async with await EngineClient.connect(daemon.control) as client:
            frozen = await client.submit(PROMPT, 40, dp_rank=0)
            async with contextlib.aclosing(client.outputs(frozen.request_id)) as outputs:
                await anext(outputs)
            stats = await client.pause("keep", clear_cache=False)
            assert _states(stats) == {(2, False, False, False, 0)}
            assert stats.ranks[0].running == 1
            await client.reset_prefix_cache(reset_running_requests=True)
            assert (await client.stats()).ranks[0].preemptions_total == 1
            await client.resume()
            got = await client.collect(frozen)  # the first token was read above
            assert (len(got.token_ids), got.finish_reason) == (39, "length")

    with start_daemon(tmp_path, *FLAGS, "--async-scheduling") as daemon:
        run(scenario(daemon))


def test_pause_and_sleep_need_the_operator_role(tmp_path: Path) -> None:
    async def scenario(daemon: DaemonProcess) -> None:
        async with await EngineClient.connect(daemon.control) as client:
            for call, what in (
                (client.pause(), "pause"),
                (client.resume(), "resume"),
                (client.sleep(), "sleep"),
                (client.wake_up(), "wake_up"),
                (client.release_kv_cache_memory(), "release_kv_cache_memory"),
            ):
                with pytest.raises(EngineError) as refused:
                    await call
                assert refused.value.code == "forbidden"
                assert refused.value.message.startswith(f"{what} needs the operator role")

    with start_tcp_daemon(tmp_path, *FLAGS) as daemon:
        run(scenario(daemon))
