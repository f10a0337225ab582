"""Twins of the seed's `live_scheduler` module, of
`destination_lifecycle::productive_zero_duration_live_pass_continues_without_external_wake` and of
`forward_pass_metrics::test_fpm_sent_through_sink` (docs/upstream/seed-tests.md), run against a
real `engined serve` process.

Where the seed drives its in-process `Scheduler` through channels, these tests go through the
daemon's sockets: requests and `stats` over the control socket (`EngineClient`), KV events from
the rank's PUB socket (`KvStream`, which fills gaps from the replay socket) and FPM from the FPM
PUB socket. The seed's `RouterIndexerHarness` is `tests/reference_indexer.py`'s
`ReferenceIndexer`, fed with the wire events (`to_core_events`). The seed's
`assert_scheduler_completes_all` (docs/upstream/dynamo-mocker.md §8) is `completes_all` below.

Every wait is bounded: replies are awaited with timeouts, `stats` is polled in a loop with a
deadline, and each scenario runs under `asyncio.wait_for`. No sleep is used to synchronise.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from engined.client import EngineClient, Generation
from engined.wire.control import RankStats, Submitted
from engined.wire.fpm_schema import ForwardPassMetrics, decode_fpm
from engined.wire.kv_events import (
    REPLAY_END_SEQ,
    ArrayBlockStored,
    BlockStored,
    read_seq,
    seq_bytes,
)
from tests.reference_indexer import ReferenceIndexer
from tests.server.daemon_harness import DaemonProcess, KvStream, start_daemon, to_core_events
from tests.server.support import WAIT_S, assert_idle, rank0, wait_for_stats
from tests.support import run

SCENARIO_TIMEOUT_S = 120.0


def engine_flags(
    *,
    block_size: int,
    num_gpu_blocks: int,
    speedup_ratio: float,
    prefix_caching: bool = True,
    chunked_prefill: bool = True,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> list[str]:
    """`engined serve` flags for the seed's `MockEngineArgs::builder()` calls."""
    flags = [
        "--block-size",
        str(block_size),
        "--num-gpu-blocks",
        str(num_gpu_blocks),
        "--speedup-ratio",
        str(speedup_ratio),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill",
    ]
    if max_num_seqs is not None:
        flags += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return flags


# --- observing the daemon -------------------------------------------------------------------


async def assert_stream_complete(
    ctx: zmq.asyncio.Context, daemon: DaemonProcess, stream: KvStream
) -> None:
    """Nothing was published after what `stream` holds (its replay found no truncated tail).

    `KvStream` keeps only batches contiguous from seq 0; were the replay buffer to have evicted
    the seqs it still needed, later batches would be skipped without a trace. A replay from
    `stream.next_seq` answering only the end marker proves the stream is whole.
    """
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(daemon.replay_endpoint())
    try:
        await dealer.send_multipart([b"", seq_bytes(stream.next_seq)])
        frames = await asyncio.wait_for(dealer.recv_multipart(), WAIT_S)
        extra = None if frames[2] == REPLAY_END_SEQ else read_seq(frames[2])
        assert extra is None, f"stream ends at seq {stream.next_seq}, daemon replayed seq {extra}"
    finally:
        dealer.close()


def check_kv_stream(stream: KvStream, block_size: int) -> ReferenceIndexer:
    """Apply the whole wire stream to a reference indexer; it must be clean.

    Also checks what the seed's raw sink relies on: every Stored carries the tokens of its blocks
    (`len(token_ids) == len(block_hashes) * block_size`).
    """
    for event in stream.events():
        if isinstance(event, BlockStored | ArrayBlockStored):
            assert event.block_size == block_size, event
            assert len(event.token_ids) == len(event.block_hashes) * block_size, event
    # The daemons run vLLM's semantics, whose pool caches twins (a recomputed last block).
    indexer = ReferenceIndexer(block_size, vllm=True)
    indexer.apply(to_core_events(stream.batches))
    indexer.assert_clean()
    return indexer


def client_gone_records(daemon: DaemonProcess) -> list[dict[str, object]]:
    records = []
    for line in daemon.log().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == "client gone":
            records.append(record)
    return records


async def completes_all(
    client: EngineClient,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
) -> list[Generation]:
    """Submit every prompt at once (no pacing), then collect every request to its end."""
    submitted: list[Submitted] = await asyncio.gather(
        *(
            client.submit(prompt, max_tokens, request_id=f"req-{i}", timeout=WAIT_S)
            for i, prompt in enumerate(prompts)
        )
    )
    return await asyncio.gather(*(client.collect(s, timeout=30.0) for s in submitted))


def random_prompts(
    rng: random.Random, num_requests: int, input_len: int, *, use_shared_tokens: bool
) -> list[list[int]]:
    """Prompts as `assert_scheduler_completes_all` draws them (tokens in [0, 50000)).

    With shared tokens every prompt starts with the same `input_len // 2` tokens and ends with
    its own `input_len // 2`.
    """

    def draw(n: int) -> list[int]:
        return [rng.randrange(50_000) for _ in range(n)]

    if not use_shared_tokens:
        return [draw(input_len) for _ in range(num_requests)]
    shared = draw(input_len // 2)
    return [shared + draw(input_len // 2) for _ in range(num_requests)]


def assert_all_finished(generations: Sequence[Generation], max_tokens: int) -> None:
    for gen in generations:
        assert gen.finish_reason == "length", gen
        assert len(gen.token_ids) == max_tokens, gen


# --- live_scheduler ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("use_shared_tokens", "enable_prefix_caching", "enable_chunked_prefill"),
    [
        pytest.param(False, False, False, id="case_1"),
        pytest.param(False, True, False, id="case_2"),
        pytest.param(True, False, False, id="case_3"),
        pytest.param(True, True, False, id="case_4"),
        pytest.param(False, False, True, id="case_5"),
        pytest.param(False, True, True, id="case_6"),
        pytest.param(True, False, True, id="case_7"),
        pytest.param(True, True, True, id="case_8"),
    ],
)
def test_scheduler_token_generation_patterns(
    tmp_path: Path,
    use_shared_tokens: bool,
    enable_prefix_caching: bool,
    enable_chunked_prefill: bool,
) -> None:
    """200 requests of 1000 tokens x 100 outputs drain a 500-block pool cleanly.

    1. Daemon: bs 64, 500 blocks, speedup 1000 (as the seed), caching and chunked prefill per
       case; default budget 8192 and 256 seqs. 16 prompt blocks per request, so about 30 fit at
       once and preemption churn is certain.
    2. Subscribe a KvStream to rank 0's KV PUB (gaps are filled from the replay socket).
    3. One client submits all 200 prompts up front (random tokens in [0, 50000) from a seeded
       Random; with shared tokens the first 500 are common) and collects every request.
    4. `stats` right after the last output; then catch the stream up and apply it to
       ReferenceIndexer(64).

    Result: every request finishes with exactly 100 tokens ("length"); the rank is idle (0
    active blocks, usage 0.0, 500 total blocks, nothing running or waiting); the stream is
    complete, every Stored carries its blocks' token ids, and the indexer records no violation.
    With caching, at least one Stored applied; without, no Stored and no Removed at all.
    """
    num_requests, input_len, max_tokens = 200, 1000, 100
    prompts = random_prompts(
        random.Random(20_240_601), num_requests, input_len, use_shared_tokens=use_shared_tokens
    )
    flags = engine_flags(
        block_size=64,
        num_gpu_blocks=500,
        speedup_ratio=1000,
        prefix_caching=enable_prefix_caching,
        chunked_prefill=enable_chunked_prefill,
    )

    async def scenario(daemon: DaemonProcess) -> tuple[list[Generation], RankStats, KvStream]:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                generations = await completes_all(client, prompts, max_tokens)
                stats = await rank0(client)
            await stream.catch_up()
            await assert_stream_complete(ctx, daemon, stream)
            return generations, stats, stream
        finally:
            stream.close()
            ctx.term()

    with start_daemon(tmp_path, *flags) as daemon:
        generations, stats, stream = run(scenario(daemon), SCENARIO_TIMEOUT_S)

    assert len(generations) == num_requests
    assert_all_finished(generations, max_tokens)
    assert sum(len(g.token_ids) for g in generations) == num_requests * max_tokens
    assert_idle(stats, total_blocks=500)
    indexer = check_kv_stream(stream, block_size=64)
    if enable_prefix_caching:
        assert indexer.ok_count("stored") > 0
    else:
        assert indexer.ok_count("stored") == 0
        assert indexer.ok_count("removed") == 0
        assert not stream.events(), "no KV events at all without prefix caching"


def test_scheduler_mtp_lifecycle_drains_small_blocks(tmp_path: Path) -> None:
    """MTP with every draft accepted drains 24 small requests.

    1. Daemon: bs 4, 128 blocks, budget 64, 16 seqs, speedup 1000, no prefix caching,
       `--nextn 2 --nextn-accept-rates 1,1` (the seed's aic_nextn / aic_nextn_accept_rates).
    2. One client submits 24 random 5-token prompts with 7 outputs each, up front, and collects
       them; `stats` right after; the KV stream is caught up and indexed.

    Result: every request finishes with exactly 7 tokens ("length"), some of them in
    multi-token (speculative burst) entries; the rank is idle; the KV stream is clean and,
    without caching, empty.
    """
    num_requests, input_len, max_tokens = 24, 5, 7
    prompts = random_prompts(random.Random(7), num_requests, input_len, use_shared_tokens=False)
    flags = [
        *engine_flags(
            block_size=4,
            num_gpu_blocks=128,
            speedup_ratio=1000,
            prefix_caching=False,
            max_num_seqs=16,
            max_num_batched_tokens=64,
        ),
        "--nextn",
        "2",
        "--nextn-accept-rates",
        "1,1",
    ]

    async def scenario(daemon: DaemonProcess) -> tuple[list[Generation], RankStats, KvStream]:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                generations = await completes_all(client, prompts, max_tokens)
                stats = await rank0(client)
            await stream.catch_up()
            await assert_stream_complete(ctx, daemon, stream)
            return generations, stats, stream
        finally:
            stream.close()
            ctx.term()

    with start_daemon(tmp_path, *flags) as daemon:
        generations, stats, stream = run(scenario(daemon), SCENARIO_TIMEOUT_S)

    assert_all_finished(generations, max_tokens)
    # Accept rates 1,1: bursts of up to 3 tokens, so fewer entries than tokens.
    assert all(g.num_outputs < max_tokens for g in generations), generations
    assert_idle(stats, total_blocks=128)
    indexer = check_kv_stream(stream, block_size=4)
    assert indexer.ok_count("stored") == 0
    assert not stream.events()


def test_cache_hit_rate_with_identical_requests(tmp_path: Path) -> None:
    """Identical prompts hit the prefix cache and leave the rank idle.

    1. Daemon: bs 64, 100 blocks, speedup 10 (the seed's args; caching on by default).
    2. One client sends 10 requests with the same 65-token prompt 0..65 and 10 outputs, one at
       a time. (The seed spaces them 100 ms apart so each finishes before the next; here each is
       awaited to its end instead of sleeping.)
    3. `stats` after the last one.

    Result: exactly 100 tokens in all, every request "length" with 10 tokens; the first request
    had no cached tokens, each later one 64 (its first block, cached by the first request); the
    rank is idle (0 active blocks, usage 0.0, 100 total blocks).
    """
    num_requests, max_tokens = 10, 10
    prompt = list(range(65))
    flags = engine_flags(block_size=64, num_gpu_blocks=100, speedup_ratio=10)

    async def scenario(daemon: DaemonProcess) -> tuple[list[Generation], RankStats]:
        async with await EngineClient.connect(daemon.control) as client:
            generations = []
            for i in range(num_requests):
                generations.append(
                    await client.generate(
                        prompt, max_tokens, request_id=f"same-{i}", timeout=WAIT_S
                    )
                )
            return generations, await rank0(client)

    with start_daemon(tmp_path, *flags) as daemon:
        generations, stats = run(scenario(daemon), SCENARIO_TIMEOUT_S)

    assert sum(len(g.token_ids) for g in generations) == num_requests * max_tokens
    assert_all_finished(generations, max_tokens)
    assert generations[0].cached_tokens == 0
    assert [g.cached_tokens for g in generations[1:]] == [64] * (num_requests - 1)
    assert_idle(stats, total_blocks=100)


def test_receiver_drop_cleans_up_resources(tmp_path: Path) -> None:
    """A client that vanishes mid-stream gets its request cancelled and its KV freed.

    1. Daemon: bs 64, 10 blocks (the seed's args) at speedup 10 (the seed's 100 would finish the
       remaining 71 tokens in about 20 ms, racing the socket disconnect; at 10 they take about
       0.2 s, so the request is still running when the daemon notices).
    2. Client A submits prompt 0..256 with 200 outputs and reads until it has 129 tokens, then
       closes its socket abruptly (`EngineClient.close()`, linger 0) without cancelling.
    3. Client B polls `stats` until the rank has no active block (bounded wait).
    4. Client B sends a new request (prompt 0..64, 4 outputs) and collects it.

    Result: A saw no finished entry before leaving; the daemon logs exactly one "client gone"
    warning, which cancelled 1 request; the rank drains to idle (0 active blocks, usage 0.0,
    10 total blocks); B's request completes with 4 tokens; the daemon exits cleanly.
    """
    flags = engine_flags(block_size=64, num_gpu_blocks=10, speedup_ratio=10)

    async def scenario(daemon: DaemonProcess) -> tuple[int, RankStats, Generation]:
        vanishing = await EngineClient.connect(daemon.control)
        received = 0
        try:
            async for entry in vanishing.stream(
                list(range(256)), 200, request_id="vanishing", timeout=WAIT_S
            ):
                assert not entry.finished, "the request ended before the client left"
                received += len(entry.token_ids)
                if received >= 129:
                    break
        finally:
            await vanishing.close()
        async with await EngineClient.connect(daemon.control) as survivor:
            idle = await wait_for_stats(survivor, lambda s: s.active_blocks == 0)
            after = await survivor.generate(list(range(64)), 4, timeout=WAIT_S)
        return received, idle, after

    with start_daemon(tmp_path, *flags) as daemon:
        received, idle, after = run(scenario(daemon), SCENARIO_TIMEOUT_S)
        gone = client_gone_records(daemon)

    assert received >= 129
    assert_idle(idle, total_blocks=10)
    assert after.finish_reason == "length"
    assert len(after.token_ids) == 4
    assert len(gone) == 1, gone
    assert gone[0]["level"] == "warning"
    assert gone[0]["cancelled"] == 1


def test_live_scheduler_forwards_buffered_kv_token_ids(tmp_path: Path) -> None:
    """The KV PUB socket carries the tokens of every stored block.

    1. Daemon: bs 4, 12 blocks, budget 8, 1 seq, chunked prefill, prefix caching, speedup 1000.
    2. Subscribe a KvStream; submit prompt 0..8 with 1 output and read its output (within 2 s).
    3. Catch the stream up.

    Result: the request completes in one entry (1 token, "length"); the first BlockStored has
    block_size 4, two blocks and token_ids [0..7] (the seed's `[[0,1,2,3],[4,5,6,7]]`); the
    stream is clean.
    """
    flags = engine_flags(
        block_size=4,
        num_gpu_blocks=12,
        speedup_ratio=1000,
        max_num_seqs=1,
        max_num_batched_tokens=8,
    )

    async def scenario(daemon: DaemonProcess) -> tuple[Generation, KvStream]:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                gen = await client.generate(list(range(8)), 1, request_id="req-72", timeout=2.0)
            await stream.catch_up()
            await assert_stream_complete(ctx, daemon, stream)
            return gen, stream
        finally:
            stream.close()
            ctx.term()

    with start_daemon(tmp_path, *flags) as daemon:
        gen, stream = run(scenario(daemon), SCENARIO_TIMEOUT_S)

    assert gen.finish_reason == "length"
    assert len(gen.token_ids) == 1
    assert gen.num_outputs == 1
    stored = [e for e in stream.events() if isinstance(e, BlockStored)]
    assert stored, "a Stored event was published"
    first = stored[0]
    assert first.block_size == 4
    assert len(first.block_hashes) == 2
    assert list(first.token_ids) == list(range(8))
    check_kv_stream(stream, block_size=4)


def test_live_pathological_load_no_router_event_errors(tmp_path: Path) -> None:
    """Eight identical prompts squeezed into 6 blocks keep the KV stream valid.

    1. Daemon: bs 4, 6 blocks, budget 8, 3 seqs, prefix caching, chunked prefill, speedup 1000.
    2. Subscribe a KvStream; one client submits 8 requests of [42] * 8 with 4 outputs each, up
       front, and collects them (the seed allows 5 s).
    3. Catch the stream up and apply it to ReferenceIndexer(4).

    Result: 32 tokens in all, every request "length" with 4 tokens; the stream is clean with at
    least one Stored applied; the rank is idle.
    """
    flags = engine_flags(
        block_size=4,
        num_gpu_blocks=6,
        speedup_ratio=1000,
        max_num_seqs=3,
        max_num_batched_tokens=8,
    )

    async def scenario(daemon: DaemonProcess) -> tuple[list[Generation], RankStats, KvStream]:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                generations = await asyncio.wait_for(completes_all(client, [[42] * 8] * 8, 4), 5.0)
                stats = await rank0(client)
            await stream.catch_up()
            await assert_stream_complete(ctx, daemon, stream)
            return generations, stats, stream
        finally:
            stream.close()
            ctx.term()

    with start_daemon(tmp_path, *flags) as daemon:
        generations, stats, stream = run(scenario(daemon), SCENARIO_TIMEOUT_S)

    assert sum(len(g.token_ids) for g in generations) == 8 * 4
    assert_all_finished(generations, 4)
    assert_idle(stats, total_blocks=6)
    indexer = check_kv_stream(stream, block_size=4)
    assert indexer.ok_count("stored") > 0


# --- destination_lifecycle (live) -------------------------------------------------------------


def test_productive_zero_duration_live_pass_continues_without_external_wake(
    tmp_path: Path,
) -> None:
    """A decode worker's zero-duration admission pass is followed at once by the next pass.

    1. Daemon: decode worker, bs 4, 4 blocks, budget 16, 1 seq, chunked prefill, prefix
       caching, speedup 1000.
    2. Submit prompt [1] * 4 with 1 output; the submit reply is awaited, then the output.

    Result: the request's output arrives although no further command is sent (the admission
    pass takes no modeled time, yet the loop runs the next pass without waiting for a command:
    a loop that waited would never answer, so a generous timeout tells the two apart without
    timing anything), and it is the request's finished entry with 1 token.
    """
    flags = [
        *engine_flags(
            block_size=4,
            num_gpu_blocks=4,
            speedup_ratio=1000,
            max_num_seqs=1,
            max_num_batched_tokens=16,
        ),
        "--worker-type",
        "decode",
    ]

    async def scenario(daemon: DaemonProcess) -> Generation:
        async with await EngineClient.connect(daemon.control) as client:
            await client.hello(timeout=WAIT_S)
            return await client.generate([1] * 4, 1, request_id="req-31001", timeout=WAIT_S)

    with start_daemon(tmp_path, *flags) as daemon:
        gen = run(scenario(daemon), SCENARIO_TIMEOUT_S)

    assert gen.request_id == "req-31001"
    assert gen.finish_reason == "length"
    assert len(gen.token_ids) == 1


# --- forward_pass_metrics (live) --------------------------------------------------------------


class FpmSubscriber:
    """One SUB on a rank's FPM socket, read message by message as `(seq, metrics, arrival)`."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)

    async def next(self, timeout: float = WAIT_S) -> tuple[int, ForwardPassMetrics, float]:
        _topic, seq, payload = await asyncio.wait_for(self._sub.recv_multipart(), timeout)
        return read_seq(seq), decode_fpm(payload), time.monotonic()

    def close(self) -> None:
        self._sub.close()


def is_heartbeat(fpm: ForwardPassMetrics) -> bool:
    s, q = fpm.scheduled_requests, fpm.queued_requests
    return (
        fpm.wall_time == 0.0
        and s.num_prefill_requests == s.sum_prefill_tokens == s.sum_prefill_kv_tokens == 0
        and s.num_decode_requests == s.sum_decode_kv_tokens == 0
        and s.var_prefill_length == s.var_decode_kv_tokens == 0.0
        and q.num_prefill_requests == q.sum_prefill_tokens == 0
        and q.num_decode_requests == q.sum_decode_kv_tokens == 0
        and q.var_prefill_length == q.var_decode_kv_tokens == 0.0
    )


def test_fpm_sent_through_sink(tmp_path: Path) -> None:
    """Pass metrics and idle heartbeats reach an FPM subscriber.

    1. Daemon: the seed's fpm_args (bs 4, 16 blocks, budget 16, 4 seqs, chunked prefill, no
       prefix caching, speedup 0).
    2. Subscribe to rank 0's FPM socket and wait for an idle heartbeat, which proves the
       subscription is live (a PUB drops what it sends before a subscriber joins).
    3. Submit prompt 0..8 with 2 outputs and collect it.
    4. Read FPM messages until the next heartbeat.

    Result: the first message after the submit is the request's pass: 1 prefill request, 8
    prefill tokens, wall_time > 0. Every message has version 1, dp_rank 0 and counter_id ==
    its seq, seqs consecutive. After the request's passes (all with wall_time > 0), an
    all-zero heartbeat (wall_time 0.0) follows. (That it comes a second after the last pass
    is checked on a fake clock in test_publishers.py::test_heartbeat_deadlines; arrival times
    at a subscriber on a shared machine cannot tell it.)
    """
    flags = engine_flags(
        block_size=4,
        num_gpu_blocks=16,
        speedup_ratio=0,
        prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )

    async def scenario(
        daemon: DaemonProcess,
    ) -> tuple[list[tuple[int, ForwardPassMetrics, float]], Generation]:
        ctx = zmq.asyncio.Context()
        sub = FpmSubscriber(ctx, daemon.fpm_endpoint())
        try:
            messages = [await sub.next(timeout=5.0)]
            assert is_heartbeat(messages[0][1]), messages[0]
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                gen = await client.generate(list(range(8)), 2, request_id="req-1", timeout=5.0)
            while True:
                messages.append(await sub.next(timeout=5.0))
                if is_heartbeat(messages[-1][1]):
                    return messages, gen
        finally:
            sub.close()
            ctx.term()

    with start_daemon(tmp_path, *flags) as daemon:
        messages, gen = run(scenario(daemon), SCENARIO_TIMEOUT_S)

    assert gen.finish_reason == "length"
    assert len(gen.token_ids) == 2
    seqs = [seq for seq, _, _ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    for seq, fpm, _ in messages:
        assert fpm.version == 1
        assert fpm.dp_rank == 0
        assert fpm.counter_id == seq
    passes = messages[1:-1]
    assert passes, "the request's passes published FPM"
    first = passes[0][1]
    assert first.scheduled_requests.num_prefill_requests == 1
    assert first.scheduled_requests.sum_prefill_tokens == 8
    assert first.wall_time > 0.0
    assert all(fpm.wall_time > 0.0 for _, fpm, _ in passes)
    _, heartbeat, _ = messages[-1]
    assert heartbeat.wall_time == 0.0
