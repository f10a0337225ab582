"""`LineageIndex` against a model that walks every node for each eviction.

The index scans its insertion order and a heap of re-leafed nodes, skipping stale entries;
the model states the rule directly: the victim is the real node without children that has the
oldest insertion tick, a node that is neither real nor a parent disappears, and a parent link
is set when a node is created. Keys form a fixed forest (the parent of `k` is `k // 3` for
`k >= 3`), so chains, siblings and ghosts all occur.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engined.core.lineage_pool import LineageIndex

_KEYS = 40


def _parent(key: int) -> int | None:
    return key // 3 if key >= 3 else None


class Model:
    def __init__(self) -> None:
        self.tick: dict[int, int] = {}  # real nodes
        self.parent: dict[int, int | None] = {}  # every node, real or ghost
        self.next_tick = 0

    def children(self, key: int) -> int:
        return sum(1 for p in self.parent.values() if p == key)

    def insert(self, key: int) -> None:
        self.tick[key] = self.next_tick
        self.next_tick += 1
        if key not in self.parent:
            self.parent[key] = None
        parent = _parent(key)
        if parent is not None and self.parent[key] is None:
            self.parent[key] = parent
            self.parent.setdefault(parent, None)

    def remove(self, key: int) -> None:
        del self.tick[key]
        node: int | None = key
        while node is not None and node not in self.tick and self.children(node) == 0:
            up = self.parent.pop(node)
            node = up

    def pop_victim(self) -> int:
        leaves = [k for k in self.tick if self.children(k) == 0]
        victim = min(leaves, key=self.tick.__getitem__)
        self.remove(victim)
        return victim


_ops = st.lists(
    st.tuples(st.sampled_from(["insert", "chain", "remove", "evict"]), st.integers(0, _KEYS - 1)),
    max_size=400,
)


@settings(max_examples=150)
@given(_ops)
def test_evictions_follow_the_model(ops: list[tuple[str, int]]) -> None:
    index = LineageIndex()
    model = Model()
    for op, key in ops:
        if op == "insert" and key not in model.tick:
            index.insert(key, _parent(key))
            model.insert(key)
        elif op == "chain":
            # A finished request: its blocks from the tail up to the root, as Deref releases.
            node: int | None = key
            while node is not None:
                if node not in model.tick:
                    index.insert(node, _parent(node))
                    model.insert(node)
                node = _parent(node)
        elif op == "remove" and key in model.tick:
            index.remove(key)
            model.remove(key)
        elif op == "evict" and model.tick:
            assert index.pop_victim() == model.pop_victim()
        assert index.count == len(model.tick)
    while model.tick:
        assert index.pop_victim() == model.pop_victim()


def test_a_chain_released_tail_first_is_evicted_tail_first() -> None:
    index = LineageIndex()
    chain = [1, 3, 9, 27]  # each the parent of the next
    for key in reversed(chain):
        index.insert(key, _parent(key))
    index.insert(2, None)
    assert [index.pop_victim() for _ in range(5)] == [27, 9, 3, 1, 2]


def test_stale_entries_are_dropped_while_the_pool_churns() -> None:
    index = LineageIndex()
    for _ in range(2000):
        index.insert(5, None)
        index.remove(5)
    index.insert(7, None)
    assert index.pop_victim() == 7
    assert len(index._order) + len(index._heap) <= 64
