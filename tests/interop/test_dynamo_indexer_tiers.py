"""NVIDIA Dynamo 1.6.1's KV indexer sees the daemon's offload tiers (G2 host, G3 disk).

A real `engined serve` with a tiny GPU pool and G2/G3 tiers runs a prompt, then enough other
prompts to evict it from the GPU pool: its blocks are offloaded to G2 (published as
`BlockStored` with `medium: "CPU"`) and copied on to G3 (`medium: "STORAGE"`) after the last
request finished, so only the daemon's wake-up at the copy's deadline publishes them. A real
indexer (`python -m dynamo.indexer`) consumes the stream.

Oracle: `tests/reference_indexer.py` over the daemon's own stream (gap-free through replay),
with lower tiers indexed as Dynamo's continuation edges. The indexer's `/query` must report,
per tier, the same overlap for the offloaded prompt (cpu and disk tokens, no gpu tokens), and
its log must show no refused event.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import zmq.asyncio

from engined.client import EngineClient
from engined.core.types import Medium
from tests.interop.peers import DynamoIndexer
from tests.reference_indexer import ReferenceIndexer
from tests.server.daemon_harness import DaemonProcess, KvStream, start_daemon, to_core_events

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 8
WORKER_ID = 1
TIMEOUT_S = 20.0
POLL_S = 0.05

OFFLOADED = [1_000_000 + t for t in range(3 * BLOCK_SIZE)]  # 3 blocks
FILLERS = [[2_000_000 + 1000 * n + t for t in range(4 * BLOCK_SIZE)] for n in range(3)]


def tier_tokens(detail: dict[str, Any] | None) -> dict[str, int]:
    """Matched tokens per tier of one instance (absent tiers and instances count 0)."""
    detail = detail or {}
    return {tier: int(detail.get(tier) or 0) for tier in ("gpu", "cpu", "disk")}


def test_dynamo_indexer_reports_offloaded_prefixes_per_tier(
    tmp_path: Path, peers_python: Path
) -> None:
    async def scenario(daemon: DaemonProcess, indexer: DynamoIndexer) -> None:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(0), daemon.replay_endpoint(0))
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                gen = await client.generate(OFFLOADED, 0, timeout=TIMEOUT_S)
                assert gen.finish_reason == "length"
                for filler in FILLERS:
                    gen = await client.generate(filler, 0, timeout=TIMEOUT_S)
                    assert gen.finish_reason == "length"
                # Every transfer has landed once no tier block is held by a copy.
                deadline = time.monotonic() + TIMEOUT_S
                while True:
                    (rank,) = (await client.stats()).ranks
                    if (
                        rank.g2_total_blocks
                        and rank.g2_active_blocks == 0
                        and (rank.g3_inactive_blocks > 0 and rank.g3_active_blocks == 0)
                    ):
                        break
                    assert time.monotonic() < deadline, f"transfers never landed: {rank}"
                    await asyncio.sleep(POLL_S)
            await stream.catch_up()
            ref = ReferenceIndexer(BLOCK_SIZE, lower_tier_edges=True)
            ref.apply(to_core_events(stream.batches), worker_id=WORKER_ID)
            ref.assert_clean()
        finally:
            stream.close()
            ctx.term()

        assert ref.overlap(OFFLOADED, WORKER_ID) == 0, "the prompt must have left the GPU pool"
        cpu = ref.tier_overlap(OFFLOADED, Medium.CPU, WORKER_ID)
        disk = ref.tier_overlap(OFFLOADED, Medium.STORAGE, WORKER_ID)
        assert (cpu, disk) == (3, 3), "the whole prompt is offloaded to G2 and G3"
        want = {"gpu": 0, "cpu": cpu * BLOCK_SIZE, "disk": disk * BLOCK_SIZE}
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            got = tier_tokens(
                (await asyncio.to_thread(indexer.query_tiers, OFFLOADED)).get(WORKER_ID)
            )
            if got == want:
                break
            assert time.monotonic() < deadline, (
                f"indexer reports {got} for the offloaded prompt, the daemon's stream says {want}"
                f"\n{indexer.log_text()[-4000:]}"
            )
            await asyncio.sleep(POLL_S)
        # A filler still in the GPU pool matches on the device tier.
        filler = FILLERS[-1]
        got = tier_tokens((await asyncio.to_thread(indexer.query_tiers, filler)).get(WORKER_ID))
        assert got["gpu"] == ref.overlap(filler, WORKER_ID) * BLOCK_SIZE > 0
        assert indexer.log_problems() == [], indexer.log_text()[-4000:]

    with start_daemon(
        tmp_path,
        "--speedup-ratio",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks",
        str(NUM_GPU_BLOCKS),
        "--kv-bytes-per-token",
        "1000",
        env={
            "ENGINED_NUM_G2_BLOCKS": "32",
            "ENGINED_NUM_G3_BLOCKS": "64",
        },
    ) as daemon:
        indexer = DynamoIndexer(peers_python, tmp_path, "indexer-tiers", block_size=BLOCK_SIZE)
        try:
            indexer.start()
            indexer.register(WORKER_ID, 0, daemon.kv_endpoint(0), daemon.replay_endpoint(0))
            asyncio.run(asyncio.wait_for(scenario(daemon, indexer), 120))
        finally:
            indexer.stop()
