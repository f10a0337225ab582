"""`cache_salt` as vLLM 0.33 honours it: the salt enters the first block's hash.

vLLM hashes a salted request's first block with the extra keys `(("cache_salt", salt),)` and
publishes them untagged in that block's `BlockStored.extra_keys` (`(salt,)`, None for the
other blocks); every later hash chains from it, so requests share cached blocks only with the
same salt. tests/core/test_vllm_hashing.py checks the hashes against vLLM's own request block
hasher for every algorithm, and the parity harness whole streams (the `cache-salt-*`
scenarios).
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import Semantics
from engined.core.engine import Engine
from engined.core.errors import UnsupportedError
from engined.core.types import BlockStored, KvEvent, Request, Submit
from engined.core.vllm_hashing import (
    DEFAULT_HASH_ALGO,
    BlockHasher,
    block_extra_keys,
    event_block_hash_int,
    none_hash,
)
from tests.core.factories import make_args, submit
from tests.core.test_paged_semantics import paged_args

PROMPT = list(range(100, 109))


def salted_hashes(tokens: list[int], salt: str | None) -> list[int]:
    """The event hashes vLLM gives the full blocks of `tokens` (block size 4) under `salt`."""
    hasher = BlockHasher(DEFAULT_HASH_ALGO, none_hash(DEFAULT_HASH_ALGO, None))
    out: list[int] = []
    parent: bytes | None = None
    for i in range(len(tokens) // 4):
        extra = block_extra_keys(None, salt) if salt and i == 0 else None
        parent = hasher.block_hash(parent, tokens[i * 4 : (i + 1) * 4], extra)
        out.append(event_block_hash_int(parent))
    return out


def run(core: Engine, *requests: Request) -> tuple[list[KvEvent], dict[str, int | None]]:
    """Submit `requests` one after another, each run to its end: the KV events, and the
    cached tokens each reported."""
    events: list[KvEvent] = []
    cached: dict[str, int | None] = {}
    now = 0.0
    for req in requests:
        submit(core, req, now)
        while not core.is_empty():
            result = core.execute_pass(now)
            events += result.kv_events
            for out in result.request_outputs():
                if out.request_id not in cached:
                    cached[out.request_id] = out.cached_tokens
            now = result.end_ms
    return events, cached


def salted(request_id: str, salt: str | None, tokens: list[int] = PROMPT, **fields: Any) -> Request:
    fields.setdefault("max_tokens", 1)
    return Request(token_ids=tokens, request_id=request_id, cache_salt=salt, **fields)


def stored(events: list[KvEvent]) -> list[tuple[list[int], int | None, Any]]:
    return [
        (e.block_hashes, e.parent_hash, e.extra_keys) for e in events if isinstance(e, BlockStored)
    ]


def test_the_salt_enters_the_first_block_hash_and_its_extra_keys() -> None:
    core = Engine(paged_args(num_gpu_blocks=16))
    events, _ = run(core, salted("a", "tenant-1"))
    h = salted_hashes(PROMPT, "tenant-1")
    assert h != salted_hashes(PROMPT, None)
    assert stored(events) == [(h, None, [("tenant-1",), None])]


def test_only_requests_with_the_same_salt_share_cached_blocks() -> None:
    """9 tokens: 2 whole blocks a hit can reuse (8 tokens). The salted prompt hits only its
    own salt's blocks; an empty salt is no salt (vLLM salts only a non-empty one)."""
    core = Engine(paged_args(num_gpu_blocks=32))
    events, cached = run(
        core,
        salted("plain", None),
        salted("a1", "a"),
        salted("b1", "b"),
        salted("a2", "a"),
        salted("empty", ""),
        salted("b2", "b"),
    )
    assert cached == {"plain": 0, "a1": 0, "b1": 0, "a2": 8, "empty": 8, "b2": 8}
    firsts = [e.block_hashes[0] for e in events if isinstance(e, BlockStored) and not e.parent_hash]
    plain, a, b = (salted_hashes(PROMPT, salt)[0] for salt in (None, "a", "b"))
    assert firsts == [plain, a, b]


def test_a_block_filled_by_generated_tokens_is_salted_too() -> None:
    """A 2-token prompt: its first block fills with generated tokens and is hashed then,
    under the salt; a later prompt of those 4 tokens and one more hits it with the salt only."""
    core = Engine(paged_args(num_gpu_blocks=32))
    events, _ = run(core, salted("a", "s", [7, 8], output_token_ids=[1, 2, 3]))
    first = [7, 8, 1, 2]
    assert stored(events) == [(salted_hashes(first, "s"), None, [("s",)])]
    _, cached = run(core, salted("same", "s", [*first, 5]), salted("other", "t", [*first, 5]))
    assert cached == {"same": 4, "other": 0}


def test_the_mocker_pool_refuses_a_salt_naming_the_field() -> None:
    core = Engine(make_args(semantics=Semantics.MOCKER_1_3_0, enable_prefix_caching=True))
    with pytest.raises(UnsupportedError) as raised:
        core.apply(Submit(salted("a", "s")), now_ms=0.0)
    assert str(raised.value).startswith("request.cache_salt needs vLLM semantics")
    assert raised.value.code == "unsupported"
    assert core.is_empty()


def test_the_mocker_pool_takes_an_empty_salt_as_none() -> None:
    core = Engine(make_args(semantics=Semantics.MOCKER_1_3_0, enable_prefix_caching=True))
    assert submit(core, salted("a", "")) == "a"
