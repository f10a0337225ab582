"""`DaemonFollower` against real `engined serve` processes (no Dynamo: no endpoints to
leave or rejoin, so the follower's own decisions are what is observed).

The set-up a follower sends is owed to a daemon start until it went through: a restarted
daemon that is lost again (SIGSTOP) while being set up, then answers again as the same
start, gets the set-up again, although its client reports that return as no restart.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import msgspec

from engined.client import EngineClient
from engined.core.args import EngineType, WorkerType
from engined.dynamo.recovery import DaemonFollower, shape_change
from engined.wire.control import Welcome
from tests.server.daemon_harness import DaemonProcess

LIVENESS_S = 0.5
# Generous: a restarted daemon's first handshake waits for its Python start-up.
DEADLINE_S = 60.0
ARGS = ["--speedup-ratio", "0", "--block-size", "16"]


async def _until(what: str, condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            await asyncio.sleep(0.01)  # a poll of the condition, under the deadline
    assert condition(), what


def _daemon(tmp_path: Path, control: str | None = None) -> DaemonProcess:
    daemon = DaemonProcess(tmp_path, list(ARGS), None, control)
    daemon.wait_ready()
    return daemon


def test_a_set_up_cut_short_is_sent_again_when_the_same_start_answers(tmp_path: Path) -> None:
    first = _daemon(tmp_path)
    daemons = [first]

    async def scenario() -> None:
        async with await EngineClient.connect(first.control, liveness_s=LIVENESS_S) as client:
            welcome = await client.hello()
            set_up: list[str | None] = []
            ended: list[str] = []
            loads: list[int] = []

            async def setup(returned: Welcome) -> None:
                set_up.append(returned.instance_id)
                if len(set_up) == 1:
                    daemons[-1].proc.send_signal(signal.SIGSTOP)  # lost while set up
                await client.set_vocabulary(1000, [0, 1, 2], timeout=None)

            async def watch_load() -> None:
                loads.append(1)
                await client.watch_load(lambda _load: None)

            follower = DaemonFollower(
                client,
                [],
                welcome,
                setup=setup,
                republish=lambda _welcome: None,
                watch_load=watch_load,
                end=ended.append,
            )
            following = asyncio.ensure_future(follower.run())
            try:
                first.proc.kill()
                first.proc.wait(30)
                await _until("the loss", lambda: not follower.serving)
                # Not waited for with pings: the client's return and the set-up stopping it
                # (SIGSTOP) are the events this test waits for.
                second = DaemonProcess(tmp_path, list(ARGS), None, first.control)
                daemons.append(second)
                await _until("the cut-short set-up", lambda: len(set_up) == 1)
                await _until("the second loss", lambda: client.daemon_lost)
                second.proc.send_signal(signal.SIGCONT)
                await _until("serving again", lambda: follower.serving)
                restarted = await client.hello()
                assert restarted.instance_id not in (None, welcome.instance_id)
                assert set_up == [restarted.instance_id, restarted.instance_id]
                assert restarted.vocab_size == 1000 and restarted.excluded_token_ids == [0, 1, 2]
                assert loads == [1]
                assert ended == []
            finally:
                following.cancel()

    try:
        asyncio.run(scenario())
    finally:
        for daemon in daemons:
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGCONT)
            daemon.stop()


def test_shape_change_names_every_field_that_differs() -> None:
    registered = Welcome(
        id=1,
        protocol=1,
        version="x",
        engine_type=EngineType.VLLM,
        worker_type=WorkerType.AGGREGATED,
        block_size=16,
        num_gpu_blocks=100,
        dp_size=1,
        model_name="m",
        kv_events_endpoints=["tcp://a"],
        kv_replay_endpoints=[],
        fpm_endpoints=[],
    )
    same = msgspec.structs.replace(registered, instance_id="other start")
    assert shape_change(registered, same) is None
    other = msgspec.structs.replace(registered, block_size=32, dp_size=2, kv_events_endpoints=[])
    assert shape_change(registered, other) == (
        "block_size 16 -> 32, dp_size 1 -> 2, KV events turned on or off"
    )
