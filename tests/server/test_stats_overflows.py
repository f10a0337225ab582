"""`stats` counts the KV event sends a slow subscriber missed (issue 10: drops in stats and
metrics), per rank, as `engined:kv_events_overflows_total` does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from engined.client import EngineClient
from tests.server.daemon_harness import start_daemon

FLAGS = ("--speedup-ratio", "0", "--block-size", "16", "--kv-events-buffer-bytes", "1")


def test_stats_count_what_a_subscriber_that_never_reads_missed(tmp_path: Path) -> None:
    async def scenario(control: str, kv: str) -> tuple[int, int]:
        ctx = zmq.asyncio.Context()
        try:
            async with await EngineClient.connect(control, ctx=ctx) as client:
                before = (await client.stats()).ranks[0].kv_events_overflows
                slow = ctx.socket(zmq.SUB)
                slow.setsockopt(zmq.RCVHWM, 1)
                slow.setsockopt(zmq.RCVBUF, 4096)
                slow.setsockopt(zmq.SUBSCRIBE, b"")
                slow.connect(kv)
                # Until the daemon says it dropped some: each request stores fresh blocks.
                n = 0
                while (await client.stats()).ranks[0].kv_events_overflows == 0:
                    assert n < 20_000, "no overflow counted"
                    await asyncio.gather(
                        *(
                            client.generate([n * 512 + i + k * 64 for i in range(64)], 1)
                            for k in range(8)
                        )
                    )
                    n += 1
                slow.close()
                return before, (await client.stats()).ranks[0].kv_events_overflows
        finally:
            ctx.destroy(linger=0)

    with start_daemon(tmp_path, *FLAGS) as daemon:
        before, after = asyncio.run(
            asyncio.wait_for(scenario(daemon.control, daemon.kv_endpoint()), 120)
        )
    assert before == 0
    assert after >= 1
