"""LoRA requests as vLLM 0.33 handles them: checked at intake, bounded by `max_loras` in
admission, and hashed and published apart from the base model's blocks.

vLLM's scheduler admits a waiting request for an adapter only while the adapters of the
running requests (and of those admitted so far in the pass) number fewer than `max_loras`, or
include its own; otherwise it skips it (`skip_request`) and goes on down the queue, putting
the skipped requests back at the front when the scan ends. Every block of a LoRA request is
hashed with `("lora", name, path)` among its extra keys (before a salt, which only the first
block has), and its `BlockStored` carries the adapter's id and name and the keys untagged.
The expected hashes below are vLLM's `hash_block_tokens` written out (sha256 over the
pickled `(parent, tokens, extra_keys)`); tests/core/test_vllm_hashing.py runs vLLM's own
request block hasher against engined's, and the parity harness whole streams (`lora-*`).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import pytest

from engined.core.args import SchedulingPolicy, Semantics
from engined.core.engine import Engine
from engined.core.errors import InvalidRequestError, UnsupportedError
from engined.core.types import BlockStored, KvEvent, LoraRequest, PassResult, Request, Submit
from tests.core.factories import make_args, submit
from tests.core.test_paged_semantics import paged_args

A = LoraRequest("a", 1, "/adapters/a")
B = LoraRequest("b", 2, "/adapters/b")
C = LoraRequest("c", 3, "/adapters/c")
PROMPT = list(range(100, 109))

_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def vllm_hashes(tokens: list[int], lora: LoraRequest | None, salt: str | None = None) -> list[int]:
    """The event hashes vLLM gives the full blocks (of 4) of `tokens`: its extra keys are
    the adapter's on every block, then the salt on the first."""
    out: list[int] = []
    parent = _NONE_HASH
    for i in range(len(tokens) // 4):
        keys: list[tuple[str, ...]] = []
        if lora is not None:
            keys.append(("lora", lora.lora_name, lora.lora_path))
        if salt is not None and i == 0:
            keys.append(("cache_salt", salt))
        key = (parent, tuple(tokens[i * 4 : (i + 1) * 4]), tuple(keys) or None)
        parent = hashlib.sha256(pickle.dumps(key, protocol=5)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def lora_args(**overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "num_gpu_blocks": 64,
        "max_num_seqs": 8,
        "enable_lora": True,
        "max_loras": 1,
    }
    fields.update(overrides)
    return paged_args(**fields)


def req(
    request_id: str,
    lora: LoraRequest | None,
    tokens: list[int] | None = None,
    max_tokens: int = 2,
    **fields: Any,
) -> Request:
    return Request(
        token_ids=list(range(8)) if tokens is None else tokens,
        max_tokens=max_tokens,
        request_id=request_id,
        lora_request=lora,
        **fields,
    )


def passes(core: Engine, count: int) -> list[PassResult]:
    results = []
    now = 0.0
    for _ in range(count):
        result = core.execute_pass(now)
        now = result.end_ms
        results.append(result)
    return results


def admitted(result: PassResult) -> list[str]:
    return [a.request_id for a in result.admissions]


def run(core: Engine, *requests: Request) -> tuple[list[KvEvent], dict[str, int | None]]:
    """Submit `requests` one after another, each run to its end: the KV events, and the
    cached tokens each reported."""
    events: list[KvEvent] = []
    cached: dict[str, int | None] = {}
    now = 0.0
    for request in requests:
        submit(core, request, now)
        while not core.is_empty():
            result = core.execute_pass(now)
            events += result.kv_events
            for out in result.request_outputs():
                cached.setdefault(out.request_id, out.cached_tokens)
            now = result.end_ms
    return events, cached


def stored(events: list[KvEvent]) -> list[tuple[Any, ...]]:
    return [
        (e.block_hashes, e.parent_hash, e.extra_keys, e.lora_id, e.lora_name)
        for e in events
        if isinstance(e, BlockStored)
    ]


# --- intake ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (LoraRequest("a", 0, "/a"), "id must be > 0, got 0"),
        (LoraRequest("a", -3, "/a"), "id must be > 0, got -3"),
        (LoraRequest("a", 1, ""), "lora_path cannot be empty"),
    ],
)
def test_an_adapter_vllm_could_not_build_is_refused(lora: LoraRequest, message: str) -> None:
    core = Engine(lora_args())
    with pytest.raises(InvalidRequestError) as raised:
        core.apply(Submit(req("r", lora)), now_ms=0.0)
    assert str(raised.value) == message
    assert core.is_empty()


def test_a_lora_request_without_enable_lora_gets_vllms_error() -> None:
    core = Engine(paged_args())
    with pytest.raises(InvalidRequestError) as raised:
        core.apply(Submit(req("r", LoraRequest("it's", 7, "/p"))), now_ms=0.0)
    assert str(raised.value) == (
        "Got lora_request LoRARequest(lora_name=\"it's\", lora_int_id=7, lora_path='/p', "
        "base_model_name=None, load_inplace=False, is_3d_lora_weight=False) "
        "but LoRA is not enabled!"
    )
    assert raised.value.code == "invalid_request"
    assert core.is_empty()


def test_the_mocker_pool_refuses_an_adapter_naming_the_field() -> None:
    core = Engine(make_args(semantics=Semantics.MOCKER_1_3_0, enable_prefix_caching=True))
    with pytest.raises(UnsupportedError) as raised:
        core.apply(Submit(req("r", A)), now_ms=0.0)
    assert str(raised.value).startswith("request.lora_request needs vLLM semantics")
    assert core.is_empty()


# --- admission under max_loras ---------------------------------------------------------------


def test_a_request_for_another_adapter_waits_while_later_ones_are_admitted() -> None:
    """max_loras 1: a1 runs adapter a; b1 is skipped, the base-model request and a2 (adapter a,
    in the set) behind it are admitted. b1 stays first in the queue, deferred, and is admitted
    in the pass after a1 and a2 finish (2 tokens: their second pass)."""
    core = Engine(lora_args())
    for request in (req("a1", A), req("b1", B), req("base", None, max_tokens=4), req("a2", A)):
        submit(core, request)
    first, second, third = passes(core, 3)
    assert admitted(first) == ["a1", "base", "a2"]
    assert (first.metrics.waiting, first.metrics.waiting_deferred) == (1, 1)
    assert admitted(second) == []
    assert [e.request_id for e in second.ended] == ["a1", "a2"]
    assert (second.metrics.waiting, second.metrics.waiting_deferred) == (1, 1)
    assert admitted(third) == ["b1"]
    assert (third.metrics.waiting, third.metrics.waiting_deferred) == (0, 0)
    assert core.queues().running == ["base", "b1"]


def test_skipped_requests_go_back_to_the_front_in_their_order() -> None:
    """a1 runs adapter a; b1 and c1 are skipped and behind them base is admitted; a late
    base-model request queues behind the skipped ones."""
    core = Engine(lora_args())
    submit(core, req("a1", A, max_tokens=4))
    passes(core, 1)
    for request in (req("b1", B), req("c1", C), req("base", None)):
        submit(core, request)
    (result,) = passes(core, 1)
    assert admitted(result) == ["base"]
    assert core.queues().waiting == ["b1", "c1"]
    submit(core, req("late", None, max_tokens=1))
    assert core.queues().waiting == ["b1", "c1", "late"]
    assert core.metrics().waiting_deferred == 2


def test_max_loras_counts_the_adapters_admitted_in_the_same_pass() -> None:
    """max_loras 2, nothing running: a1 and b1 are admitted (their adapters fill the set), c1
    is skipped and a2 admitted; 2 more adapters never run at once."""
    core = Engine(lora_args(max_loras=2))
    for request in (req("a1", A), req("b1", B), req("c1", C), req("a2", A)):
        submit(core, request)
    (result,) = passes(core, 1)
    assert admitted(result) == ["a1", "b1", "a2"]
    assert core.queues().waiting == ["c1"]


def test_priority_order_skips_the_same_way() -> None:
    """Under the priority policy the scan is in (priority, arrival) order: b1 (priority 0)
    is skipped for adapter a, which the earlier a1 runs, and base (priority 1) is admitted."""
    core = Engine(lora_args(scheduling_policy=SchedulingPolicy.PRIORITY))
    submit(core, req("a1", A, max_tokens=4))
    passes(core, 1)
    submit(core, req("base", None, priority=1))
    submit(core, req("b1", B, priority=0))
    (result,) = passes(core, 1)
    assert admitted(result) == ["base"]
    assert core.queues().waiting == ["b1"]


def test_async_scheduling_skips_the_same_way() -> None:
    core = Engine(lora_args(async_scheduling=True))
    for request in (req("a1", A), req("b1", B), req("base", None)):
        submit(core, request)
    first, *_ = passes(core, 1)
    assert admitted(first) == ["a1", "base"]
    assert core.queues().waiting == ["b1"]


# --- block hashes and KV events --------------------------------------------------------------


def test_every_block_of_a_lora_request_is_keyed_and_published_with_its_adapter() -> None:
    core = Engine(lora_args())
    events, _ = run(core, req("r", A, PROMPT, max_tokens=1))
    hashes = vllm_hashes(PROMPT, A)
    assert hashes != vllm_hashes(PROMPT, None)
    assert stored(events) == [(hashes, None, [("a",), ("a",)], 1, "a")]


def test_a_salted_lora_request_has_the_adapter_first_and_the_salt_on_its_first_block() -> None:
    core = Engine(lora_args())
    events, _ = run(core, req("r", A, PROMPT, max_tokens=1, cache_salt="s"))
    assert stored(events) == [(vllm_hashes(PROMPT, A, "s"), None, [("a", "s"), ("a",)], 1, "a")]


def test_blocks_filled_by_decoding_are_keyed_too() -> None:
    """A 6-token prompt generating 7 tokens: the prompt's first block is stored at its
    prefill, the 2nd and 3rd as decode steps fill them, each with the adapter."""
    core = Engine(lora_args())
    planned = [1, 2, 3, 4, 5, 6, 7]
    events, _ = run(core, req("r", B, [9, 8, 7, 6, 5, 4], output_token_ids=planned, max_tokens=7))
    hashes = vllm_hashes([9, 8, 7, 6, 5, 4, *planned], B)
    assert stored(events) == [
        ([hashes[0]], None, [("b",)], 2, "b"),
        ([hashes[1]], hashes[0], [("b",)], 2, "b"),
        ([hashes[2]], hashes[1], [("b",)], 2, "b"),
    ]


def test_a_fully_cached_prompt_stores_its_recomputed_block_again_with_the_adapter() -> None:
    """8 tokens, 2 whole blocks: the second request hits the first block only (the last
    token is recomputed) and caches a twin of the second, published as vLLM does."""
    core = Engine(lora_args())
    tokens = list(range(8))
    events, cached = run(core, req("one", A, tokens, 1), req("two", A, tokens, 1))
    hashes = vllm_hashes(tokens, A)
    assert cached == {"one": 0, "two": 4}
    assert stored(events) == [
        (hashes, None, [("a",), ("a",)], 1, "a"),
        ([hashes[1]], hashes[0], [("a",)], 1, "a"),
    ]


def test_only_the_same_adapter_shares_cached_blocks() -> None:
    """9 tokens (2 whole blocks a hit can reuse): the base model's blocks, another adapter's,
    the same name at another path and the same path under another name share nothing; the
    same adapter (by name and path) hits, with or without the same id."""
    core = Engine(lora_args(num_gpu_blocks=64))
    _, cached = run(
        core,
        req("base", None, PROMPT, 1),
        req("a", A, PROMPT, 1),
        req("b", B, PROMPT, 1),
        req("moved", LoraRequest("a", 1, "/adapters/a2"), PROMPT, 1),
        req("renamed", LoraRequest("a2", 1, "/adapters/a"), PROMPT, 1),
        req("a-again", LoraRequest("a", 9, "/adapters/a"), PROMPT, 1),
        req("base-again", None, PROMPT, 1),
    )
    assert cached == {
        "base": 0,
        "a": 0,
        "b": 0,
        "moved": 0,
        "renamed": 0,
        "a-again": 8,
        "base-again": 8,
    }


def test_salted_and_unsalted_lora_requests_share_nothing() -> None:
    core = Engine(lora_args())
    _, cached = run(
        core,
        req("a", A, PROMPT, 1),
        req("a-salted", A, PROMPT, 1, cache_salt="s"),
        req("salted", None, PROMPT, 1, cache_salt="s"),
        req("a-salted-again", A, PROMPT, 1, cache_salt="s"),
    )
    assert cached == {"a": 0, "a-salted": 0, "salted": 0, "a-salted-again": 8}
