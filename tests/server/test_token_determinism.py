"""Two real daemons started with the same `--seed` stream the same tokens for the same requests,
however differently those requests reach them.

Daemon A gets all 20 requests at once on one rank, in a pool small enough that they preempt
each other; daemon B has two ranks and gets them in reverse order, in waves of five, each wave
awaited before the next. Requests with a `seed` are sent to A and B under different ids. Both
run at speedup 0, so only the order of events could differ; the tokens may not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq.asyncio

from engined.client import EngineClient
from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.support import run

COMMON = (
    "--seed",
    "11",
    "--speedup-ratio",
    "0",
    "--block-size",
    "4",
    "--max-num-batched-tokens",
    "32",
)
PROMPTS = [[n * 100 + i for i in range(3 + n % 7)] for n in range(20)]
MAX_TOKENS = 24
SEEDED_PROMPTS = PROMPTS[:5]
REQUEST_SEED = 77


async def generate_all(
    daemon: DaemonProcess, order: list[int], wave: int, seeded_prefix: str
) -> tuple[dict[str, list[int]], dict[int, list[int]], int]:
    """(tokens by request id, seeded tokens by prompt index, preemptions) of one daemon."""
    ctx = zmq.asyncio.Context()
    try:
        async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
            plain: dict[str, list[int]] = {}
            for start in range(0, len(order), wave):
                batch = order[start : start + wave]
                done = await asyncio.gather(
                    *(client.generate(PROMPTS[n], MAX_TOKENS, request_id=f"r{n}") for n in batch)
                )
                plain.update((g.request_id, g.token_ids) for g in done)
            seeded = await asyncio.gather(
                *(
                    client.generate(
                        prompt, MAX_TOKENS, request_id=f"{seeded_prefix}{n}", seed=REQUEST_SEED
                    )
                    for n, prompt in enumerate(SEEDED_PROMPTS)
                )
            )
            stats = await client.stats()
            preemptions = sum(rank.preemptions_total for rank in stats.ranks)
            return plain, {n: g.token_ids for n, g in enumerate(seeded)}, preemptions
    finally:
        ctx.term()


def test_two_daemons_with_the_same_seed_stream_the_same_tokens(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        start_daemon(tmp_path / "a", *COMMON, "--num-gpu-blocks", "24") as a,
        start_daemon(
            tmp_path / "b", *COMMON, "--num-gpu-blocks", "400", "--data-parallel-size", "2"
        ) as b,
    ):
        at_once = run(generate_all(a, list(range(20)), 20, "sa-"))
        in_waves = run(generate_all(b, list(range(19, -1, -1)), 5, "sb-"))
    plain_a, seeded_a, preemptions_a = at_once
    plain_b, seeded_b, preemptions_b = in_waves
    assert preemptions_a > 0 and preemptions_b == 0
    assert sorted(plain_a) == sorted(plain_b) == sorted(f"r{n}" for n in range(20))
    assert all(len(tokens) == MAX_TOKENS for tokens in plain_a.values())
    assert plain_a == plain_b
    assert len(set(map(tuple, plain_a.values()))) == 20
    assert seeded_a == seeded_b
    assert seeded_a[0] != plain_a["r0"]


async def unnamed_then_aliased(
    daemon: DaemonProcess,
) -> tuple[list[list[int]], list[int], list[int]]:
    """Three unnamed requests; then request "x" of one client, and "x" of another while the
    first runs (so it runs under an alias)."""
    ctx = zmq.asyncio.Context()
    try:
        async with (
            await EngineClient.connect(daemon.control, ctx=ctx) as first,
            await EngineClient.connect(daemon.control, ctx=ctx) as second,
        ):
            unnamed = [(await first.generate(PROMPTS[n], 8)).token_ids for n in range(3)]
            long = await first.submit(PROMPTS[0], 5000, request_id="x")
            aliased = await second.generate(PROMPTS[0], 40, request_id="x")
            stats = await first.stats()
            assert stats.ranks[0].running == 1, "the first x had ended: no alias was needed"
            original = await first.collect(long)
            return unnamed, original.token_ids, aliased.token_ids
    finally:
        ctx.term()


def test_unnamed_and_aliased_requests_keep_their_tokens(tmp_path: Path) -> None:
    """An unnamed request's tokens follow its count, not the UUID the daemon names it with; a
    request run under an alias (another client holds its name) gets its name's tokens."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        start_daemon(tmp_path / "a", *COMMON, "--num-gpu-blocks", "4000") as a,
        start_daemon(tmp_path / "b", *COMMON, "--num-gpu-blocks", "4000") as b,
    ):
        unnamed_a, original, aliased = run(unnamed_then_aliased(a))
        unnamed_b, _, _ = run(unnamed_then_aliased(b))
    assert unnamed_a == unnamed_b
    assert len({tuple(tokens) for tokens in unnamed_a}) == 3
    assert len(original) == 5000
    assert aliased == original[:40]
