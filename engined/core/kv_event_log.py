"""The KV events of one rank, numbered and queued in the order they happen.

The KV manager and the offload tiers' G1 glue write here; every engine call returns what
was queued since the last one (`take`). Event ids come from one counter per rank, so a
subscriber sees one gap-free sequence across GPU and lower-tier events. With prefix caching
off nothing is published and ids never advance.
"""

from __future__ import annotations

from engined.core.block_moves import Promote, Use
from engined.core.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium


class KvEventLog:
    __slots__ = ("_events", "block_size", "dp_rank", "next_event_id", "publish")

    def __init__(self, block_size: int, *, dp_rank: int, publish: bool) -> None:
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.publish = publish
        self.next_event_id = 0
        self._events: list[KvEvent] = []

    def take(self) -> list[KvEvent]:
        """Every event queued since the last take, oldest first."""
        events = self._events
        self._events = []
        return events

    def take_event_id(self) -> int:
        event_id = self.next_event_id
        self.next_event_id = event_id + 1
        return event_id

    def stored_run(self, use: Use, run: list[int], parent: int | None) -> BlockStored | None:
        """Publish the blocks `run` (indices into `use`) as one GPU Stored; None when off."""
        if not self.publish:
            return None
        bs = self.block_size
        first, last = run[0], run[-1]
        tokens = use.tokens
        start = (use.first + first) * bs
        end = (use.first + last + 1) * bs
        local = use.local
        event = BlockStored(
            self.take_event_id(),
            self.dp_rank,
            parent,
            use.hashes[first : last + 1],
            local[first : last + 1] if local is not None else [0] * len(run),
            tokens[start:end].tolist() if tokens is not None else [],
            bs,
        )
        self._events.append(event)
        return event

    def stored_promoted(self, move: Promote) -> BlockStored | None:
        """Publish a partial block that filled up as one GPU Stored; None when off."""
        if not self.publish:
            return None
        event = BlockStored(
            self.take_event_id(),
            self.dp_rank,
            move.parent,
            [move.hash],
            [move.local if move.local is not None else 0],
            move.tokens if move.tokens is not None else [],
            self.block_size,
        )
        self._events.append(event)
        return event

    def stored_blocks(
        self,
        parent: int | None,
        hashes: list[int],
        local: list[int],
        token_ids: list[int],
        medium: Medium = Medium.GPU,
        extra_keys: list[tuple[str, ...] | None] | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        lookahead_token_ids: list[list[int]] | None = None,
    ) -> None:
        """Publish blocks registered in `medium` together, as one Stored (the vLLM pool's
        cached blocks, with a LoRA request's adapter and the tokens lookahead hashes cover;
        a lower tier's registration)."""
        if self.publish:
            self._events.append(
                BlockStored(
                    self.take_event_id(),
                    self.dp_rank,
                    parent,
                    hashes,
                    local,
                    token_ids,
                    self.block_size,
                    medium,
                    extra_keys,
                    lora_id,
                    lora_name,
                    lookahead_token_ids,
                )
            )

    def stored_block(
        self,
        parent_hash: int | None,
        block_hash: int,
        local_hash: int | None,
        token_ids: list[int] | None,
        medium: Medium,
    ) -> None:
        """Publish one block Stored in `medium` (a lower tier's registration)."""
        self.stored_blocks(
            parent_hash,
            [block_hash],
            [local_hash if local_hash is not None else 0],
            token_ids if token_ids is not None else [],
            medium,
        )

    def stored_one(
        self, parent: int | None, block_hash: int, local_hash: int, token_ids: list[int]
    ) -> None:
        """`stored_blocks` of one GPU block without extra keys (nor adapter): a decode step
        filling a block, once per block size tokens of every running request."""
        if self.publish:
            event_id = self.next_event_id
            self.next_event_id = event_id + 1
            self._events.append(
                BlockStored(
                    event_id,
                    self.dp_rank,
                    parent,
                    [block_hash],
                    [local_hash],
                    token_ids,
                    self.block_size,
                )
            )

    def removed_each(self, hashes: list[int]) -> None:
        """One GPU Removed per hash, in order, as vLLM's pool publishes evictions."""
        if self.publish:
            events = self._events
            dp_rank = self.dp_rank
            event_id = self.next_event_id
            for block_hash in hashes:
                events.append(BlockRemoved(event_id, dp_rank, [block_hash]))
                event_id += 1
            self.next_event_id = event_id

    def removed_one(self, block_hash: int) -> None:
        """`removed_each([block_hash])`: the block a decode step's allocation evicts."""
        if self.publish:
            self._events.append(BlockRemoved(self.take_event_id(), self.dp_rank, [block_hash]))

    def removed(self, hashes: list[int], medium: Medium = Medium.GPU) -> None:
        """Publish blocks evicted from `medium` (nothing for an empty list)."""
        if hashes and self.publish:
            self._events.append(BlockRemoved(self.take_event_id(), self.dp_rank, hashes, medium))

    def cleared(self) -> None:
        if self.publish:
            self._events.append(AllBlocksCleared(self.take_event_id(), self.dp_rank))
