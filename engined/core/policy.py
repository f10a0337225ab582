"""Where vLLM and TRT-LLM differ: admission of waiting requests, and whether to preempt.

vLLM admits the FIFO head only if its whole known sequence fits next to the blocks already
held (the full-prompt gate), discounting only the part of its prefix held by *active*
blocks. TRT-LLM's GUARANTEED_NO_EVICT admits only what can run to completion next to every
running request's remaining need, and never preempts.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

from engined.core.kv_manager import KvManager
from engined.core.prefix_hit import PrefillCost
from engined.core.sequence import Sequence


def context_length(num_blocks: int, block_size: int, max_model_len: int | None) -> int:
    """The longest prompt + output a request may have: `max_model_len`, capped by the pool.

    vLLM never serves a sequence longer than its KV pool (it refuses to start with a
    max_model_len the pool cannot hold), so the pool's capacity caps max_model_len. Without
    this, a request outgrowing the pool alone would preempt itself forever.
    """
    capacity = num_blocks * block_size
    return min(max_model_len, capacity) if max_model_len else capacity


class Decision(enum.Enum):
    ADMIT = "admit"
    WAIT = "wait"
    REJECT = "reject"


class Verdict(NamedTuple):
    """The admission decision for the queue head, and its prefill cost when admitted."""

    decision: Decision
    cost: PrefillCost | None


_REJECT = Verdict(Decision.REJECT, None)
_WAIT = Verdict(Decision.WAIT, None)


class AdmissionPolicy:
    __slots__ = ("block_size", "max_model_len", "max_prompt_tokens", "num_blocks")

    allows_preemption = True
    supports_destination_reservation = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_prompt_tokens: int | None,
        max_model_len: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = context_length(num_blocks, block_size, max_model_len)
        # Without chunked prefill a prompt must fit one pass's budget. Upstream would keep such
        # a request waiting forever (and block the queue behind it); vLLM refuses it up front.
        self.max_prompt_tokens = max_prompt_tokens

    def rejects(self, seq: Sequence, blocks_needed: int) -> bool:
        """A fresh request that could never run here."""
        if seq.num_input_tokens >= self.max_model_len and seq.max_output_tokens > 0:
            return True
        return blocks_needed > self.num_blocks or (
            self.max_prompt_tokens is not None and seq.num_input_tokens > self.max_prompt_tokens
        )

    def decide(
        self, seq: Sequence, is_fresh: bool, kv: KvManager, running: Iterable[Sequence]
    ) -> Verdict:
        if is_fresh and self.rejects(seq, seq.current_known_blocks()):
            return _REJECT
        cost = kv.prefill_cost(seq)
        available = self.num_blocks - kv.num_active_blocks()
        needed = seq.current_known_blocks() - cost.active_cached_tokens // self.block_size
        return _WAIT if needed > available else Verdict(Decision.ADMIT, cost)

    def clamp_max_output(self, prompt_len: int, max_output: int) -> int:
        """Generation stops at max_model_len, as in vLLM (finish reason "length")."""
        cap = self.max_model_len
        return min(max_output, cap - prompt_len) if prompt_len < cap else max_output


class TrtllmNoEvictPolicy(AdmissionPolicy):
    __slots__ = ()

    allows_preemption = False
    supports_destination_reservation = False

    def decide(
        self, seq: Sequence, is_fresh: bool, kv: KvManager, running: Iterable[Sequence]
    ) -> Verdict:
        if is_fresh and self.rejects(seq, seq.to_completion_blocks()):
            return _REJECT
        cost = kv.prefill_cost(seq)
        needed = self._blocks_to_finish(seq, cost)
        reserved = sum(
            self._blocks_to_finish(r, kv.prefill_cost(r) if r.num_allocated_tokens == 0 else None)
            for r in running
        )
        available = self.num_blocks - kv.num_active_blocks() - reserved
        return _WAIT if needed > available else Verdict(Decision.ADMIT, cost)

    def _blocks_to_finish(self, seq: Sequence, cost: PrefillCost | None) -> int:
        bs = self.block_size
        if seq.num_allocated_tokens == 0:
            held = cost.active_cached_tokens // bs if cost is not None else 0
        else:
            held = -(-seq.num_allocated_tokens // bs)
        return seq.to_completion_blocks() - held
