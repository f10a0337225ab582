"""The pass loop wakes an idle core at its tier-transfer deadline and publishes what landed.

With G3, every block a G1->G2 offload lands in G2 is copied on to G3 in the background. Here
that copy is still in flight when the last request finishes: the core is empty, no command
will come, and only the loop's deadline wake-up can land it and publish its STORAGE Stored.

Paced runs use a virtual clock (tests/server/virtual_clock.py): the hop is exactly 1 ms of
the loop's clock however loaded the machine is, so it is asserted exactly in both modes.
The hop is modelled time: at speedup 4 it is still 1 ms for the core and a quarter of that
on the loop's clock (one time base, engined/model_clock.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engined.core.args import EngineArgs, PerfModelKind
from engined.core.engine import Engine
from engined.core.types import (
    BlockStored,
    Decodes,
    KvEvent,
    LifecycleEvent,
    Medium,
    Request,
    RequestOutput,
    Submit,
)
from engined.model_clock import ModelClock
from engined.server.ranks import pacer as pacer_module
from engined.server.ranks.engine_loop import EngineLoop
from tests.reference_indexer import ReferenceIndexer
from tests.server.virtual_clock import VirtualClock
from tests.support import until

BLOCK_SIZE = 4


class Capture:
    """Sinks of an EngineLoop without sockets, recording KV events and finished requests."""

    def __init__(self) -> None:
        self.kv_events: list[KvEvent] = []
        # The core's (modelled) clock when each event was published, and the loop's.
        self.published_at_ms: list[float] = []
        self.published_at_s: list[float] = []
        self.clock: VirtualClock | None = None
        self.finished: set[str] = set()
        self.loop: EngineLoop | None = None

    def publish(self, events: Any, ts: float = 0.0) -> None:
        if isinstance(events, list):
            assert self.loop is not None
            self.kv_events.extend(events)
            self.published_at_ms.extend(self.loop.now_ms() for _ in events)
            if self.clock is not None:
                self.published_at_s.extend(self.clock() for _ in events)

    overflows = 0  # a KV sink's count of batches it could not publish

    def maybe_heartbeat(self, now: float) -> None:
        pass

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        self.finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        pass

    def stored(self, medium: Medium) -> list[BlockStored]:
        return [e for e in self.kv_events if isinstance(e, BlockStored) and e.medium is medium]

    def stored_at_ms(self, medium: Medium) -> float:
        (at,) = [
            t
            for e, t in zip(self.kv_events, self.published_at_ms, strict=True)
            if isinstance(e, BlockStored) and e.medium is medium
        ]
        return at

    def stored_at_s(self, medium: Medium) -> float:
        (at,) = [
            t
            for e, t in zip(self.kv_events, self.published_at_s, strict=True)
            if isinstance(e, BlockStored) and e.medium is medium
        ]
        return at


def offload_core(speedup_ratio: float, decode_ms: float = 0.0) -> Engine:
    """2 G1 blocks, 1 MB blocks, 1 GB/s links: each block hop takes 1 ms; passes take none
    but `decode_ms` for a decode."""
    return Engine(
        EngineArgs(
            perf_model=PerfModelKind.FIXED,
            fixed_prefill_ms_per_token=0.0,
            fixed_pass_overhead_ms=0.0,
            fixed_decode_ms_per_pass=decode_ms,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=2,
            max_num_seqs=2,
            max_num_batched_tokens=64,
            enable_prefix_caching=True,
            speedup_ratio=speedup_ratio,
            num_g2_blocks=4,
            num_g3_blocks=4,
            kv_bytes_per_token=250_000,
            bandwidth_g1_to_g2_gbps=1.0,
            bandwidth_g2_to_g3_gbps=1.0,
        )
    )


class VirtualPacer:
    """The loop's pacer on the virtual clock, recording every deadline it slept to."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.deadlines: list[float] = []

    async def sleep_until(self, deadline: float) -> None:
        self.deadlines.append(deadline)
        await self.clock.sleep(deadline - self.clock())

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("speedup_ratio", "paced_by", "decode_ms"),
    [(0.0, "sleep", 0.0), (1.0, "sleep", 0.0), (1.0, "pacer", 0.1), (4.0, "sleep", 0.0)],
)
def test_idle_core_wakes_at_the_offload_deadline(
    speedup_ratio: float, paced_by: str, decode_ms: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `paced_by` "pacer" no `sleep` is given, so the loop paces on its pacer (here one
    on the virtual clock); a 0.1 ms decode ends B's last pass before the G3 copy lands, so
    the core waits idle for that deadline, on the pacer too: asyncio's timer (1 ms late on
    a real clock) would never see the virtual clock move, and the copy would never land."""
    clock = VirtualClock()
    pacer = VirtualPacer(clock)
    monkeypatch.setattr(pacer_module, "open_pacer", lambda _clock: pacer)

    async def scenario() -> None:
        core = offload_core(speedup_ratio, decode_ms)
        capture = Capture()
        capture.clock = clock
        loop = EngineLoop(
            core,
            kv=capture,
            fpm=capture,
            delivery=capture,
            model_clock=ModelClock(speedup_ratio),
            clock=clock,
            sleep=clock.sleep if paced_by == "sleep" else None,
        )
        capture.loop = loop
        runner = asyncio.create_task(loop.run())
        # A's block is cached; B's first token needs A's slot: A goes G1 -> G2 -> G3.
        await loop.call(Submit(Request(token_ids=[1, 2, 3, 4], max_tokens=1, request_id="a")))
        await until(lambda: "a" in capture.finished, timeout=10.0, poll_s=0)
        await loop.call(Submit(Request(token_ids=[5, 6, 7, 8], max_tokens=1, request_id="b")))
        await until(lambda: "b" in capture.finished, timeout=10.0, poll_s=0)
        await until(lambda: capture.stored(Medium.STORAGE), timeout=10.0, poll_s=0)
        assert core.is_empty()
        assert core.next_deadline() is None
        # The G2 -> G3 copy starts at the tick that lands the block in G2 (published by the
        # pass after it) and takes 1 ms; only the deadline wake-up can publish its landing.
        hop_ms = capture.stored_at_ms(Medium.STORAGE) - capture.stored_at_ms(Medium.CPU)
        assert hop_ms == pytest.approx(1.0)
        if speedup_ratio > 0:
            hop_s = capture.stored_at_s(Medium.STORAGE) - capture.stored_at_s(Medium.CPU)
            assert hop_s == pytest.approx(0.001 / speedup_ratio)
        indexer = ReferenceIndexer(BLOCK_SIZE, lower_tier_edges=True)
        indexer.apply(capture.kv_events)
        indexer.assert_clean()
        assert indexer.tier_overlap([1, 2, 3, 4], Medium.CPU) == 1
        assert indexer.tier_overlap([1, 2, 3, 4], Medium.STORAGE) == 1
        if paced_by == "pacer":
            landed_s = capture.stored_at_s(Medium.STORAGE)
            assert any(d == pytest.approx(landed_s) for d in pacer.deadlines)
        loop.stop()
        await runner

    asyncio.run(asyncio.wait_for(scenario(), 30))
