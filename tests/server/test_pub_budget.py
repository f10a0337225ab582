"""KV PUB buffers are bounded in bytes; a slow subscriber is dropped from, never waited for
(issue 10, 4).

1. The high-water mark is the byte budget over the largest batch a pass can produce.
2. That largest batch is an upper bound: no pass of random workloads (tiers included)
   publishes a bigger one.
3. A subscriber that never reads: publishing never blocks, a reading subscriber gets every
   batch, the overflow is counted, and what the stalled one was queued is bounded by the
   high-water mark, not by what was published. Once it reads again it gets live batches.
4. Prometheus exposes the overflow and replay counters.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from engined.core import types as core
from engined.core.args import EngineArgs
from engined.core.engine import Engine
from engined.core.types import Request, Submit
from engined.server.ops.prometheus_metrics import VllmMetrics
from engined.server.publish.kv_publisher import KvPublisher, max_batch_bytes, messages_within
from engined.wire.kv_events import KvEventEncoder, KvEventFormat, read_seq
from engined.zmq_sockets import SocketRegistry

BATCH_TOKENS = 256


def stored(n: int) -> list[core.KvEvent]:
    hashes = [2**40 + n]
    return [core.BlockStored(n, 0, None, hashes, hashes, list(range(BATCH_TOKENS)), BATCH_TOKENS)]


def test_the_hwm_is_the_budget_over_the_largest_batch() -> None:
    assert messages_within(100_000, 1_000) == 100
    assert messages_within(10, 1_000) == 1  # a budget below one batch still lets one through
    defaults = EngineArgs()
    largest = max_batch_bytes(defaults, "vllm")
    assert 100_000 < largest < 1_000_000
    assert messages_within(64 * 1024 * 1024, largest) == 64 * 1024 * 1024 // largest


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineArgs, list[Request]]:
    tiers = draw(st.booleans())
    args: dict[str, Any] = {
        "block_size": draw(st.sampled_from([2, 4, 16])),
        "num_gpu_blocks": draw(st.integers(4, 40)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.integers(4, 96)),
        "enable_prefix_caching": True,
        "speedup_ratio": 0.0,
    }
    if tiers:
        args |= {
            "num_g2_blocks": draw(st.integers(1, 16)),
            "num_g3_blocks": draw(st.sampled_from([None, 2, 8])),
            "kv_bytes_per_token": draw(st.sampled_from([10_000, 250_000])),
            "offload_batch_size": draw(st.integers(1, 3)),
            "bandwidth_g1_to_g2_gbps": draw(st.sampled_from([0.5, 2.0])),
            "bandwidth_g2_to_g3_gbps": draw(st.sampled_from([0.5, 2.0])),
        }
    if draw(st.booleans()):
        args |= {"aic_nextn": 2, "aic_nextn_accept_rates": "1,1"}
    prefixes = draw(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=40), min_size=1))
    suffixes = st.lists(st.integers(0, 9), max_size=40)
    requests = [
        Request(
            token_ids=draw(st.sampled_from(prefixes)) + draw(suffixes) or [1],
            max_tokens=draw(st.integers(0, 20)),
            request_id=f"r{n}",
        )
        for n in range(draw(st.integers(1, 12)))
    ]
    return EngineArgs(**args), requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(["vllm", "vllm-array"]))
def test_no_pass_publishes_a_batch_beyond_the_bound(
    workload: tuple[EngineArgs, list[Request]], fmt: KvEventFormat
) -> None:
    args, requests = workload
    bound = max_batch_bytes(args, fmt)
    encoder = KvEventEncoder(fmt)
    engine = Engine(args)
    for request in requests:
        if len(request.token_ids) < engine.num_blocks * engine.block_size:
            engine.apply(Submit(request), now_ms=0.0)
    now = 0.0
    for _ in range(400):
        if engine.is_drained():
            break
        result = engine.execute_pass(now)
        now = max(result.end_ms, now + 1.0)
        if result.kv_events:
            assert len(encoder.encode_batch(1.0e9, result.kv_events, 0)) <= bound


def sub(ctx: zmq.asyncio.Context, endpoint: str, rcvhwm: int = 1000) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


async def joined(pub: KvPublisher, socks: list[zmq.asyncio.Socket]) -> int:
    """Publish probes until every subscriber got one; the seq the test starts from."""
    while True:
        pub.publish(stored(pub.next_seq), 1.0)
        if all([await s.poll(20) for s in socks]):
            break
    for s in socks:
        while await s.poll(50):
            await s.recv_multipart()
    return pub.next_seq


def test_a_subscriber_that_never_reads_is_dropped_from_not_waited_for(tmp_path: Path) -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        registry = SocketRegistry()
        # 50 batches of at most 2 KB per subscriber.
        pub = KvPublisher(
            ctx,
            registry,
            endpoint=f"ipc://{tmp_path}/kv",
            bind=True,
            topic="",
            fmt="vllm",
            dp_rank=0,
            replay_endpoint=None,
            buffer_bytes=100 * 1024,
            batch_bytes=2048,
        )
        assert pub.hwm == 50
        slow = sub(ctx, pub.endpoint, rcvhwm=10)
        fast = sub(ctx, pub.endpoint)
        try:
            first = await joined(pub, [slow, fast])
            received: list[int] = []
            for n in range(3000):
                pub.publish(stored(n), 1.0)  # returns at once, whoever is behind
                # The reading subscriber keeps up: it has each batch before the next.
                assert await fast.poll(5000)
                received.append(read_seq((await fast.recv_multipart())[1]))
            assert received == list(range(first, first + 3000))
            assert pub.overflows >= 1
            held = []
            while await slow.poll(200):
                held.append(read_seq((await slow.recv_multipart())[1]))
            # A contiguous prefix: its high-water mark, its own queue and the socket buffers
            # in between, not the 3000 batches (4 MB) published since it stopped reading.
            assert held == list(range(first, first + len(held)))
            assert len(held) < 500, len(held)
            # Caught up, it gets live batches again (and sees the gap it can replay).
            pub.publish(stored(9), 1.0)
            assert await slow.poll(5000)
            assert read_seq((await slow.recv_multipart())[1]) == first + 3000
        finally:
            slow.close()
            fast.close()
            registry.close()
            ctx.destroy(linger=0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


class FakeReplay:
    abandoned = 2
    refused = 1
    streaming = 4


class FakePublisher:
    overflows = 3
    replay: Any = FakeReplay()


def test_prometheus_shows_slow_reader_counters() -> None:
    metrics = VllmMetrics(model_name="m", cache_info={})
    without_replay = FakePublisher()
    without_replay.replay = None
    metrics.watch_publishers([FakePublisher(), without_replay])
    text = generate_latest(metrics.registry).decode()
    assert 'engined:kv_events_overflows_total{engine="0",model_name="m"} 3.0' in text
    assert 'engined:kv_events_overflows_total{engine="1",model_name="m"} 3.0' in text
    assert 'engined:kv_replay_abandoned_total{engine="0",model_name="m"} 2.0' in text
    assert 'engined:kv_replay_refused_total{engine="0",model_name="m"} 1.0' in text
    assert 'engined:kv_replay_streams{engine="0",model_name="m"} 4.0' in text
    assert 'kv_replay_abandoned_total{engine="1"' not in text


@pytest.mark.parametrize("fmt", ["vllm", "vllm-array"])
def test_the_bound_covers_every_format(fmt: KvEventFormat) -> None:
    assert max_batch_bytes(EngineArgs(block_size=16), fmt) > 16 * 5 * 256


def test_the_bound_counts_mtps_lookahead_tokens_where_they_are_published() -> None:
    """With MTP and prefix caching under vLLM semantics every store names the token after
    each block (`lookahead_token_ids`, in the `vllm` format): the worst case carries it, 27
    bytes a block (its key, `[[u32]]`) over the budget's blocks, a partial block and a draft
    block per request."""
    with_caching = max_batch_bytes(EngineArgs(block_size=16, aic_nextn=2), "vllm")
    without = max_batch_bytes(
        EngineArgs(block_size=16, aic_nextn=2, enable_prefix_caching=False), "vllm"
    )
    entry = b"\xb3lookahead_token_ids\x91\x91\xce\xff\xff\xff\xff"
    assert with_caching - without == (8192 // 16 + 256 + 256) * len(entry)
