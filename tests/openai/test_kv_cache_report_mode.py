"""vLLM's `kv_cache_report_mode` through `engined serve`'s OpenAI API: a request whose
`vllm_xargs` say "full" has its prefix hit published again, as vLLM 0.33's
`emit_cached_block_events`, on a real daemon, read from its KV event stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engined.wire.kv_events import BlockStored
from tests.openai.api_harness import ApiDaemon, start_api
from tests.server.daemon_harness import published_stores
from tests.support import run

BLOCK = 16
FLAGS = ("--speedup-ratio", "0", "--block-size", str(BLOCK), "--enable-prompt-tokens-details")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    with start_api(tmp_path_factory.mktemp("report"), *FLAGS) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(api: ApiDaemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=api.base_url, api_key="none", max_retries=0) as c:
        yield c


def all_stored(api: ApiDaemon) -> list[BlockStored]:
    return run(published_stores(api.daemon))


def stored(api: ApiDaemon, first: list[int]) -> list[tuple[Any, list[Any]]]:
    """(parent hash, block hashes) of each BlockStored whose first block is `first`."""
    return [
        (e.parent_block_hash, e.block_hashes)
        for e in all_stored(api)
        if e.token_ids[:BLOCK] == first
    ]


def complete(client: openai.OpenAI, prompt: list[int], xargs: dict[str, Any] | None) -> int:
    """The prompt tokens the request found cached."""
    extra = None if xargs is None else {"vllm_xargs": xargs}
    answer = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=1, extra_body=extra
    )
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


def test_full_mode_publishes_each_hit_again(client: openai.OpenAI, api: ApiDaemon) -> None:
    """A 40-token prompt stores its 2 whole blocks once; repeats hit them (32 tokens), and
    only those in "full" mode publish them again, from block 0 without a parent. vLLM reads
    the key from `extra_args` and compares it with "full", so any other value is its
    default."""
    prompt = list(range(2500, 2540))
    modes: list[dict[str, Any] | None] = [
        None,
        {"kv_cache_report_mode": "full"},
        {"kv_cache_report_mode": "incremental"},
        {"kv_cache_report_mode": "partial", "other": 1},
        {"kv_cache_report_mode": "full"},
    ]
    assert [complete(client, prompt, xargs) for xargs in modes] == [0, 32, 32, 32, 32]
    events = stored(api, prompt[:BLOCK])
    assert len(events) == 3
    (parent, hashes), *repeats = events
    assert parent is None and len(hashes) == 2
    assert repeats == [(None, hashes), (None, hashes)]


def test_full_mode_on_a_chat_completion(client: openai.OpenAI, api: ApiDaemon) -> None:
    """The chat endpoint takes `vllm_xargs` too: a long message sent twice, the second in
    "full" mode, publishes the blocks the second one hit again, with the first's hashes."""
    message = " ".join(f"word{i}" for i in range(120))
    before = len(all_stored(api))
    hits = []
    for xargs in (None, {"kv_cache_report_mode": "full"}):
        answer = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": message}],
            max_tokens=1,
            extra_body=None if xargs is None else {"vllm_xargs": xargs},
        )
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        hits.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
    assert hits[0] == 0 and hits[1] >= BLOCK
    first, *later = all_stored(api)[before:]
    hit_blocks = first.block_hashes[: hits[1] // BLOCK]
    assert [(e.parent_block_hash, e.block_hashes) for e in later] == [(None, hit_blocks)]
