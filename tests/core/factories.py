"""Factories and small readers for core tests, after the seed's `make_args()` / `router_args()`.

Tests drive `Engine` through its contract (`apply`, `execute_pass`, `advance_tiers`,
`metrics`, `inspect`...); these helpers only shorten the common calls.
"""

from __future__ import annotations

import uuid
from typing import Any

from engined.core.args import EngineArgs, PerfModelKind, PrefixHitRule, Semantics
from engined.core.engine import Engine
from engined.core.kv_manager import KvManager
from engined.core.types import (
    Command,
    CommandEffects,
    CommandResult,
    FinishReason,
    KvEvent,
    PassResult,
    Request,
    RequestOutput,
    Submit,
    Submitted,
)
from engined.core.views import DestinationStage, RequestView, SourceStage
from tests.reference_indexer import ReferenceIndexer

ROUTER_TEST_WORKER_ID = 23
# Seed twins whose numbers follow 1.3.0's rule (a fully cached prefix is all hit) pin it.
MOCKER_1_3_0 = PrefixHitRule.MOCKER_1_3_0


def uid(n: int) -> str:
    """The seed's `Uuid::from_u128(n)`, as the string id the core uses."""
    return str(uuid.UUID(int=n))


def make_args(**overrides: Any) -> EngineArgs:
    """bs 4, 6 blocks, budget 8, 3 seqs, chunked, prefix caching off, no time scaling, and
    the mocker's pool (the seed twins' numbers; tests of vLLM semantics override it)."""
    fields: dict[str, Any] = {
        "semantics": Semantics.MOCKER_1_3_0,
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


def tiered_args(**overrides: Any) -> EngineArgs:
    """bs 4, 2 seqs, budget 64, prefix caching on, a G2 tier whose every hop takes 1 ms (1 MB
    blocks at 1 GB/s both ways), and passes that take no modeled time."""
    fields: dict[str, Any] = {
        "semantics": Semantics.MOCKER_1_3_0,
        "block_size": 4,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "speedup_ratio": 0.0,
        "kv_bytes_per_token": 250_000,
        "bandwidth_g1_to_g2_gbps": 1.0,
        "bandwidth_g2_to_g1_gbps": 1.0,
        "perf_model": PerfModelKind.FIXED,
        "fixed_prefill_ms_per_token": 0.0,
        "fixed_pass_overhead_ms": 0.0,
        "fixed_decode_ms_per_pass": 0.0,
    }
    fields.update(overrides)
    return EngineArgs(**fields)


def router_args(**overrides: Any) -> EngineArgs:
    """bs 4, 12 blocks, budget 12, 3 seqs, chunked, prefix caching on."""
    fields: dict[str, Any] = {"num_gpu_blocks": 12, "max_num_batched_tokens": 12}
    fields["enable_prefix_caching"] = True
    fields.update(overrides)
    return make_args(**fields)


def make_core(args: EngineArgs | None = None, **kwargs: Any) -> Engine:
    return Engine(args if args is not None else make_args(), **kwargs)


def request(
    request_id: str,
    tokens: list[int] | range,
    max_tokens: int,
    output_token_ids: list[int] | None = None,
    *,
    priority: int = 0,
) -> Request:
    return Request(
        token_ids=list(tokens),
        max_tokens=max_tokens,
        request_id=request_id,
        output_token_ids=output_token_ids,
        priority=priority,
    )


def submit(core: Engine, req: Request, now_ms: float = 0.0) -> str:
    """Submit `req`; its id."""
    result = core.apply(Submit(req), now_ms=now_ms).result
    assert isinstance(result, Submitted)
    return result.request_id


def command(core: Engine, cmd: Command, now_ms: float = 0.0) -> CommandResult:
    """Apply `cmd`; its result."""
    return core.apply(cmd, now_ms=now_ms).result


def view(core: Engine, request_id: str) -> RequestView:
    """The request's snapshot (it must be there)."""
    seen = core.inspect(request_id)
    assert seen is not None, f"{request_id} is not in the engine"
    return seen


def active_blocks(core: Engine) -> int:
    return core.metrics().active_blocks


def inactive_blocks(core: Engine) -> int:
    return core.metrics().inactive_blocks


def output_of(result: PassResult, request_id: str) -> RequestOutput | None:
    """The pass's output of `request_id` (at most one per pass), or None."""
    return next((out for out in result.request_outputs() if out.request_id == request_id), None)


def tokens_of(result: PassResult, request_id: str) -> list[int]:
    """The tokens `request_id` emitted in the pass."""
    out = output_of(result, request_id)
    return out.new_token_ids if out is not None else []


def finished(result: PassResult, request_id: str) -> bool:
    """Whether `request_id` finished (its last output) in the pass."""
    out = output_of(result, request_id)
    return out is not None and out.finish_reason is not None


def emitted_tokens(result: PassResult) -> int:
    """Tokens the pass emitted, over all requests."""
    return sum(len(out.new_token_ids) for out in result.request_outputs())


def rejected(result: PassResult, request_id: str) -> bool:
    out = output_of(result, request_id)
    return out is not None and out.finish_reason is FinishReason.REJECTED


def source_stage(core: Engine, handoff_id: str) -> SourceStage | None:
    """This engine's source of the handoff; None when it has none."""
    seen = core.inspect_handoff(handoff_id)
    return seen.source if seen is not None else None


def destination_stage(core: Engine, handoff_id: str) -> DestinationStage | None:
    """This engine's destination of the handoff; None when it has none."""
    seen = core.inspect_handoff(handoff_id)
    return seen.destination if seen is not None else None


def source_is_held(core: Engine, handoff_id: str) -> bool:
    return source_stage(core, handoff_id) is SourceStage.HELD


def source_is_registered(core: Engine, handoff_id: str) -> bool:
    return source_stage(core, handoff_id) is not None


def destination_is_held(core: Engine, handoff_id: str) -> bool:
    """Pending or reserved: the destination is owned here and not activated yet."""
    return destination_stage(core, handoff_id) in (
        DestinationStage.PENDING,
        DestinationStage.RESERVED,
    )


def destination_block_ids(core: Engine, handoff_id: str) -> list[int]:
    seen = core.inspect_handoff(handoff_id)
    return seen.reserved_block_ids if seen is not None else []


def run_until_empty(
    core: Engine, now_ms: float = 0.0, max_passes: int = 10_000
) -> list[PassResult]:
    """Run passes back to back until the core holds no request."""
    passes: list[PassResult] = []
    for _ in range(max_passes):
        if core.is_empty():
            return passes
        result = core.execute_pass(now_ms)
        now_ms = max(result.end_ms, now_ms)
        passes.append(result)
    raise AssertionError(f"core not empty after {max_passes} passes")


def finishes(result: PassResult) -> list[tuple[str, bool]]:
    """(request id, whether it finished) of each output of the pass, in order."""
    return [(out.request_id, out.finish_reason is not None) for out in result.request_outputs()]


class Watched:
    """An engine whose whole KV event stream goes to its own reference indexer, in order.

    Commands go through `apply`/`command`: their KV events wait in `drain()` (the seed's
    `drain_kv_events()`, events caused outside a pass) until drained or until the next
    pass, which indexes them first, in the order they happened.
    """

    def __init__(self, core: Engine) -> None:
        self.core = core
        self.indexer = ReferenceIndexer(core.block_size)
        self._pending: list[KvEvent] = []

    def apply(self, cmd: Command, now_ms: float = 0.0) -> CommandEffects:
        effects = self.core.apply(cmd, now_ms=now_ms)
        self._pending += effects.kv_events
        return effects

    def command(self, cmd: Command, now_ms: float = 0.0) -> CommandResult:
        return self.apply(cmd, now_ms).result

    def execute(self, now_ms: float) -> PassResult:
        self.drain()
        result = self.core.execute_pass(now_ms)
        self.indexer.apply(result.kv_events, worker_id=self.core.worker_id)
        return result

    def drain(self) -> list[KvEvent]:
        """The KV events of the commands applied since the last pass or drain."""
        events = self._pending
        self._pending = []
        self.indexer.apply(events, worker_id=self.core.worker_id)
        return events

    def assert_clean(self) -> None:
        self.drain()
        self.indexer.assert_clean()


def num_requests(core: Engine) -> int:
    """Requests the engine holds: waiting, running or parked."""
    queues = core.queues()
    return len(queues.waiting) + len(queues.running) + len(queues.parked)


def lineage_kv(core: Engine) -> KvManager:
    """The mocker's lineage pool of `core`, for white-box tests of it."""
    kv = core.parts.kv
    assert isinstance(kv, KvManager), "the test needs semantics = mocker-1.3.0"
    return kv


def passes(core: Engine, count: int) -> list[PassResult]:
    """`count` passes back to back, each at the end of the one before."""
    results = []
    now = 0.0
    for _ in range(count):
        result = core.execute_pass(now)
        results.append(result)
        now = result.end_ms
    return results


def shares(result: PassResult) -> list[tuple[str, int, int]]:
    """A recording engine's pass: (request, computed before, tokens scheduled)."""
    assert result.trace is not None
    return [(s.request_id, s.computed, s.new) for s in result.trace.scheduled]
