"""Factories for core tests, after the seed's `make_args()` / `router_args()` helpers."""

from __future__ import annotations

import uuid
from typing import Any

from engined.core.args import EngineArgs, PrefixHitRule
from engined.core.scheduler import VllmCore
from engined.core.types import PassResult, Request

ROUTER_TEST_WORKER_ID = 23
# Seed twins whose numbers follow 1.3.0's rule (a fully cached prefix is all hit) pin it.
MOCKER_1_3_0 = PrefixHitRule.MOCKER_1_3_0


def uid(n: int) -> str:
    """The seed's `Uuid::from_u128(n)`, as the string id the core uses."""
    return str(uuid.UUID(int=n))


def make_args(**overrides: Any) -> EngineArgs:
    """bs 4, 6 blocks, budget 8, 3 seqs, chunked, prefix caching off, no time scaling."""
    fields: dict[str, Any] = {
        "block_size": 4,
        "num_gpu_blocks": 6,
        "max_num_batched_tokens": 8,
        "max_num_seqs": 3,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        "speedup_ratio": 0.0,
    }
    fields.update(overrides)
    return EngineArgs(**fields)


def router_args(**overrides: Any) -> EngineArgs:
    """bs 4, 12 blocks, budget 12, 3 seqs, chunked, prefix caching on."""
    fields: dict[str, Any] = {"num_gpu_blocks": 12, "max_num_batched_tokens": 12}
    fields["enable_prefix_caching"] = True
    fields.update(overrides)
    return make_args(**fields)


def make_core(args: EngineArgs | None = None, **kwargs: Any) -> VllmCore:
    return VllmCore(args if args is not None else make_args(), **kwargs)


def request(
    request_id: str,
    tokens: list[int] | range,
    max_tokens: int,
    output_token_ids: list[int] | None = None,
) -> Request:
    return Request(
        token_ids=list(tokens),
        max_tokens=max_tokens,
        request_id=request_id,
        output_token_ids=output_token_ids,
    )


def run_until_empty(
    core: VllmCore, now_ms: float = 0.0, max_passes: int = 10_000
) -> list[PassResult]:
    """Run passes back to back until the core holds no request."""
    passes = []
    for _ in range(max_passes):
        if core.is_empty():
            return passes
        result = core.execute_pass(now_ms)
        now_ms = max(result.end_ms, now_ms)
        passes.append(result)
    raise AssertionError(f"core not empty after {max_passes} passes")
