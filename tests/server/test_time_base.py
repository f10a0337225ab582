"""One time base: the core's times are modelled at every speedup; the loop's `ModelClock`
alone maps them to the wall (engined/model_clock.py, engined/server/ranks/engine_loop.py).

The same requests on the same fixed perf model, run unpaced and paced at speedup 4 on a
virtual clock (tests/server/virtual_clock.py): the modelled pass times are identical, every
pass ends a quarter of its modelled time later on the loop's clock, and each forward-pass
metric reports that wall time, as it did before the core stopped dividing by the ratio.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engined.core.args import EngineArgs, PerfModelKind
from engined.core.engine import Engine
from engined.core.pass_report import PassReport
from engined.core.types import Decodes, FpmSnapshot, Request, RequestOutput, Submit
from engined.model_clock import ModelClock
from engined.server.ranks.engine_loop import EngineLoop
from tests.server.virtual_clock import VirtualClock
from tests.support import until


class Recorder:
    """The loop's sinks and pass observer: what the wire and the metrics would see."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.passes: list[tuple[float, float]] = []  # modelled (start_ms, end_ms)
        self.wall_times: list[float] = []  # each FPM's wall_time_secs
        self.delivered_at_s: list[float] = []  # the loop's clock at each pass's outputs
        self.finished: set[str] = set()
        self.overflows = 0

    def on_pass(self, rank: int, start_ms: float, report: PassReport) -> None:
        self.passes.append((start_ms, report.end_ms))

    def publish(self, item: Any, ts: float = 0.0) -> None:
        if isinstance(item, FpmSnapshot):
            self.wall_times.append(item.wall_time_secs)

    def maybe_heartbeat(self, now: float) -> None:
        pass

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        self.delivered_at_s.append(self.clock())
        self.finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    def deliver_lifecycle(self, rank: int, events: list[Any]) -> None:
        pass


def run(speedup_ratio: float) -> Recorder:
    clock = VirtualClock()
    recorder = Recorder(clock)

    async def scenario() -> None:
        core = Engine(
            EngineArgs(
                perf_model=PerfModelKind.FIXED,
                fixed_prefill_ms_per_token=0.5,
                fixed_pass_overhead_ms=8.0,
                fixed_decode_ms_per_pass=4.0,
                block_size=4,
                num_gpu_blocks=32,
                speedup_ratio=speedup_ratio,
            ).normalized()
        )
        loop = EngineLoop(
            core,
            kv=recorder,
            fpm=recorder,
            delivery=recorder,
            model_clock=ModelClock(speedup_ratio),
            clock=clock,
            sleep=clock.sleep,
        )
        loop.pass_observers.append(recorder.on_pass)
        runner = asyncio.create_task(loop.run())
        await loop.call(Submit(Request(token_ids=[1, 2, 3, 4], max_tokens=3, request_id="a")))
        await until(lambda: "a" in recorder.finished, timeout=10.0, poll_s=0)
        loop.stop()
        await runner

    asyncio.run(asyncio.wait_for(scenario(), 30))
    return recorder


def test_modelled_pass_times_do_not_depend_on_the_speedup() -> None:
    unpaced, paced = run(0.0), run(4.0)
    # 4 prompt tokens at 0.5 ms + 8 ms overhead, then two 4 ms decodes (the first token
    # comes with the prefill pass).
    durations = [end - start for start, end in unpaced.passes]
    assert durations == [14.0, 4.0, 4.0]
    assert [end - start for start, end in paced.passes] == durations
    assert unpaced.wall_times == [0.014, 0.004, 0.004]


def test_paced_passes_end_and_report_at_the_wall_time_of_their_modelled_time() -> None:
    paced = run(4.0)
    assert paced.wall_times == [0.0035, 0.001, 0.001]
    ends_s = [end / 1000.0 / 4.0 for _, end in paced.passes]
    assert paced.delivered_at_s == pytest.approx(ends_s, abs=1e-12)
    assert paced.delivered_at_s[-1] == pytest.approx(0.0055, abs=1e-12)
