"""An independent KV indexer that validates every KV event stream the engine produces.

A Python stand-in for the router's `LocalKvIndexer` as upstream's `RouterIndexerHarness`
(`scheduler/test_utils.rs`, docs/upstream/dynamo-mocker.md §8) drives it: a stream is good when a
router could apply it without a single error or duplicate-store warning. On top of the router's
checks it recomputes every hash from the event's own tokens (xxh3-64, seed 1337,
docs/upstream/dynamo-mocker.md §3.1), so a wrong hash cannot hide behind a consistent-looking tree.

It deliberately shares no code with `engined`: it imports only the event types, and computes
hashes itself. A bug in the engine's hashing or bookkeeping therefore cannot cancel out here.

Problems are collected as `Violation`s instead of raised, so one test can report every broken
event of a long stream at once (`assert_clean`).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from engined.core.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium

HASH_SEED = 1337

ViolationKind = Literal[
    "parent_block_not_found",
    "invalid_block",
    "duplicate_store",
    "block_not_found",
    "bad_shape",
    "local_hash_mismatch",
    "chain_mismatch",
    "event_id_gap",
]
EventKind = Literal["stored", "removed", "cleared"]

# Kinds that make the router reject an event; everything else is a warning or an extra check,
# and the event is still applied.
REJECTING_KINDS: frozenset[ViolationKind] = frozenset(
    {"parent_block_not_found", "invalid_block", "block_not_found", "bad_shape"}
)

_Key = tuple[int, int, Medium]


@dataclass(frozen=True, slots=True)
class Violation:
    kind: ViolationKind
    event: KvEvent
    detail: str
    worker_id: int = 0

    def __str__(self) -> str:
        return f"{self.kind} (worker {self.worker_id}, event {self.event.event_id}): {self.detail}"


# --- hashing (docs/upstream/dynamo-mocker.md §3.1) -----------------------------------------


def local_block_hash(token_ids: Sequence[int]) -> int:
    """Content hash of one block: xxh3-64 of the tokens as little-endian u32, seed 1337.

    Raises struct.error for token ids outside u32, which no real block can hold.
    """
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(token_ids)}I", *token_ids), seed=HASH_SEED)


def next_sequence_hash(parent: int, local: int) -> int:
    """Chained identity of a block: xxh3-64 of `le_u64(parent) || le_u64(local)`, seed 1337."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=HASH_SEED)


# vLLM 0.33's default block hash (sha256 over the pickled `(parent, tokens, extra_keys)`),
# chained from NONE_HASH, with the low 64 bits as the event's int; written here from vLLM's
# rules, independently of engined/core/vllm_hashing.py.
VLLM_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def vllm_block_hash(
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> bytes:
    key = (parent or VLLM_NONE_HASH, tuple(token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=5)).digest()


def vllm_event_hash(full: bytes) -> int:
    return int.from_bytes(full, "big") & ((1 << 64) - 1)


def vllm_sequence_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """vLLM's event hashes of every full block of `token_ids`."""
    out: list[int] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        parent = vllm_block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(vllm_event_hash(parent))
    return out


def sequence_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Sequence hashes of the full blocks of a prompt, the router's block identities."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        local = local_block_hash(token_ids[start : start + block_size])
        parent = local if parent is None else next_sequence_hash(parent, local)
        hashes.append(parent)
    return hashes


# --- stream helpers (upstream test_utils.rs) ------------------------------------------------


def stored_hashes(events: Iterable[KvEvent]) -> list[int]:
    """Local (content) hashes of every stored block, in stream order."""
    return [h for e in events if isinstance(e, BlockStored) for h in e.local_hashes]


def nth_stored_hashes(events: Iterable[KvEvent], n: int) -> list[int]:
    """Local hashes of the `n`-th (0-based) Stored event."""
    stored = [e for e in events if isinstance(e, BlockStored)]
    return list(stored[n].local_hashes)


def removed_event_count(events: Iterable[KvEvent]) -> int:
    return sum(1 for e in events if isinstance(e, BlockRemoved))


# --- the indexer ----------------------------------------------------------------------------


class ReferenceIndexer:
    """Per `(worker_id, dp_rank, medium)`, a prefix tree of stored blocks.

    Each tree is a map from sequence hash to its parent's sequence hash (None at the root):
    parent links are all the router needs to accept or reject a Stored, and a block's
    sequence hash already names its whole prefix, so no child lists are kept. Removing a block
    leaves its children indexed (simpler than the router's stale-edge rule, and the engine's
    leaf-first eviction never relies on the difference).
    """

    def __init__(
        self,
        block_size: int,
        *,
        check_local_hashes: bool = True,
        check_chain: bool = True,
        lower_tier_edges: bool = False,
        vllm: bool = False,
        lora_paths: Mapping[int, str] | None = None,
    ) -> None:
        """`lower_tier_edges`: index the CPU and STORAGE media as Dynamo's `LowerTierIndexer`
        does, as continuation edges `(parent, local hash) -> block` that need no indexed
        parent. Engines offload whatever their GPU pool evicts, leaves first, so a host-tier
        block routinely arrives before (or without) its parent; routers walk the lower tiers
        from the end of the device-tier match (`tier_overlap`). Every other check (shape,
        hashes, duplicates, removal of unknown blocks) applies to those media unchanged.

        `lora_paths`: with `vllm`, the path of each LoRA adapter by id: a LoRA block's hash
        keys the adapter's name and path, and its event carries the id and the name only.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.check_local_hashes = check_local_hashes
        self.check_chain = check_chain
        self.lower_tier_edges = lower_tier_edges
        self.violations: list[Violation] = []
        self._trees: dict[_Key, dict[int, int | None]] = {}
        self.vllm = vllm
        self.lora_paths = dict(lora_paths or {})
        # vLLM's full (32-byte) hash of every block a checked Stored named, by event hash: the
        # chain of a later block starts from its parent's.
        self._vllm_full: dict[int, bytes] = {}
        # Under vLLM's lookahead hashes (MTP): each event hash's content, the full and event
        # hash of the same tokens without lookahead, which is what a query by tokens finds.
        self._content_full: dict[int, bytes] = {}
        self._content: dict[int, int] = {}
        # Extra copies of an indexed block, per tree (only with `vllm`).
        self._copies: dict[_Key, Counter[int]] = {}
        # Dynamo's router keeps no copy count: the first Removed of a block with copies left
        # drops it from the router, which the engine still caches (`router_gone`), and the
        # last one is a removal of a block the router no longer has (`router_misses`).
        self._router_gone: dict[_Key, set[int]] = {}
        self.router_misses = 0
        self._last_event_id: dict[tuple[int, int], int] = {}
        self._ok: Counter[EventKind] = Counter()

    # --- applying ---------------------------------------------------------------------------

    def apply(self, events: Iterable[KvEvent], worker_id: int = 0) -> None:
        """Apply events in order, as the router would, recording every problem found."""
        for event in events:
            self._check_event_id(event, worker_id)
            if isinstance(event, BlockStored):
                if self._apply_stored(event, worker_id):
                    self._ok["stored"] += 1
            elif isinstance(event, BlockRemoved):
                if self._apply_removed(event, worker_id):
                    self._ok["removed"] += 1
            elif isinstance(event, AllBlocksCleared):
                for key in [k for k in self._trees if k[0] == worker_id and k[1] == event.dp_rank]:
                    del self._trees[key]
                    self._copies.pop(key, None)
                    self._router_gone.pop(key, None)
                self._ok["cleared"] += 1
            else:
                raise TypeError(f"not a KV event: {event!r}")

    def _violate(self, kind: ViolationKind, event: KvEvent, worker_id: int, detail: str) -> None:
        self.violations.append(Violation(kind, event, detail, worker_id))

    def _check_event_id(self, event: KvEvent, worker_id: int) -> None:
        rank = (worker_id, event.dp_rank)
        last = self._last_event_id.get(rank)
        if last is not None and event.event_id != last + 1:
            self._violate(
                "event_id_gap",
                event,
                worker_id,
                f"dp_rank {event.dp_rank}: event id {event.event_id} follows {last}",
            )
        self._last_event_id[rank] = event.event_id

    def _apply_stored(self, event: BlockStored, worker_id: int) -> bool:
        """Apply one Stored; False when the router would reject it (nothing is stored then)."""
        bs = self.block_size
        n = len(event.block_hashes)
        where = f"dp_rank {event.dp_rank} {event.medium}"
        if event.block_size != bs or n == 0:
            self._violate(
                "bad_shape",
                event,
                worker_id,
                f"{where}: block_size {event.block_size} (indexer {bs}), {n} blocks",
            )
            return False
        if len(event.token_ids) != n * bs or len(event.local_hashes) != n:
            self._violate(
                "bad_shape",
                event,
                worker_id,
                f"{where}: {n} blocks with {len(event.local_hashes)} local hashes and "
                f"{len(event.token_ids)} token ids (want {n * bs})",
            )
            return False
        parent = event.parent_hash
        if parent is not None and parent in event.block_hashes:
            self._violate(
                "invalid_block", event, worker_id, f"{where}: parent {parent} is one of its blocks"
            )
            return False
        tree = self._trees.setdefault((worker_id, event.dp_rank, event.medium), {})
        rooted = not (self.lower_tier_edges and event.medium is not Medium.GPU)
        if rooted and parent is not None and parent not in tree:
            self._violate(
                "parent_block_not_found", event, worker_id, f"{where}: parent {parent} not indexed"
            )
            return False

        if self.check_local_hashes:
            try:
                expected_locals = [
                    local_block_hash(event.token_ids[i * bs : (i + 1) * bs]) for i in range(n)
                ]
            except struct.error:
                self._violate("bad_shape", event, worker_id, f"{where}: token id outside u32")
                return False
            bad = [i for i in range(n) if event.local_hashes[i] != expected_locals[i]]
            if bad:
                i = bad[0]
                self._violate(
                    "local_hash_mismatch",
                    event,
                    worker_id,
                    f"{where}: block {i} local hash {event.local_hashes[i]}, "
                    f"tokens hash to {expected_locals[i]} ({len(bad)} of {n} blocks differ)",
                )
        if self.check_chain:
            self._check_chain(event, worker_id, where)

        duplicates = [h for h in event.block_hashes if h in tree]
        if duplicates and self.vllm:
            extra = self._copies.setdefault((worker_id, event.dp_rank, event.medium), Counter())
            prev_hash = parent
            for h in event.block_hashes:
                if h in tree and tree[h] == prev_hash:
                    extra[h] += 1
                    duplicates.remove(h)
                prev_hash = h
        if duplicates:
            self._violate(
                "duplicate_store",
                event,
                worker_id,
                f"{where}: already indexed: {duplicates}",
            )
        prev = parent
        gone = self._router_gone.get((worker_id, event.dp_rank, event.medium))
        for h in event.block_hashes:
            if h not in tree:
                tree[h] = prev
            if gone:
                gone.discard(h)
            prev = h
        return True

    def hashes_of(self, token_ids: Sequence[int]) -> list[int]:
        """The event hashes of a prompt's full blocks, in this stream's hash family."""
        if self.vllm:
            return vllm_sequence_hashes(token_ids, self.block_size)
        return sequence_hashes(token_ids, self.block_size)

    def _check_chain(self, event: BlockStored, worker_id: int, where: str) -> None:
        if self.vllm:
            self._check_vllm_chain(event, worker_id, where)
            return
        prev = event.parent_hash
        for i, (block_hash, local) in enumerate(
            zip(event.block_hashes, event.local_hashes, strict=True)
        ):
            expected = local if prev is None else next_sequence_hash(prev, local)
            if block_hash != expected:
                self._violate(
                    "chain_mismatch",
                    event,
                    worker_id,
                    f"{where}: block {i} hash {block_hash}, chain gives {expected} "
                    f"(parent {prev}, local {local})",
                )
                return
            prev = block_hash

    def _check_vllm_chain(self, event: BlockStored, worker_id: int, where: str) -> None:
        """Each block's event hash is vLLM's hash of its tokens chained to its parent's."""
        bs = self.block_size
        parent: bytes | None = None
        if event.parent_hash is not None:
            known = self._vllm_full.get(event.parent_hash)
            if known is None:
                self._violate(
                    "chain_mismatch",
                    event,
                    worker_id,
                    f"{where}: parent {event.parent_hash} was never stored with its tokens",
                )
                return
            parent = known
        lookahead = event.lookahead_token_ids is not None
        content_parent = (
            self._content_full.get(event.parent_hash, parent)
            if event.parent_hash is not None
            else None
        )
        for i, block_hash in enumerate(event.block_hashes):
            keys = self._vllm_extra_keys(event, i)
            tokens = event.token_ids[i * bs : (i + 1) * bs]
            full = vllm_block_hash(parent, tokens, keys)
            if lookahead:
                own = keys[0] if keys is not None else None
                assert own is None or isinstance(own, tuple)
                content_parent = vllm_block_hash(content_parent, tokens, own)
                self._content_full[block_hash] = content_parent
                self._content[block_hash] = vllm_event_hash(content_parent)
            if vllm_event_hash(full) != block_hash:
                self._violate(
                    "chain_mismatch",
                    event,
                    worker_id,
                    f"{where}: block {i} hash {block_hash}, vLLM's chain gives "
                    f"{vllm_event_hash(full)}",
                )
                return
            self._vllm_full[block_hash] = full
            parent = full

    def _vllm_extra_keys(self, event: BlockStored, i: int) -> tuple[object, ...] | None:
        """Block `i`'s extra keys in vLLM's hash, tagged again from the event's untagged ones:
        the adapter's name first, then a salt, which only the first block of a chain has;
        under lookahead hashes (MTP), those keys and the tokens after the block."""
        published = list(event.extra_keys[i] or ()) if event.extra_keys else []
        keys: list[tuple[str, ...]] = []
        name = event.lora_name
        if name is not None and event.lora_id is not None and published[:1] == [name]:
            keys.append(("lora", name, self.lora_paths.get(event.lora_id, "")))
            published = published[1:]
        if published and i == 0 and event.parent_hash is None:
            keys.append(("cache_salt", published[0]))
        if event.lookahead_token_ids is not None:
            return (tuple(keys) or None, *event.lookahead_token_ids[i])
        return tuple(keys) or None

    def _apply_removed(self, event: BlockRemoved, worker_id: int) -> bool:
        """Apply one Removed; False when some hash was not indexed (the others are removed)."""
        where = f"dp_rank {event.dp_rank} {event.medium}"
        if not event.block_hashes:
            self._violate("bad_shape", event, worker_id, f"{where}: Removed with no blocks")
            return False
        key = (worker_id, event.dp_rank, event.medium)
        tree = self._trees.get(key, {})
        extra = self._copies.get(key, Counter())
        gone = self._router_gone.setdefault(key, set())
        missing: list[int] = []
        for h in event.block_hashes:
            if extra[h] > 0:
                extra[h] -= 1
                if h in gone:
                    self.router_misses += 1
                else:
                    gone.add(h)
            elif h in tree:
                del tree[h]
                if h in gone:
                    gone.discard(h)
                    self.router_misses += 1
            else:
                missing.append(h)
        if missing:
            self._violate("block_not_found", event, worker_id, f"{where}: not indexed: {missing}")
            return False
        return True

    # --- queries ----------------------------------------------------------------------------

    def assert_clean(self) -> None:
        """Fail with every recorded violation (the harness's no-errors and no-warnings checks)."""
        if self.violations:
            shown = "\n".join(f"  {v}" for v in self.violations[:50])
            more = len(self.violations) - 50
            tail = f"\n  ... and {more} more" if more > 0 else ""
            raise AssertionError(f"{len(self.violations)} KV event violations:\n{shown}{tail}")

    def kinds(self) -> list[ViolationKind]:
        """Violation kinds in the order they were recorded, for compact assertions."""
        return [v.kind for v in self.violations]

    def ok_count(self, kind: EventKind) -> int:
        """Events of `kind` applied without a rejecting violation (router status "ok").

        Warnings and the extra hash and event-id checks do not make an event fail.
        """
        return self._ok[kind]

    def num_blocks(self, worker_id: int = 0, dp_rank: int = 0, medium: Medium = Medium.GPU) -> int:
        return len(self._trees.get((worker_id, dp_rank, medium), ()))

    def tier_overlap(
        self, token_ids: Sequence[int], medium: Medium, worker_id: int = 0, dp_rank: int = 0
    ) -> int:
        """Blocks of a prompt found in a lower tier right after its device-tier match.

        Dynamo's lower-tier query continues from where the GPU match of that worker ends and
        counts consecutive blocks present in `medium`, each chained to the one before.
        """
        hashes = self.hashes_of(token_ids)
        start = self.overlap(token_ids, worker_id, dp_rank)
        tree = self._trees.get((worker_id, dp_rank, medium), {})
        count = 0
        prev = hashes[start - 1] if start else None
        for h in hashes[start:]:
            if h not in tree or tree[h] != prev:
                break
            count += 1
            prev = h
        return count

    def blocks(self, worker_id: int = 0, dp_rank: int = 0, medium: Medium = Medium.GPU) -> set[int]:
        return set(self._trees.get((worker_id, dp_rank, medium), ()))

    def router_blocks(
        self, worker_id: int = 0, dp_rank: int = 0, medium: Medium = Medium.GPU
    ) -> set[int]:
        """`blocks` as Dynamo's router indexes them: without the blocks whose first copy's
        Removed it applied while another copy stays cached (vLLM's twins), nor, as its radix
        tree drops a removed node's subtree, their descendants."""
        key = (worker_id, dp_rank, medium)
        tree = self._trees.get(key, {})
        gone = self._router_gone.get(key, set())
        if not gone:
            return set(tree)
        visible: dict[int, bool] = {}

        def reachable(h: int) -> bool:
            path: list[int] = []
            node: int | None = h
            seen = True
            while node is not None:
                known = visible.get(node)
                if known is not None:
                    seen = known
                    break
                if node in gone:
                    seen = False
                    break
                if node not in tree:
                    # A removed parent: its children stay indexed (see the class docstring).
                    break
                path.append(node)
                node = tree[node]
            for n in path:
                visible[n] = seen
            return seen

        return {h for h in tree if reachable(h)}

    def router_overlap(self, token_ids: Sequence[int], worker_id: int = 0, dp_rank: int = 0) -> int:
        """`overlap` as Dynamo's router computes it (see `router_blocks`)."""
        return self._leading(token_ids, self.router_blocks(worker_id, dp_rank))

    def overlap(
        self,
        token_ids: Sequence[int],
        worker_id: int = 0,
        dp_rank: int = 0,
        medium: Medium = Medium.GPU,
    ) -> int:
        """Leading full blocks of a prompt that are indexed: the router's prefix-hit count."""
        return self._leading(token_ids, self._trees.get((worker_id, dp_rank, medium), {}))

    def _leading(self, token_ids: Sequence[int], indexed: Collection[int]) -> int:
        """How many leading full blocks of `token_ids` are in `indexed` (by their content
        under lookahead hashes, as a query by tokens finds them)."""
        if self._content:
            content = self._content
            indexed = {content.get(h, h) for h in indexed}
        count = 0
        for h in self.hashes_of(token_ids):
            if h not in indexed:
                break
            count += 1
        return count
