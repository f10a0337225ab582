"""A P/D pair: two daemons (prefill: `--worker-type prefill`, decode: `--worker-type decode`),
a test playing the coordinator (submit_handoff_prefill -> source_held lifecycle ->
reserve_destination -> destination_reserved lifecycle -> activate_destination ->
release_source) ends with both drained.

The test is the handoff coordinator of Dynamo's mocker (docs/upstream/dynamo-mocker.md §7.1,
SourceFirst order): it drives both daemons over their control sockets with `EngineClient`,
checks every reply and lifecycle event, and at the end checks that both daemons hold no KV
and that each KV event stream (`KvStream`, gaps filled by replay) is one a router accepts
without a violation (`ReferenceIndexer`, one worker id per daemon).

Every wait is bounded: replies are awaited with timeouts, `stats` is polled with a deadline, and
each scenario runs under `asyncio.wait_for`. No sleep is used to synchronise.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from engined.client import EngineClient, EngineError, Generation
from engined.wire.control import (
    Applied,
    DestinationReservedEvent,
    KvTransferTimingMode,
    Noop,
    SourceHeldEvent,
    TransferTiming,
)
from tests.reference_indexer import ReferenceIndexer
from tests.server.daemon_harness import DaemonProcess, KvStream, start_daemon, to_core_events
from tests.server.support import assert_idle, rank0, wait_for_stats
from tests.support import run

WAIT_S = 10.0
BLOCK_SIZE = 16
PREFILL = 0  # worker ids of the two daemons in the reference indexer
DECODE = 1
# 128 KiB of KV per token over 25 GB/s: a 100-token prompt takes 0.524288 ms to transfer.
KV_BYTES_PER_TOKEN = 131072
KV_BANDWIDTH_GB_S = 25.0
PREFILL_FLAGS = (
    "--worker-type",
    "prefill",
    "--speedup-ratio",
    "0",
    "--block-size",
    str(BLOCK_SIZE),
    "--kv-bytes-per-token",
    str(KV_BYTES_PER_TOKEN),
    "--kv-transfer-bandwidth",
    str(KV_BANDWIDTH_GB_S),
)
DECODE_FLAGS = ("--worker-type", "decode", "--speedup-ratio", "0", "--block-size", str(BLOCK_SIZE))
# Both end idle when a test passes; when one fails midway, a reservation nobody activates
# would hold the shutdown for the default 30 s drain.
DRAIN = ("--drain-timeout", "2")


@contextlib.contextmanager
def pd_pair(
    tmp_path: Path,
    *,
    prefill: tuple[str, ...] = PREFILL_FLAGS,
    decode: tuple[str, ...] = DECODE_FLAGS,
) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """A prefill and a decode daemon, each in its own directory; both must exit 0."""
    (tmp_path / "prefill").mkdir()
    (tmp_path / "decode").mkdir()
    with (
        start_daemon(tmp_path / "prefill", *prefill, *DRAIN) as p,
        start_daemon(tmp_path / "decode", *decode, *DRAIN) as d,
    ):
        yield p, d


def prompt(seed: int, length: int = 100) -> list[int]:
    """A prompt of distinct tokens, different for every seed."""
    return [seed * 10_000 + i for i in range(length)]


def transfer_delay_ms(prompt_len: int) -> float:
    return prompt_len * KV_BYTES_PER_TOKEN / (KV_BANDWIDTH_GB_S * 1e9) * 1000.0


class Streams:
    """The KV event streams of both daemons, opened before the workload."""

    def __init__(self, ctx: zmq.asyncio.Context, p: DaemonProcess, d: DaemonProcess) -> None:
        self.prefill = KvStream(ctx, p.kv_endpoint(), p.replay_endpoint())
        self.decode = KvStream(ctx, d.kv_endpoint(), d.replay_endpoint())

    async def check(self) -> ReferenceIndexer:
        """Catch both streams up and feed them to one indexer, one worker id per daemon."""
        await self.prefill.catch_up()
        await self.decode.catch_up()
        indexer = ReferenceIndexer(BLOCK_SIZE, vllm=True)
        indexer.apply(to_core_events(self.prefill.batches), worker_id=PREFILL)
        indexer.apply(to_core_events(self.decode.batches), worker_id=DECODE)
        indexer.assert_clean()
        return indexer

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@contextlib.asynccontextmanager
async def connected(
    p: DaemonProcess, d: DaemonProcess
) -> AsyncIterator[tuple[EngineClient, EngineClient, Streams]]:
    """(prefill client, decode client, KV streams of both) for one scenario."""
    ctx = zmq.asyncio.Context()
    streams = Streams(ctx, p, d)
    try:
        async with (
            await EngineClient.connect(p.control, ctx=ctx) as pc,
            await EngineClient.connect(d.control, ctx=ctx) as dc,
        ):
            yield pc, dc, streams
    finally:
        streams.close()
        ctx.term()


async def coordinate(
    pc: EngineClient,
    dc: EngineClient,
    handoff_id: str,
    tokens: list[int],
    decode_tokens: int,
    *,
    shared_blocks: int = 0,
    timing_mode: str = "full_prompt",
) -> tuple[Generation, Generation]:
    """One handoff in SourceFirst order; returns (prefill output, decode output).

    `shared_blocks`: leading full blocks of the prompt that other handoffs may already have
    stored on the decode worker; the transfer excludes cached blocks, so its size is the
    prompt's blocks minus 0 to that many.
    """
    request_id = f"req-{handoff_id}"
    submitted = await pc.submit_handoff_prefill(handoff_id, tokens, 1, request_id=request_id)
    assert submitted.request_id == request_id
    held = await pc.next_lifecycle(handoff_id, timeout=WAIT_S)
    assert held == SourceHeldEvent(
        handoff_id=handoff_id,
        request_id=request_id,
        transfer_timing=TransferTiming(
            mode=KvTransferTimingMode(timing_mode),
            full_prompt_tokens=len(tokens),
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            bandwidth_gb_s=KV_BANDWIDTH_GB_S,
        ),
    )
    prefill = await pc.collect(submitted, timeout=WAIT_S)

    accepted = await dc.reserve_destination(
        handoff_id, tokens, decode_tokens, request_id=request_id
    )
    assert (accepted.request_id, accepted.dp_rank) == (request_id, 0)
    reserved = await dc.next_lifecycle(handoff_id, timeout=WAIT_S)
    assert isinstance(reserved, DestinationReservedEvent)
    assert (reserved.handoff_id, reserved.request_id) == (handoff_id, request_id)
    blocks = math.ceil(len(tokens) / BLOCK_SIZE)
    assert reserved.transferable_prompt_tokens in {
        (blocks - cached) * BLOCK_SIZE for cached in range(shared_blocks + 1)
    }, reserved
    assert isinstance(await dc.activate_destination(handoff_id), Applied)
    decode = await dc.collect(accepted, timeout=WAIT_S)
    assert isinstance(await pc.release_source(handoff_id), Applied)
    return prefill, decode


def assert_prefill_output(gen: Generation, tokens: list[int]) -> None:
    assert gen.finish_reason == "length"
    assert len(gen.token_ids) == 1
    assert gen.handoff_delay_ms == pytest.approx(transfer_delay_ms(len(tokens)))


def assert_decode_output(gen: Generation, decode_tokens: int) -> None:
    assert gen.finish_reason == "length"
    assert len(gen.token_ids) == decode_tokens
    # Streamed: one entry per decode pass (no MTP).
    assert gen.num_outputs == decode_tokens
    assert gen.handoff_delay_ms is None


def test_handoff_lifecycle_drains_both_workers(tmp_path: Path) -> None:
    """1. start a prefill daemon (KV bytes per token and transfer bandwidth set) and a decode
       daemon; subscribe to both KV streams;
    2. submit_handoff_prefill of a 100-token prompt with max_tokens 1 on the prefill side;
    3. await its `source_held` lifecycle event and its output;
    4. reserve_destination on the decode side (30 decode tokens), await
       `destination_reserved`;
    5. activate_destination, collect the decode output; release_source on the prefill side.

    Result: the prefill output is one token, finish_reason "length", with the transfer time
    (100 tokens * 128 KiB / 25 GB/s) as handoff_delay_ms; destination_reserved carries the
    prompt's 7 blocks (112 tokens); the decode side streams 30 tokens one entry per pass and
    finishes with "length"; both daemons end with no active block, nothing waiting or running;
    both KV streams are clean and index the prompt's 6 full blocks under the same hashes.
    """
    tokens = prompt(1)

    async def scenario(p: DaemonProcess, d: DaemonProcess) -> None:
        async with connected(p, d) as (pc, dc, streams):
            prefill, decode = await coordinate(pc, dc, "h-1", tokens, 30)
            assert_prefill_output(prefill, tokens)
            assert_decode_output(decode, 30)
            assert_idle(await rank0(pc))
            assert_idle(await rank0(dc))
            indexer = await streams.check()
            full_blocks = len(tokens) // BLOCK_SIZE
            assert indexer.overlap(tokens, worker_id=PREFILL) == full_blocks
            assert indexer.overlap(tokens, worker_id=DECODE) == full_blocks
            # The decode worker also stores the blocks its own tokens completed.
            assert indexer.overlap(tokens + decode.token_ids, worker_id=DECODE) > full_blocks

    with pd_pair(tmp_path) as (p, d):
        run(scenario(p, d))


@pytest.mark.parametrize(
    ("mode", "moved_tokens"), [("full_prompt", 104), ("destination_missing", 48)]
)
def test_transfer_timing_mode_decides_what_the_coordinator_moves(
    tmp_path: Path, mode: str, moved_tokens: int
) -> None:
    """1. start the pair, the prefill daemon with `--kv-transfer-timing-mode <mode>`;
    2. hand off a 104-token prompt whose first 64 tokens (4 blocks) a finished handoff has
       left in the decode worker's prefix cache;
    3. compute the coordinator's transfer delay from the `source_held` event's
       `transfer_timing` and the `destination_reserved` event's `transferable_prompt_tokens`.

    Result: the reservation lacks 3 of the 7 blocks (48 tokens); the delay moves the whole
    prompt (104 tokens) in `full_prompt` mode and the 48 missing tokens in
    `destination_missing` mode (128 KiB per token over 25 GB/s); the prefill output's
    `handoff_delay_ms` is the full prompt's in both modes (as upstream's).
    """
    shared = prompt(7, 64)
    first, second = shared + prompt(1, 40), shared + prompt(2, 40)
    flags = (*PREFILL_FLAGS, "--kv-transfer-timing-mode", mode)

    async def scenario(p: DaemonProcess, d: DaemonProcess) -> None:
        async with connected(p, d) as (pc, dc, _):
            await coordinate(pc, dc, "h-warm", first, 2, timing_mode=mode)
            submitted = await pc.submit_handoff_prefill("h-2", second, 1, request_id="r-2")
            held = await pc.next_lifecycle("h-2", timeout=WAIT_S)
            prefill = await pc.collect(submitted, timeout=WAIT_S)
            accepted = await dc.reserve_destination("h-2", second, 2, request_id="r-2")
            reserved = await dc.next_lifecycle("h-2", timeout=WAIT_S)
            assert isinstance(held, SourceHeldEvent) and held.transfer_timing is not None
            assert isinstance(reserved, DestinationReservedEvent)
            assert reserved.transferable_prompt_tokens == 48
            delay = held.transfer_timing.delay_ms(reserved.transferable_prompt_tokens)
            assert delay == pytest.approx(transfer_delay_ms(moved_tokens))
            assert prefill.handoff_delay_ms == pytest.approx(transfer_delay_ms(len(second)))
            assert isinstance(await dc.activate_destination("h-2"), Applied)
            assert (await dc.collect(accepted, timeout=WAIT_S)).finish_reason == "length"
            assert isinstance(await pc.release_source("h-2"), Applied)
            assert_idle(await rank0(pc))
            assert_idle(await rank0(dc))

    with pd_pair(tmp_path, prefill=flags) as (p, d):
        run(scenario(p, d))


def test_concurrent_handoffs(tmp_path: Path) -> None:
    """1. start the pair; subscribe to both KV streams;
    2. run eight handoffs at once (prompts share a 32-token prefix, lengths 40 to 140,
       decode lengths 5 to 40), each a full coordinator sequence as above.

    Result: each reservation transfers the prompt's blocks less those of the shared prefix
    the decode worker has already cached (0 to 2 blocks, depending on the interleaving);
    every prefill output has its handoff_delay_ms and finishes with "length"; every
    decode output has its decode tokens and finishes with "length"; both daemons end
    drained; both KV streams are clean.
    """
    shared = prompt(99, 32)
    jobs = [(f"h-{i}", shared + prompt(i, 8 + 13 * i), 5 + 5 * i) for i in range(8)]

    async def scenario(p: DaemonProcess, d: DaemonProcess) -> None:
        async with connected(p, d) as (pc, dc, streams):
            results = await asyncio.gather(
                *(coordinate(pc, dc, h, tokens, n, shared_blocks=2) for h, tokens, n in jobs)
            )
            for (_, tokens, n), (prefill, decode) in zip(jobs, results, strict=True):
                assert_prefill_output(prefill, tokens)
                assert_decode_output(decode, n)
            assert_idle(await rank0(pc))
            assert_idle(await rank0(dc))
            await streams.check()

    with pd_pair(tmp_path) as (p, d):
        run(scenario(p, d))


def test_pending_destination_is_reserved_after_the_first_completes(tmp_path: Path) -> None:
    """1. start the pair; the decode pool has 10 blocks of 16 tokens and --max-num-seqs 1, so
       only one 100-token prompt (7 blocks) fits at a time;
    2. prefill handoffs A, B and C on the prefill side (all three held);
    3. reserve A (reserved at once), then B and C: both accepted, both pending;
    4. cancel_destination C (applied, then noop); a second reserve_destination of B's handoff
       id is refused;
    5. activate A; await B's `destination_reserved`; collect A's stream without waiting;
    6. activate B, collect it; release the three sources (C's too, it was never transferred).

    Result: after step 3 the decode side holds only A's 7 blocks; B's reservation arrives
    only after A's stream finished (all of it is already there in step 5); the duplicate
    reserve gets duplicate_request with the upstream message; both outputs finish with
    "length"; both daemons end drained and both KV streams are clean.
    """
    tokens = {h: prompt(i) for i, h in enumerate(("a", "b", "c"), start=1)}
    decode = (*DECODE_FLAGS, "--num-gpu-blocks", "10", "--max-num-seqs", "1")

    async def scenario(p: DaemonProcess, d: DaemonProcess) -> None:
        async with connected(p, d) as (pc, dc, streams):
            for h, t in tokens.items():
                submitted = await pc.submit_handoff_prefill(h, t, 1, request_id=f"req-{h}")
                assert isinstance(await pc.next_lifecycle(h, timeout=WAIT_S), SourceHeldEvent)
                assert_prefill_output(await pc.collect(submitted, timeout=WAIT_S), t)

            accepted_a = await dc.reserve_destination("a", tokens["a"], 8, request_id="req-a")
            reserved_a = await dc.next_lifecycle("a", timeout=WAIT_S)
            assert isinstance(reserved_a, DestinationReservedEvent)
            assert reserved_a.transferable_prompt_tokens == 112
            accepted_b = await dc.reserve_destination("b", tokens["b"], 8, request_id="req-b")
            await dc.reserve_destination("c", tokens["c"], 8, request_id="req-c")
            assert (await rank0(dc)).active_blocks == 7  # B and C hold no KV yet

            assert isinstance(await dc.cancel_destination("c"), Applied)
            assert isinstance(await dc.cancel_destination("c"), Noop)
            with pytest.raises(EngineError) as refused:
                await dc.reserve_destination("b", tokens["b"], 8, request_id="req-b2")
            assert refused.value.code == "duplicate_request"
            assert refused.value.message == "destination handoff HandoffId(b) is already pending"

            assert isinstance(await dc.activate_destination("a"), Applied)
            reserved_b = await dc.next_lifecycle("b", timeout=WAIT_S)
            # The client queues messages in arrival order, so if the daemon sent A's last
            # output before B's reservation, all of A's stream is queued by now and
            # collecting it needs no wait (timeout 0).
            try:
                gen_a = await dc.collect(accepted_a, timeout=0)
            except TimeoutError:
                raise AssertionError("B was reserved before A's stream ended") from None
            assert_decode_output(gen_a, 8)
            assert reserved_b == DestinationReservedEvent(
                handoff_id="b", request_id="req-b", transferable_prompt_tokens=112
            )

            assert isinstance(await dc.activate_destination("b"), Applied)
            assert_decode_output(await dc.collect(accepted_b, timeout=WAIT_S), 8)
            for h in tokens:
                assert isinstance(await pc.release_source(h), Applied)
            assert_idle(await rank0(pc))
            assert_idle(await rank0(dc))
            await streams.check()

    with pd_pair(tmp_path, decode=decode) as (p, d):
        run(scenario(p, d))


def test_cancel_source_of_a_running_prefill(tmp_path: Path) -> None:
    """1. start a paced prefill daemon (speedup 1, fixed model at 1 ms per prompt token,
       64-token chunks) and a decode daemon;
    2. submit_handoff_prefill of a 2048-token prompt (about 2 s of prefill);
    3. poll `stats` until the request runs; cancel_source;
    4. cancel_source and release_source again.

    Result: the cancel is applied and the request's stream ends with one token-less entry,
    finish_reason "cancelled"; no `source_held` ever arrives; the repeated commands are noops;
    the prefill daemon ends drained and its KV stream is clean.
    """
    prefill = (
        "--worker-type",
        "prefill",
        "--speedup-ratio",
        "1",
        "--block-size",
        str(BLOCK_SIZE),
        "--perf-model",
        "fixed",
        "--fixed-prefill-ms-per-token",
        "1",
        "--max-num-batched-tokens",
        "64",
    )

    async def scenario(p: DaemonProcess, d: DaemonProcess) -> None:
        async with connected(p, d) as (pc, _dc, streams):
            submitted = await pc.submit_handoff_prefill("s", prompt(7, 2048), 1, request_id="r")
            await wait_for_stats(pc, lambda s: s.running == 1, "the source running")
            assert isinstance(await pc.cancel_source("s"), Applied)
            gen = await pc.collect(submitted, timeout=WAIT_S)
            assert (gen.token_ids, gen.finish_reason, gen.num_outputs) == ([], "cancelled", 1)
            assert isinstance(await pc.cancel_source("s"), Noop)
            assert isinstance(await pc.release_source("s"), Noop)
            assert_idle(await rank0(pc))
            # Lifecycle events precede the replies that follow them: none came for "s".
            with pytest.raises(TimeoutError):
                await pc.next_lifecycle(timeout=0)
            await streams.check()

    with pd_pair(tmp_path, prefill=prefill) as (p, d):
        run(scenario(p, d))


def test_handoff_command_idempotency_and_conflicts(tmp_path: Path) -> None:
    """1. start the pair;
    2. send every handoff command for unknown handoff ids to both daemons;
    3. prefill handoff "x" to held; submit_handoff_prefill "x" again with another request id;
    4. reserve "x" on the decode side to reserved; reserve_destination "x" again;
    5. activate "x" twice; collect; cancel_destination "x";
    6. release_source "x" twice.

    Result: unknown ids get noop; the duplicate prefill gets duplicate_request
    "handoff HandoffId(x) is already active", the duplicate reservation duplicate_request
    "destination handoff HandoffId(x) is already active"; the second activate and the
    cancel after completion are noops; the first release is applied, the second a noop;
    both daemons end drained and both KV streams are clean.
    """
    tokens = prompt(3)

    async def scenario(p: DaemonProcess, d: DaemonProcess) -> None:
        async with connected(p, d) as (pc, dc, streams):
            for client in (pc, dc):
                for command in (
                    client.release_source,
                    client.cancel_source,
                    client.activate_destination,
                    client.cancel_destination,
                ):
                    assert isinstance(await command("never-seen"), Noop)

            submitted = await pc.submit_handoff_prefill("x", tokens, 1, request_id="r-x")
            await pc.next_lifecycle("x", timeout=WAIT_S)
            await pc.collect(submitted, timeout=WAIT_S)
            with pytest.raises(EngineError) as duplicate:
                await pc.submit_handoff_prefill("x", tokens, 1, request_id="r-y")
            assert duplicate.value.code == "duplicate_request"
            assert duplicate.value.message == "handoff HandoffId(x) is already active"

            accepted = await dc.reserve_destination("x", tokens, 4, request_id="r-x")
            await dc.next_lifecycle("x", timeout=WAIT_S)
            with pytest.raises(EngineError) as duplicate:
                await dc.reserve_destination("x", tokens, 4, request_id="r-y")
            assert duplicate.value.code == "duplicate_request"
            assert duplicate.value.message == "destination handoff HandoffId(x) is already active"

            assert isinstance(await dc.activate_destination("x"), Applied)
            assert isinstance(await dc.activate_destination("x"), Noop)
            assert_decode_output(await dc.collect(accepted, timeout=WAIT_S), 4)
            assert isinstance(await dc.cancel_destination("x"), Noop)
            assert isinstance(await pc.release_source("x"), Applied)
            assert isinstance(await pc.release_source("x"), Noop)
            assert_idle(await rank0(pc))
            assert_idle(await rank0(dc))
            await streams.check()

    with pd_pair(tmp_path) as (p, d):
        run(scenario(p, d))


def test_trtllm_refuses_destination_reservation(tmp_path: Path) -> None:
    """1. start a TRT-LLM decode daemon (`--engine-type trtllm`);
    2. reserve_destination of a 100-token prompt;
    3. activate and cancel the same handoff id.

    Result: error code "unsupported", message "destination reservation is not supported for
    TRT-LLM"; the handoff id stays unknown (both commands are noops); no KV was taken.
    """

    async def scenario(daemon: DaemonProcess) -> None:
        async with await EngineClient.connect(daemon.control) as client:
            welcome = await client.hello()
            assert (welcome.engine_type, welcome.worker_type) == ("trtllm", "decode")
            with pytest.raises(EngineError) as refused:
                await client.reserve_destination("t", prompt(5), 4, request_id="r-t")
            assert refused.value.code == "unsupported"
            assert refused.value.message == "destination reservation is not supported for TRT-LLM"
            assert isinstance(await client.activate_destination("t"), Noop)
            assert isinstance(await client.cancel_destination("t"), Noop)
            assert_idle(await rank0(client))

    with start_daemon(tmp_path, "--engine-type", "trtllm", "--worker-type", "decode") as daemon:
        run(scenario(daemon))
