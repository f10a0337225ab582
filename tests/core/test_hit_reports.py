"""vLLM's `kv_cache_report_mode: "full"` (engined/core/paged/hit_reports.py): a request's
prefix hit published again as one BlockStored, where vLLM's `get_computed_blocks` does.

The parity harness checks whole streams against the real scheduler (docs/parity.md, the
`-full` scenarios); these pin the event itself.
"""

from __future__ import annotations

import pytest

from engined.core.args import Semantics
from engined.core.engine import Engine
from engined.core.errors import UnsupportedError
from engined.core.types import BlockStored, PassResult, Request, Submit
from engined.core.vllm_hashing import (
    DEFAULT_HASH_ALGO,
    BlockHasher,
    event_block_hash_int,
    none_hash,
)
from tests.core.factories import make_args, passes, submit


def stores(result: PassResult) -> list[BlockStored]:
    return [e for e in result.kv_events if isinstance(e, BlockStored)]


def prompt(mode: str, request_id: str) -> Request:
    return Request(
        token_ids=list(range(10)), max_tokens=1, request_id=request_id, kv_cache_report_mode=mode
    )


def test_a_full_report_publishes_the_hit_before_the_admissions_own_stores() -> None:
    """A 10-token prompt at block size 4 caches blocks 0 and 1; sent again in "full" mode it
    hits both (8 tokens), and the pass publishes them once more, from block 0 without a
    parent, before anything the admission stores; sent again in "incremental" mode, nothing
    is published (the hit is all there is)."""
    core = Engine(
        make_args(
            semantics=Semantics.VLLM,
            num_gpu_blocks=32,
            max_num_batched_tokens=64,
            enable_prefix_caching=True,
        )
    )
    submit(core, prompt("incremental", "first"))
    (first,) = passes(core, 1)
    hasher = BlockHasher(DEFAULT_HASH_ALGO, none_hash(DEFAULT_HASH_ALGO, None))
    h0 = hasher.block_hash(None, [0, 1, 2, 3], None)
    h1 = hasher.block_hash(h0, [4, 5, 6, 7], None)
    hashes = [event_block_hash_int(h0), event_block_hash_int(h1)]
    assert [(e.block_hashes, e.parent_hash) for e in stores(first)] == [(hashes, None)]
    submit(core, prompt("full", "again"))
    (again,) = passes(core, 1)
    assert [(e.block_hashes, e.parent_hash, e.token_ids) for e in stores(again)] == [
        (hashes, None, list(range(8)))
    ]
    submit(core, prompt("incremental", "quiet"))
    (quiet,) = passes(core, 1)
    assert stores(quiet) == []


def test_full_reports_need_vllm_semantics() -> None:
    core = Engine(make_args(enable_prefix_caching=True))
    with pytest.raises(UnsupportedError, match=r"request\.kv_cache_report_mode needs vLLM"):
        core.apply(Submit(prompt("full", "a")), now_ms=0.0)
