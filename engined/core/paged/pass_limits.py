"""vLLM 0.33's scheduling options that bound a pass: what one request takes of it, and
whether it may prefill at all.

`long_prefill_token_threshold` caps the tokens a running or admitted request computes in a
pass while other requests run or wait (a long prefill then cannot starve them), floored,
with `long_prefill_token_threshold_adaptive`, at a fair share of the budget. `watermark`
is the fraction of the pool an admission must leave free while requests run, headroom that
spares the running ones preemption. `prefill_schedule_interval` spaces prefill out
(`PrefillCadence`). All are vLLM's `SchedulerConfig`; the mocker has none of them, so
`check_vllm_only` refuses them there.
"""

from __future__ import annotations

from engined.core.args import EngineArgs
from engined.core.state import RequestState


class PassLimits:
    __slots__ = ("adaptive", "budget", "threshold", "watermark_blocks")

    def __init__(self, args: EngineArgs, budget: int) -> None:
        """`budget`: the pass's token budget (`max_num_batched_tokens`, or unbounded)."""
        self.threshold = args.long_prefill_token_threshold
        self.adaptive = args.long_prefill_token_threshold_adaptive
        self.budget = budget
        # vLLM counts the pool's blocks, its null block included.
        self.watermark_blocks = int(args.watermark * args.num_gpu_blocks)

    def long_prefill_cap(self, num_running: int, num_waiting: int) -> int:
        """A pass's cap on one request's new tokens (0: none): none while a single request
        runs or waits, as it starves nobody."""
        eligible = num_running + num_waiting
        if not self.threshold or eligible <= 1:
            return 0
        if self.adaptive:
            return max(self.threshold, self.budget // eligible)
        return self.threshold

    def admission_watermark(self, num_running: int) -> int:
        """The free blocks an admission must leave: the watermark once a request runs."""
        return self.watermark_blocks if num_running else 0


class PrefillCadence:
    """vLLM's `prefill_schedule_interval` (its local cadence, for an engine no DP coordinator
    drives): while a running request decodes, a pass carries prefill, a new admission's or a
    running request's next chunk, only once `interval` executed passes have gone by since
    the last one that did, so decodes run in longer stretches. A pass that admitted without
    holding and still left requests waiting lets go of the cadence until one drains them.
    """

    __slots__ = ("capacity_bound", "executed", "interval", "last_prefill")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.executed = 0
        # A whole interval back: the first pass is never held.
        self.last_prefill = -interval
        self.capacity_bound = False

    def holds(self, running: list[RequestState]) -> bool:
        """Whether the pass about to be scheduled holds prefill back."""
        return (
            not self.capacity_bound
            and self.executed + 1 - self.last_prefill < self.interval
            and any(not req.is_prefill_chunk for req in running)
        )

    def admitted(self, num_waiting: int) -> None:
        """After the admissions of a pass that did not hold: were any left waiting that its
        scan did not pass over (`SchedulerState.deferred`, vLLM's `deferred_waiting`)?"""
        self.capacity_bound = num_waiting > 0

    def passed(self, scheduled_any: bool, prefilled: bool) -> None:
        """A pass was scheduled: it counts if it scheduled tokens, and restarts the interval
        if it carried prefill."""
        if scheduled_any:
            self.executed += 1
        if prefilled:
            self.last_prefill = self.executed
