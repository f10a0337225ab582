"""The one trace format both sides produce, and the canonical identity of KV blocks.

A trace is one `Step` per `schedule()` (vLLM) or pass (engined), in order. Block hashes
differ between the two today (engined xxh3, vLLM sha256), so blocks are compared by what
they are: the full token prefix a block closes, derived from the stored events' parent chain
and token ids (`canonical_events`). Raw hashes stay in the trace for the strict comparison.
"""

from __future__ import annotations

import hashlib
from array import array

import msgspec


class Scheduled(msgspec.Struct, frozen=True, array_like=True):
    """A scheduled request: its computed tokens before this step, the tokens it schedules."""

    request_id: str
    computed: int
    new: int


class Admitted(msgspec.Struct, frozen=True, array_like=True):
    """A waiting -> running transition; `computed` its computed tokens then (the prefix hit)."""

    request_id: str
    computed: int


class CachedReport(msgspec.Struct, frozen=True, array_like=True):
    """The `cached_tokens` an output reported."""

    request_id: str
    cached_tokens: int


class StopReport(msgspec.Struct, frozen=True, array_like=True):
    """A request that finished on a stop id, and that id (vLLM's `stop_reason`)."""

    request_id: str
    stop_reason: int


class Stored(msgspec.Struct, frozen=True, tag="stored"):
    block_hashes: list[str]
    parent: str | None
    token_ids: list[int]
    block_size: int
    # One entry per block as the event carries it (a salted first block: `[salt]`; a LoRA
    # request's blocks: `[name]`, `[name, salt]`).
    extra_keys: list[list[str] | None] | None = None
    # A LoRA request's blocks: its adapter's id and name.
    lora_id: int | None = None
    lora_name: str | None = None
    # Lookahead block hashes (MTP with prefix caching): per block, the tokens after it that
    # its hash covers.
    lookahead_token_ids: list[list[int]] | None = None


class Removed(msgspec.Struct, frozen=True, tag="removed"):
    """One evicted block (a grouped removal is split into one per hash, in order)."""

    block_hash: str


class Cleared(msgspec.Struct, frozen=True, tag="cleared"):
    pass


KvEvent = Stored | Removed | Cleared


class Step(msgspec.Struct, kw_only=True):
    index: int
    scheduled: list[Scheduled] = []
    admitted: list[Admitted] = []
    cached: list[CachedReport] = []
    preempted: list[str] = []
    finished: list[str] = []
    stopped: list[StopReport] = []
    running: int = 0
    waiting: int = 0
    events: list[KvEvent] = []


class Trace(msgspec.Struct, kw_only=True):
    scenario: str
    steps: list[Step] = []
    # Set when the side failed mid-run; the steps before the failure are kept.
    error: str | None = None
    # Each request's generated tokens by position (engined's, handed to vLLM).
    output_tokens: dict[str, list[int]] = {}
    # The tokens each sampling step of a request gave, in order (engined's side, for MTP).
    bursts: dict[str, list[int]] = {}


class CanonicalBlock(msgspec.Struct, frozen=True, array_like=True):
    """A stored or removed block by identity: the length of the token prefix it closes and
    a digest of that prefix; `parent` likewise for the block before it (None at the root)."""

    kind: str
    identity: str
    parent: str | None = None


def prefix_identity(tokens: list[int], salt: str | None = None, lora: str | None = None) -> str:
    """`len:digest` of a token prefix (and the cache salt its first block was stored under,
    and the LoRA adapter its blocks were, `id:name`): equal prefixes under equal salts and
    adapters, equal identities."""
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8)
    if salt is not None:
        digest.update(b"\x00salt\x00" + salt.encode())
    if lora is not None:
        digest.update(b"\x00lora\x00" + lora.encode())
    return f"{len(tokens)}:{digest.hexdigest()}"


# What a block's prefix is stored under: its tokens, its first block's salt, its adapter.
_Prefix = tuple[list[int], str | None, str | None]


class Canonicalizer:
    """Follows one side's events in order, mapping each raw hash to the token prefix it
    closes (and the salt of that prefix's first block, from its `extra_keys`, and the LoRA
    adapter of the event; under lookahead hashes, `+` the tokens after the block its hash
    covers). A removal or parent of a hash never stored is named `unknown:<hash>`."""

    __slots__ = ("_identities", "_prefixes")

    def __init__(self) -> None:
        self._prefixes: dict[str, _Prefix] = {}
        self._identities: dict[str, str] = {}

    def step(self, events: list[KvEvent]) -> list[CanonicalBlock]:
        blocks: list[CanonicalBlock] = []
        prefixes = self._prefixes
        identities = self._identities
        for event in events:
            if isinstance(event, Stored):
                parent: _Prefix | None = ([], None, None)
                parent_id: str | None = None
                if event.parent is not None:
                    parent = prefixes.get(event.parent)
                    parent_id = identities.get(event.parent, f"unknown:{event.parent}")
                prefix, salt = (list(parent[0]), parent[1]) if parent is not None else ([], None)
                lora = None if event.lora_name is None else f"{event.lora_id}:{event.lora_name}"
                size = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    keys = event.extra_keys[i] if event.extra_keys else None
                    # The adapter's name comes first among a LoRA block's keys.
                    salted = keys[1:] if keys and lora is not None else keys
                    if not prefix and salted:
                        salt = salted[0]
                    prefix = prefix + event.token_ids[i * size : (i + 1) * size]
                    prefixes[block_hash] = (prefix, salt, lora)
                    identity = prefix_identity(prefix, salt, lora)
                    if event.lookahead_token_ids:
                        identity += "+" + ",".join(map(str, event.lookahead_token_ids[i]))
                    identities[block_hash] = identity
                    blocks.append(CanonicalBlock("stored", identity, parent_id))
                    parent_id = identity
            elif isinstance(event, Removed):
                identity = identities.get(event.block_hash, f"unknown:{event.block_hash}")
                blocks.append(CanonicalBlock("removed", identity))
            else:
                blocks.append(CanonicalBlock("cleared", ""))
        return blocks


def canonical_events(trace: Trace) -> list[list[CanonicalBlock]]:
    """Every step's events of `trace` by canonical identity."""
    canonicalizer = Canonicalizer()
    return [canonicalizer.step(step.events) for step in trace.steps]
