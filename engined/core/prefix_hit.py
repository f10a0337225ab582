"""How much of a resident prefix counts as computed: the one place the prefix-hit rule lives.

vLLM (`KVCacheManager.get_computed_blocks`, `max_cache_hit_length = num_tokens - 1`) never
lets a hit cover the whole known sequence: the last token has to run through the model to
give the logits of the next one, and KV is computed in whole blocks, so a fully cached,
block-aligned prompt recomputes its last block (128 tokens at block size 16 report 112
cached). With EAGLE-style speculation (MTP) vLLM drops one more block from any hit, because
the draft head needs the hidden states of the tokens it starts from. Later upstream mockers
do both; dynamo-mocker 1.3.0 does neither and counts every cached prompt block.

The rule changes what counts as computed (cached tokens, tokens scheduled, the admission
gate), never which physical blocks a request takes: a recomputed block that is resident is
still reused, as upstream's deduplicating (KVBM) pool reuses it, so it is neither allocated
twice nor stored again, and the KV event stream gains no event. TRT-LLM's no-evict policy
keeps the full hit under either rule, as upstream's policy does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engined.core.args import EngineArgs, EngineType, PrefixHitRule

if TYPE_CHECKING:
    from engined.core.sequence import Sequence


class PrefillCost:
    """What a prompt would cost now: cached tokens, and the part held by active blocks.

    Only the active part shrinks the admission gate: inactive cached blocks already count as
    available, and reviving them consumes that availability. `resident_tokens` is the prefix
    physically present in G1, which can exceed the hit: lower tiers are searched after it.
    """

    __slots__ = (
        "active_cached_tokens",
        "cached_tokens",
        "new_blocks",
        "new_tokens",
        "resident_tokens",
    )

    def __init__(
        self,
        new_blocks: int,
        new_tokens: int,
        cached: int,
        active_cached: int,
        resident: int | None = None,
    ) -> None:
        self.new_blocks = new_blocks
        self.new_tokens = new_tokens
        self.cached_tokens = cached
        self.active_cached_tokens = active_cached
        self.resident_tokens = cached if resident is None else resident


class PrefixHit:
    """The prefix-hit rule of one core."""

    __slots__ = ("block_size", "drop_draft_block", "recompute_last")

    def __init__(self, block_size: int, *, recompute_last: bool, drop_draft_block: bool) -> None:
        self.block_size = block_size
        self.recompute_last = recompute_last
        self.drop_draft_block = drop_draft_block and recompute_last

    @classmethod
    def from_args(cls, args: EngineArgs) -> PrefixHit:
        vllm = args.prefix_hit_rule is PrefixHitRule.VLLM and args.engine_type is EngineType.VLLM
        return cls(
            args.block_size, recompute_last=vllm, drop_draft_block=args.aic_nextn is not None
        )

    def hit_blocks(self, resident_blocks: int, seq: Sequence) -> int:
        """How many of the `resident_blocks` leading blocks of `seq` count as computed.

        A request with nothing to generate needs no logits, so nothing is recomputed for it
        (later upstream's `requires_logits`).
        """
        if not self.recompute_last or seq.generated >= seq.max_output_tokens:
            return resident_blocks
        blocks = min(resident_blocks, (len(seq.tokens) - 1) // self.block_size)
        if self.drop_draft_block and blocks:
            blocks -= 1
        return blocks

    def cost(self, seq: Sequence, resident_blocks: int, active_blocks: int) -> PrefillCost:
        """The prefill cost of `seq` given its resident prefix (of which `active_blocks` active).

        1.3.0 looks up the prompt only; vLLM the whole known sequence, so a preempted
        request also finds the blocks it generated.
        """
        bs = self.block_size
        if not self.recompute_last:
            n_input = seq.num_input_tokens
            cached = min(resident_blocks * bs, n_input)
            active = min(active_blocks * bs, n_input)
            return PrefillCost(seq.num_blocks - resident_blocks, n_input - cached, cached, active)
        known = len(seq.tokens)
        hit = self.hit_blocks(resident_blocks, seq)
        cached = min(hit * bs, known)
        active = min(active_blocks * bs, cached)
        resident = min(resident_blocks * bs, known)
        return PrefillCost(seq.num_blocks - hit, known - cached, cached, active, resident)
