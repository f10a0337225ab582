"""NVIDIA Dynamo 1.6.1's standalone KV indexer consumes the daemon's KV events.

A real `engined serve` (prefix caching on, a 64-block pool per rank so blocks get evicted,
replay on) publishes while a mixed workload runs: prompts sharing prefixes, different lengths
(partial last blocks included), `max_tokens` 0 to 33 (so decode blocks are stored too),
concurrent requests, then a prefix-cache reset. Two real indexers (`python -m dynamo.indexer`)
consume the stream: one registered before the first request, one registered late that must
rebuild the past through the replay socket.

Oracle: what the daemon's cache holds, computed from the daemon's own event stream
(`KvStream`, gap-free through replay) by `tests/reference_indexer.py`. At every checkpoint each
indexer's `POST /query` (matched device-tier tokens per worker and dp rank) must equal
`ReferenceIndexer.overlap(tokens) * block_size` for every prompt and every prompt plus its
output; `GET /dump` must hold exactly the reference's blocks per rank (the whole cache, not
only the prompts' paths); and the indexer's log must show no refused event and no unrecovered
gap.

Workers are registered over `POST /register` (KV PUB and replay endpoint per dp rank): the
`--workers "W=ep,W:1=ep"` flag takes no replay endpoint, and registering the same instance
again over HTTP is refused (409), so it cannot be combined with replay.

Synchronisation: after each phase a sentinel prompt (fresh blocks, `max_tokens` 0) is sent to
every rank; its store is the last batch the rank publishes, so once an indexer matches the
sentinel it has applied everything before it. Every wait has a deadline; there is no sleep
except the poll interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
import zmq.asyncio

from engined.client import EngineClient
from engined.wire import kv_events as kv
from tests.interop.peers import DynamoIndexer
from tests.reference_indexer import ReferenceIndexer
from tests.server.daemon_harness import DaemonProcess, KvStream, start_daemon, to_core_events
from tests.support import run

T = TypeVar("T")

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 64
WORKER_ID = 1
SCENARIO_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 30.0
SYNC_TIMEOUT_S = 20.0
POLL_S = 0.05
CONCURRENCY = 4
MAX_TOKENS = (0, 1, 5, 20, 0, 33, 12)

# Shared "system prompts": 48 tokens (3 blocks), 40 (2 blocks and a partial one), 64.
FAMILIES = {
    name: [base + t for t in range(length)]
    for name, base, length in (
        ("a", 1_000_000, 48),
        ("b", 2_000_000, 40),
        ("c", 3_000_000, 64),
        ("d", 4_000_000, 56),
        ("e", 5_000_000, 32),
    )
}


@dataclass(frozen=True)
class Job:
    name: str
    tokens: list[int]
    max_tokens: int
    dp_rank: int


@dataclass
class Done:
    job: Job
    output: list[int]


@dataclass
class Scenario:
    dp_size: int
    client: EngineClient
    streams: list[KvStream]
    indexers: list[DynamoIndexer] = field(default_factory=list)
    done: list[Done] = field(default_factory=list)
    sentinels: int = 0


def jobs(phase: int, families: str, count: int, dp_size: int) -> list[Job]:
    """`count` prompts of the phase: a family prefix plus a unique suffix of 0 to 90 tokens."""
    out = []
    for i in range(count):
        family = families[i % len(families)]
        suffix_len = (i * 23 + phase * 11) % 91
        suffix = [10_000_000 * (phase + 1) + i * 1000 + t for t in range(suffix_len)]
        out.append(
            Job(
                name=f"p{phase}-{i}-{family}",
                tokens=FAMILIES[family] + suffix,
                max_tokens=MAX_TOKENS[(i + phase) % len(MAX_TOKENS)],
                dp_rank=i % dp_size,
            )
        )
    return out


async def run_jobs(s: Scenario, batch: Sequence[Job]) -> None:
    """Run the jobs CONCURRENCY at a time; every one completes with its max_tokens tokens."""

    async def one(job: Job) -> Done:
        gen = await s.client.generate(
            job.tokens, job.max_tokens, dp_rank=job.dp_rank, timeout=REQUEST_TIMEOUT_S
        )
        assert gen.finish_reason == "length", (job.name, gen)
        assert len(gen.token_ids) == job.max_tokens, (job.name, gen)
        return Done(job, gen.token_ids)

    for start in range(0, len(batch), CONCURRENCY):
        group = batch[start : start + CONCURRENCY]
        s.done.extend(await asyncio.gather(*(one(job) for job in group)))


def reference(s: Scenario) -> ReferenceIndexer:
    """The daemon's cache as its own event stream says: every rank's batches from seq 0."""
    # The daemons run vLLM semantics: vLLM's hashes, and its twin stores counted.
    ref = ReferenceIndexer(BLOCK_SIZE, vllm=True)
    for stream in s.streams:
        ref.apply(to_core_events(stream.batches), worker_id=WORKER_ID)
    ref.assert_clean()
    return ref


def expected(
    ref: ReferenceIndexer, tokens: Sequence[int], dp_size: int
) -> dict[tuple[int, int], int]:
    out = {}
    for rank in range(dp_size):
        # What Dynamo's router makes of vLLM's stream: it keeps no count of a block's twins.
        blocks = ref.router_overlap(tokens, worker_id=WORKER_ID, dp_rank=rank)
        if blocks:
            out[(WORKER_ID, rank)] = blocks * BLOCK_SIZE
    return out


async def sync(s: Scenario) -> ReferenceIndexer:
    """Send a sentinel to every rank, read the streams up to it, wait for every indexer to
    match it (so it applied every earlier batch too); returns the reference at that point."""
    sentinels = []
    for rank in range(s.dp_size):
        # Two blocks and one token: with MTP a block's hash covers the token after it, so
        # the second block is stored only if that token is known (the store is the same
        # two blocks without MTP).
        tokens = [90_000_000 + s.sentinels * 1000 + t for t in range(2 * BLOCK_SIZE + 1)]
        s.sentinels += 1
        gen = await s.client.generate(tokens, 0, dp_rank=rank, timeout=REQUEST_TIMEOUT_S)
        assert gen.finish_reason == "length"
        sentinels.append((rank, tokens))
    for rank, tokens in sentinels:
        stream = s.streams[rank]
        await stream.catch_up()
        last = stream.batches[-1]
        assert any(
            type(ev).__name__.removeprefix("Array") == "BlockStored"
            and list(getattr(ev, "token_ids", [])) == tokens[: 2 * BLOCK_SIZE]
            for ev in last.events
        ), f"rank {rank}: the sentinel's store is not the last batch (seq {stream.next_seq - 1})"
    ref = reference(s)
    for indexer in s.indexers:
        for rank, tokens in sentinels:
            want = {(WORKER_ID, rank): 2 * BLOCK_SIZE}
            assert expected(ref, tokens, s.dp_size) == want
            deadline = time.monotonic() + SYNC_TIMEOUT_S
            while True:
                got = await asyncio.to_thread(indexer.query, tokens)
                if got == want:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{indexer.name} never applied rank {rank}'s sentinel "
                        f"(query {got}, want {want}); problems: {indexer.log_problems()}\n"
                        f"{indexer.log_text()[-4000:]}"
                    )
                await asyncio.sleep(POLL_S)
    return ref


def queries(s: Scenario) -> dict[str, list[int]]:
    """Every prompt, every prompt plus its output, and controls the cache never held."""
    out: dict[str, list[int]] = {}
    for done in s.done:
        out[done.job.name] = done.job.tokens
        if done.output:
            out[f"{done.job.name}+out"] = done.job.tokens + done.output
    for name, prefix in FAMILIES.items():
        out[f"{name}+junk"] = prefix + [77_000_000 + t for t in range(40)]
    out["never"] = [88_000_000 + t for t in range(100)]
    return out


async def check(
    s: Scenario, ref: ReferenceIndexer, indexers: Sequence[DynamoIndexer]
) -> dict[str, int]:
    """Every query matches the reference on every indexer; returns the reference overlaps
    (total tokens over ranks) per query."""
    overlaps: dict[str, int] = {}
    for name, tokens in queries(s).items():
        want = expected(ref, tokens, s.dp_size)
        overlaps[name] = sum(want.values())
        for indexer in indexers:
            got = await asyncio.to_thread(indexer.query, tokens)
            assert got == want, (
                f"{indexer.name}: /query for {name} ({len(tokens)} tokens) gave {got}, "
                f"the daemon's cache holds {want}"
            )
    # The whole cache, not only the prompts' paths: the same blocks per worker and rank.
    want_blocks = {
        (WORKER_ID, rank): ref.router_blocks(WORKER_ID, rank)
        for rank in range(s.dp_size)
        if ref.router_blocks(WORKER_ID, rank)
    }
    for indexer in indexers:
        got_blocks = await asyncio.to_thread(indexer.dump_blocks)
        assert got_blocks == want_blocks, (
            indexer.name,
            {
                key: (sorted(got_blocks.get(key, set()) - blocks), sorted(blocks - got_blocks[key]))
                for key, blocks in want_blocks.items()
                if key in got_blocks and got_blocks[key] != blocks
            },
            set(got_blocks) ^ set(want_blocks),
        )
        assert indexer.log_problems() == [], f"{indexer.name}:\n{indexer.log_text()[-4000:]}"
    return overlaps


def register(indexer: DynamoIndexer, daemon: DaemonProcess, dp_size: int) -> None:
    for rank in range(dp_size):
        indexer.register(WORKER_ID, rank, daemon.kv_endpoint(rank), daemon.replay_endpoint(rank))


@pytest.mark.parametrize(
    ("fmt", "dp_size"),
    [("vllm", 1), ("vllm-array", 1), ("vllm", 2)],
    ids=["vllm-dp1", "vllm-array-dp1", "vllm-dp2"],
)
def test_dynamo_indexer_matches_the_daemon_cache(
    tmp_path: Path, peers_python: Path, fmt: str, dp_size: int
) -> None:
    """1. start engined (64 blocks per rank, replay on, --kv-events-format fmt, dp_size
       ranks) and an indexer E registered for every rank (PUB and replay endpoint);
    2. phase 1: 14 requests over families a-c, 4 at a time; sync; compare E;
    3. start a late indexer L and register it; phase 2: 28 requests over families c-e
       (evicts phase 1's unique blocks); sync; compare E and L;
    4. reset the prefix cache; phase 3: 6 requests over family a; sync; compare E and L.

    Result: at each checkpoint, for every prompt (and prompt + output, and controls) each
    indexer's /query equals the reference overlap of the daemon's own stream; some prompt
    has a non-zero overlap, some phase-1 prompt cached after phase 1 was evicted by phase 2,
    and the reset empties what phase 3 did not re-store; L recovered seqs from 0 by replay;
    neither log has a decode failure, unknown parent, short token_ids or an unrecovered gap;
    the stream held stores, removals and a clear.
    """

    async def scenario(daemon: DaemonProcess, early: DynamoIndexer, late: DynamoIndexer) -> None:
        ctx = zmq.asyncio.Context()
        streams = [
            KvStream(ctx, daemon.kv_endpoint(r), daemon.replay_endpoint(r)) for r in range(dp_size)
        ]
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                s = Scenario(dp_size, client, streams, indexers=[early])

                await run_jobs(s, jobs(1, "abc", 14, dp_size))
                ref1 = await sync(s)
                after_phase1 = await check(s, ref1, [early])

                await asyncio.to_thread(late.start)
                await asyncio.to_thread(register, late, daemon, dp_size)
                s.indexers.append(late)
                await run_jobs(s, jobs(2, "cde", 28, dp_size))
                ref2 = await sync(s)
                after_phase2 = await check(s, ref2, [early, late])

                assert await client.reset_prefix_cache() is not None
                await run_jobs(s, jobs(3, "a", 6, dp_size))
                ref3 = await sync(s)
                after_phase3 = await check(s, ref3, [early, late])
        finally:
            for stream in streams:
                stream.close()
            ctx.term()

        phase1 = [d.job.name for d in s.done if d.job.name.startswith("p1-")]
        assert any(after_phase2[name] for name in after_phase2), "nothing was cached"
        evicted = [n for n in phase1 if after_phase1[n] > after_phase2[n]]
        assert evicted, "no phase-1 prompt was evicted by phase 2"
        assert any(after_phase3[d.job.name] for d in s.done if d.job.name.startswith("p3-"))
        assert not any(after_phase3[d.job.name] for d in s.done if d.job.name.startswith("p2-")), (
            "the reset left phase-2 blocks cached"
        )
        for rank in range(dp_size):
            assert ref2.num_blocks(WORKER_ID, rank) > 0, f"rank {rank} cached nothing"

        kinds = {
            ev.__class__.__name__.removeprefix("Array") for st in streams for ev in st.events()
        }
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        # Each event decoded as the family of its format: positional for vllm-array, tagged
        # maps for vllm.
        array_events = [
            type(ev).__name__.startswith("Array") for st in streams for ev in st.events()
        ]
        assert set(array_events) == {fmt == "vllm-array"}
        # The late indexer joined after phase 1: it rebuilt seqs from 0 by replay, per rank.
        for rank in range(dp_size):
            assert any(
                (r, start) == (rank, 0) and end > 0 for r, start, end in late.recovered_gaps()
            ), f"rank {rank}: the late indexer never replayed from seq 0: {late.recovered_gaps()}"

    with start_daemon(
        tmp_path,
        "--speedup-ratio",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks",
        str(NUM_GPU_BLOCKS),
        "--kv-events-format",
        fmt,
        "--data-parallel-size",
        str(dp_size),
    ) as daemon:
        early = DynamoIndexer(peers_python, tmp_path, "indexer-early", block_size=BLOCK_SIZE)
        late = DynamoIndexer(peers_python, tmp_path, "indexer-late", block_size=BLOCK_SIZE)
        try:
            early.start()
            register(early, daemon, dp_size)
            run(scenario(daemon, early, late), SCENARIO_TIMEOUT_S)
        finally:
            early.stop()
            late.stop()


def unique_jobs(count: int) -> list[Job]:
    """`count` prompts of 17 to 120 tokens sharing no prefix."""
    return [
        Job(
            name=f"u-{i}",
            tokens=[60_000_000 + i * 1000 + t for t in range(17 + (i * 37) % 104)],
            max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)],
            dp_rank=0,
        )
        for i in range(count)
    ]


def test_dynamo_indexer_takes_mtp_lookahead_events(tmp_path: Path, peers_python: Path) -> None:
    """MTP (`--nextn 2`) with prefix caching: every store carries vLLM 0.33's lookahead block
    hashes (each block's covers the token after it) and `lookahead_token_ids`; Dynamo
    1.6.1's indexer decodes them and indexes the blocks by their tokens, so its queries and
    its whole cache equal the daemon's, through evictions (30 unique prompts in 64 blocks).

    The prompts share no prefix on purpose: where prompts share a prefix, vLLM's MTP stream
    stores the boundary block once per following token, under different hashes, and Dynamo
    1.6.1's radix tree then skips a later store chained to the second hash ("Failed to find
    parent block; skipping store operation"), as it would behind a real vLLM (README,
    "Faithfulness").
    """

    async def scenario(daemon: DaemonProcess, indexer: DynamoIndexer) -> None:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(0), daemon.replay_endpoint(0))
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                s = Scenario(1, client, [stream], indexers=[indexer])
                await run_jobs(s, unique_jobs(30))
                ref = await sync(s)
                overlaps = await check(s, ref, [indexer])
        finally:
            stream.close()
            ctx.term()
        assert any(overlaps[d.job.name] for d in s.done), "nothing was cached"
        assert any(not overlaps[d.job.name] for d in s.done), "nothing was evicted"
        stores = [ev for ev in stream.events() if isinstance(ev, kv.BlockStored)]
        assert stores
        assert all(
            ev.lookahead_token_ids is not None
            and len(ev.lookahead_token_ids) == len(ev.block_hashes)
            for ev in stores
        )

    with start_daemon(
        tmp_path,
        "--speedup-ratio",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks",
        str(NUM_GPU_BLOCKS),
        "--nextn",
        "2",
    ) as daemon:
        indexer = DynamoIndexer(peers_python, tmp_path, "indexer", block_size=BLOCK_SIZE)
        try:
            indexer.start()
            register(indexer, daemon, 1)
            run(scenario(daemon, indexer), SCENARIO_TIMEOUT_S)
        finally:
            indexer.stop()
