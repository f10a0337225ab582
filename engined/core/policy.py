"""Where vLLM and TRT-LLM differ: admission of waiting requests, and whether to preempt.

vLLM admits the FIFO head only if its whole known sequence fits next to the blocks already
held (the full-prompt gate), discounting only the part of its prefix held by *active*
blocks. TRT-LLM's GUARANTEED_NO_EVICT admits only what can run to completion next to every
running request's remaining need, and never preempts.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from engined.core.kv_manager import KvManager, PrefillCost
from engined.core.sequence import Sequence


class Decision(enum.Enum):
    ADMIT = "admit"
    WAIT = "wait"
    REJECT = "reject"


class AdmissionPolicy:
    __slots__ = ("block_size", "num_blocks")

    allows_preemption = True
    supports_destination_reservation = True

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size

    def decide(
        self, seq: Sequence, is_fresh: bool, kv: KvManager, running: Iterable[Sequence]
    ) -> tuple[Decision, PrefillCost | None]:
        if is_fresh and seq.current_known_blocks() > self.num_blocks:
            return Decision.REJECT, None
        cost = kv.prefill_cost(seq)
        available = self.num_blocks - kv.num_active_blocks()
        needed = seq.current_known_blocks() - cost.active_cached_tokens // self.block_size
        return (Decision.WAIT, None) if needed > available else (Decision.ADMIT, cost)

    def clamp_max_output(self, prompt_len: int, max_output: int) -> int:
        return max_output


class TrtllmNoEvictPolicy(AdmissionPolicy):
    __slots__ = ()

    allows_preemption = False
    supports_destination_reservation = False

    def decide(
        self, seq: Sequence, is_fresh: bool, kv: KvManager, running: Iterable[Sequence]
    ) -> tuple[Decision, PrefillCost | None]:
        if is_fresh and seq.to_completion_blocks() > self.num_blocks:
            return Decision.REJECT, None
        cost = kv.prefill_cost(seq)
        needed = self._blocks_to_finish(seq, cost)
        reserved = sum(
            self._blocks_to_finish(r, kv.prefill_cost(r) if r.num_allocated_tokens == 0 else None)
            for r in running
        )
        available = self.num_blocks - kv.num_active_blocks() - reserved
        return (Decision.WAIT, None) if needed > available else (Decision.ADMIT, cost)

    def _blocks_to_finish(self, seq: Sequence, cost: PrefillCost | None) -> int:
        bs = self.block_size
        if seq.num_allocated_tokens == 0:
            held = cost.active_cached_tokens // bs if cost is not None else 0
        else:
            held = -(-seq.num_allocated_tokens // bs)
        return seq.to_completion_blocks() - held

    def clamp_max_output(self, prompt_len: int, max_output: int) -> int:
        """Enqueue clamps the output to what the pool could ever hold next to the prompt."""
        cap = self.num_blocks * self.block_size
        return min(max_output, cap - prompt_len) if prompt_len < cap else max_output
