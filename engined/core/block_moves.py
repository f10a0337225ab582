"""The block moves a sequence asks the mocker's lineage pool for (engined/core/kv_manager.py).

A sequence never touches the pool: it describes what must happen as `Use`, `Deref` and
`Promote` values, which the KV manager applies, so a failed allocation can be undone by the
caller (`Sequence.pop`) without the sequence knowing about capacity. The values live apart
from the sequence because the pool, its event log and the offload glue read them without
needing the token bookkeeping that makes them. vLLM's pool takes one move of its own,
`sequence.Release`, which names the sequence itself.
"""

from __future__ import annotations

from array import array

from engined.core.hashing import parent_lineage_key


class Use:
    """Take (or re-take) the blocks `[first, first + len(hashes))`, then `partial` if set.

    Fresh full blocks are registered (and published as Stored) at once, even before their
    tokens are computed: that is the 1.3.0 behaviour routers see.
    """

    __slots__ = ("first", "hashes", "keys", "local", "parent", "partial", "tokens")

    def __init__(
        self,
        first: int,
        hashes: list[int],
        keys: list[int],
        local: list[int] | None,
        partial: int | None,
        parent: int | None,
        tokens: array[int] | None,
    ) -> None:
        self.first = first
        self.hashes = hashes
        self.keys = keys
        self.local = local
        self.partial = partial
        self.parent = parent
        self.tokens = tokens

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) + (self.partial is not None)

    def parent_key(self, i: int) -> int | None:
        """The lineage parent of the move's block `i` (`local` is None without caching)."""
        if self.local is not None:
            return self.hashes[i - 1] if i else self.parent
        return parent_lineage_key(self.first + i)


class Deref:
    """Drop the request's hold on blocks: the partial (tail) first, then full blocks (by
    lineage key) tail-first.

    Tail-first release gives the tail the older inactive tick, so eviction takes leaves before
    their parents.
    """

    __slots__ = ("keys", "partial")

    def __init__(self, partial: int | None, keys: list[int]) -> None:
        self.partial = partial
        self.keys = keys


class Promote:
    """The partial block `partial` just filled up: it becomes full block `hash`."""

    __slots__ = ("hash", "key", "local", "parent", "parent_key", "partial", "tokens")

    def __init__(
        self,
        partial: int,
        hash_: int,
        parent: int | None,
        local: int | None,
        key: int,
        parent_key: int | None,
        tokens: list[int] | None,
    ) -> None:
        self.partial = partial
        self.hash = hash_
        self.parent = parent
        self.local = local
        self.key = key
        self.parent_key = parent_key
        self.tokens = tokens
