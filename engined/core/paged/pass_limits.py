"""vLLM 0.33's scheduling options that bound what one request takes of a pass.

`long_prefill_token_threshold` caps the tokens a running or admitted request computes in a
pass while other requests run or wait (a long prefill then cannot starve them), floored,
with `long_prefill_token_threshold_adaptive`, at a fair share of the budget. `watermark`
is the fraction of the pool an admission must leave free while requests run, headroom that
spares the running ones preemption. Both are vLLM's `SchedulerConfig`; the mocker has
neither, so `check_vllm_only` refuses them there.
"""

from __future__ import annotations

from engined.core.args import EngineArgs


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
