"""Property test: random handoff command sequences on a prefill core and a decode core.

Normal requests and every handoff command (duplicate handoff and request ids, unknown ids,
cancels at every stage, releases before and after completion, activations before and after
reservation, commands sent to the "wrong" core) are interleaved with passes. Whatever happens,
the cores must refuse bad commands only with documented `CoreError`s that change nothing,
keep every KV event stream valid for a router, and drain to zero active blocks once the
remaining handoffs are released or cancelled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from engined.core.args import EngineType, PrefixHitRule, Semantics, WorkerType
from engined.core.engine import Engine
from engined.core.errors import (
    CapacityError,
    CoreError,
    DuplicateRequestError,
    HandoffConflictError,
    InvalidRequestError,
)
from engined.core.types import (
    APPLIED,
    NOOP,
    ActivateDestination,
    Cancel,
    CancelDestination,
    CancelSource,
    Command,
    CommandEffects,
    DestinationAccepted,
    DestinationReserved,
    EndedRequest,
    FinishReason,
    KvEvent,
    LifecycleEvent,
    ReleaseSource,
    Request,
    ReserveDestination,
    SetVocabulary,
    SourceHeld,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
)
from engined.core.views import DestinationStage, RequestPlace
from tests.core.factories import (
    active_blocks,
    destination_block_ids,
    destination_is_held,
    destination_stage,
    make_args,
    num_requests,
    source_is_held,
    source_is_registered,
    uid,
)
from tests.reference_indexer import ReferenceIndexer

PREFILL, DECODE = 0, 1
DESTINATION_PLACES = (RequestPlace.PENDING_DESTINATION, RequestPlace.RESERVED_DESTINATION)
NUM_REQUEST_IDS = 6
NUM_HANDOFF_IDS = 6
BASE_PROMPT = list(range(1000, 1064))


def request_id(i: int) -> str:
    return uid(1_000 + i)


def handoff_id(i: int) -> str:
    return uid(2_000 + i)


# Every message the documented errors may carry (docs/upstream/dynamo-mocker.md §7.2), plus our own
# request-schema checks.
HANDOFF = r"HandoffId\([0-9a-f-]+\)"
ALLOWED_ERRORS: dict[type[CoreError], list[str]] = {
    DuplicateRequestError: [r"request \S+ is already active"],
    HandoffConflictError: [
        r"source hold already active for request \S+",
        rf"handoff {HANDOFF} is already active",
        r"destination request \S+ is already pending",
        rf"destination handoff {HANDOFF} is already pending",
        r"destination reservation already exists for request \S+",
        rf"destination handoff {HANDOFF} is already active",
    ],
    CapacityError: [r"destination prompt exceeds the KV pool capacity"],
    InvalidRequestError: [
        r"request\.token_ids must not be empty",
        r"request\.max_tokens must be >= 0",
        r"vocab_size must be in \[1, 4294967296\], got -?\d+",
        r"excluded_token_ids\[\d+\] must be >= 0, got -\d+",
        r"excluded_token_ids\[\d+\] must be < vocab_size \(\d+\), got \d+",
        r"excluded_token_ids leave none of the \d+ ids of vocab_size drawable; "
        r"at least one must remain",
    ],
}
# Which errors each command may raise at all; the others never fail.
MAY_RAISE: dict[type[Any], tuple[type[CoreError], ...]] = {
    Submit: (DuplicateRequestError, InvalidRequestError),
    SubmitHandoffPrefill: (DuplicateRequestError, HandoffConflictError, InvalidRequestError),
    ReserveDestination: (
        DuplicateRequestError,
        HandoffConflictError,
        InvalidRequestError,
        CapacityError,
    ),
    SetVocabulary: (InvalidRequestError,),
}


# --- strategies ---------------------------------------------------------------------------

cores = st.sampled_from([PREFILL, PREFILL, DECODE])
decode_cores = st.sampled_from([DECODE, DECODE, PREFILL])
request_ids = st.integers(-1, NUM_REQUEST_IDS - 1)  # -1: no id, the core mints one
handoff_ids = st.integers(0, NUM_HANDOFF_IDS - 1)
max_tokens = st.integers(-1, 6)
# Shared prefixes of one base prompt, optionally with a private tail (rarely empty).
shared_prompts = st.tuples(st.integers(0, 24), st.lists(st.integers(0, 50), max_size=6)).map(
    lambda t: BASE_PROMPT[: t[0]] + t[1]
)
prompts = st.one_of(
    shared_prompts,
    shared_prompts,
    # Tiny alphabet: equal blocks everywhere; long enough to exceed small pools.
    st.lists(st.integers(0, 2), min_size=1, max_size=48),
)

ops = st.one_of(
    st.tuples(st.just("submit"), cores, request_ids, prompts, max_tokens),
    st.tuples(st.just("cancel"), cores, request_ids),
    st.tuples(st.just("submit_prefill"), cores, handoff_ids, request_ids, prompts, max_tokens),
    st.tuples(st.just("release_source"), cores, handoff_ids),
    st.tuples(st.just("cancel_source"), cores, handoff_ids),
    st.tuples(st.just("reserve"), decode_cores, handoff_ids, request_ids, prompts, max_tokens),
    # Reserve the destination of a source the prefill core reported held (same ids, prompt).
    st.tuples(st.just("reserve_held"), st.integers(0, 7)),
    st.tuples(st.just("activate"), decode_cores, handoff_ids),
    # Activate a destination some core reported reserved (it may be gone since).
    st.tuples(st.just("activate_reserved"), st.integers(0, 7)),
    st.tuples(st.just("activate_reserved"), st.integers(0, 7)),
    st.tuples(st.just("cancel_destination"), decode_cores, handoff_ids),
    st.tuples(st.just("advance_tiers"), decode_cores),
    # Move one handoff a step along the real protocol (submit, reserve, activate, release).
    st.tuples(st.just("advance"), handoff_ids, request_ids, prompts, max_tokens),
    st.tuples(st.just("advance"), handoff_ids, request_ids, prompts, max_tokens),
    st.tuples(st.just("advance"), handoff_ids, request_ids, prompts, max_tokens),
    st.tuples(st.just("pass"), cores, st.integers(1, 8)),
    st.tuples(st.just("pass"), cores, st.integers(1, 8)),
    st.tuples(st.just("pass_both"), st.integers(1, 8)),
    st.tuples(
        st.just("set_vocabulary"),
        cores,
        st.one_of(st.none(), st.integers(-1, 6)),
        st.lists(st.integers(-1, 6), max_size=4),
    ),
)

configs = st.fixed_dictionaries(
    {
        "block_size": st.integers(2, 8),
        "num_gpu_blocks": st.integers(4, 16),
        "enable_prefix_caching": st.booleans(),
        "max_num_seqs": st.integers(1, 3),
        "max_num_batched_tokens": st.integers(4, 32),
        "prefix_hit_rule": st.sampled_from(list(PrefixHitRule)),
        "semantics": st.sampled_from(list(Semantics)),
        "vocab_size": st.one_of(st.none(), st.integers(1, 8)),
    }
)


# --- the harness --------------------------------------------------------------------------


@dataclass
class Side:
    """One core, its reference indexer and its clock."""

    core: Engine
    indexer: ReferenceIndexer
    now_ms: float = 0.0
    # Request ids the core minted (commands without an id), for the final cleanup.
    minted: set[str] = field(default_factory=set)

    def index(self, events: list[KvEvent]) -> None:
        self.indexer.apply(events, worker_id=self.core.worker_id)


@dataclass
class Harness:
    sides: list[Side]
    # Sources submitted to the prefill core with an explicit id, by (handoff id, request id).
    submitted_sources: dict[tuple[str, str], Request] = field(default_factory=dict)
    # Sources the prefill core reported held, with their request, in report order.
    held_sources: list[tuple[str, Request]] = field(default_factory=list)
    # Destinations a core reported reserved: (core, handoff id), in report order.
    reserved: list[tuple[int, str]] = field(default_factory=list)
    # (prompt length, max_tokens) of each destination request accepted, by (core, handoff id).
    destination_prompts: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)

    def snapshot(self, side: Side, command: Command) -> tuple[Any, ...]:
        core = side.core
        h = getattr(command, "handoff_id", None)
        return (
            core.metrics(),
            active_blocks(core),
            num_requests(core),
            core.is_empty(),
            core.is_drained(),
            None if h is None else source_is_registered(core, h),
            None if h is None else source_is_held(core, h),
            None if h is None else destination_is_held(core, h),
            None if h is None else destination_block_ids(core, h),
        )

    def command(self, index: int, command: Command) -> CommandEffects | None:
        """Apply one command and check what it did; None when it was (rightly) refused."""
        side = self.sides[index]
        core = side.core
        before = self.snapshot(side, command)
        registered_before = (
            source_is_registered(core, command.handoff_id)
            if isinstance(command, ReleaseSource | CancelSource)
            else None
        )
        held_ids_before = (
            destination_block_ids(core, command.handoff_id)
            if isinstance(command, ActivateDestination)
            else None
        )
        dest_held_before = (
            destination_is_held(core, command.handoff_id)
            if isinstance(command, CancelDestination)
            else None
        )
        try:
            effects = core.apply(command, now_ms=side.now_ms)
        except CoreError as error:
            note(f"  -> {type(error).__name__}: {error}")
            allowed = MAY_RAISE.get(type(command), ())
            assert isinstance(error, allowed), f"{type(command).__name__} raised {error!r}"
            patterns = ALLOWED_ERRORS[type(error)]
            assert any(re.fullmatch(p, str(error)) for p in patterns), f"message: {error}"
            assert self.snapshot(side, command) == before, "a failed command changed state"
            assert core.parts.kv.take_events() == [], "a failed command published KV events"
            return None
        note(f"  -> {effects.result!r} {effects.lifecycle_events!r}")
        side.index(effects.kv_events)
        result = effects.result
        if result == NOOP:
            assert self.snapshot(side, command) == before, "a Noop command changed state"
            assert effects.lifecycle_events == []
            assert effects.kv_events == []
            assert not effects.progressed
        if isinstance(command, ReserveDestination):
            request = command.request
            key = (index, command.handoff_id)
            self.destination_prompts[key] = (len(request.token_ids), request.max_tokens)
        self.check_lifecycle(index, effects.lifecycle_events)

        match command:
            case Submit(req):
                assert isinstance(result, Submitted)
                if req.request_id is None:
                    side.minted.add(result.request_id)
                else:
                    assert result.request_id == req.request_id
            case SubmitHandoffPrefill(h, req):
                assert isinstance(result, Submitted)
                assert source_is_registered(core, h)
                if index == PREFILL and req.request_id is not None:
                    self.submitted_sources[(h, req.request_id)] = req
                if req.request_id is None:
                    side.minted.add(result.request_id)
            case ReleaseSource(h) | CancelSource(h):
                assert result == (APPLIED if registered_before else NOOP)
                assert not source_is_registered(core, h)
            case ReserveDestination(h, req):
                assert isinstance(result, DestinationAccepted)
                if req.request_id is not None:
                    assert result.request_id == req.request_id
                else:
                    side.minted.add(result.request_id)
                assert destination_is_held(core, h)
            case ActivateDestination(h):
                assert result == (APPLIED if held_ids_before else NOOP)
                assert not destination_block_ids(core, h)
                if result == APPLIED:
                    assert not destination_is_held(core, h)
                    if not effects.lifecycle_events:
                        # Activation commits reserved blocks; it can only dedup them away.
                        assert active_blocks(core) <= before[1]
            case CancelDestination(h):
                if dest_held_before:
                    assert result == APPLIED
                if result == APPLIED:
                    assert not destination_is_held(core, h)
                    assert not destination_block_ids(core, h)
            case Cancel(rid):
                assert result == (APPLIED if before[2] > num_requests(core) else NOOP)
                seen = core.inspect(rid)
                assert seen is None or seen.place in DESTINATION_PLACES
                if result == APPLIED:
                    assert effects.ended == [EndedRequest(rid, FinishReason.CANCELLED)]
            case SetVocabulary():
                assert result == APPLIED
        return effects

    def check_lifecycle(self, index: int, events: list[LifecycleEvent]) -> None:
        core = self.sides[index].core
        bs = core.block_size
        for event in events:
            if isinstance(event, SourceHeld):
                assert source_is_held(core, event.handoff_id)
                req = self.submitted_sources.get((event.handoff_id, event.request_id))
                if index == PREFILL and req is not None:
                    self.held_sources.append((event.handoff_id, req))
            else:
                assert isinstance(event, DestinationReserved)
                self.reserved.append((index, event.handoff_id))
                assert destination_is_held(core, event.handoff_id)
                assert destination_block_ids(core, event.handoff_id)
                tokens = event.transferable_prompt_tokens
                prompt_len, max_out = self.destination_prompts[(index, event.handoff_id)]
                assert tokens % bs == 0
                assert 0 <= tokens <= -(-prompt_len // bs) * bs
                args = core.args
                if (
                    args.prefix_hit_rule is PrefixHitRule.VLLM
                    and args.engine_type is EngineType.VLLM
                    and max_out > 0
                ):
                    # The capped hit never covers the last prompt token: its block moves.
                    assert tokens >= bs

    def run_pass(self, index: int) -> None:
        side = self.sides[index]
        result = side.core.execute_pass(side.now_ms)
        side.index(result.kv_events)
        side.now_ms = max(side.now_ms, result.end_ms)
        self.check_lifecycle(index, result.lifecycle_events)
        assert result.metrics == side.core.metrics()

    def all_handoff_ids(self) -> list[str]:
        return [handoff_id(i) for i in range(NUM_HANDOFF_IDS)]

    def all_request_ids(self, index: int) -> list[str]:
        ids = [request_id(i) for i in range(NUM_REQUEST_IDS)]
        return ids + sorted(self.sides[index].minted)


def make_request(rid: int, prompt: list[int], max_out: int) -> Request:
    return Request(
        token_ids=list(prompt),
        max_tokens=max_out,
        request_id=None if rid < 0 else request_id(rid),
    )


def run_op(h: Harness, op: tuple[Any, ...]) -> None:
    note(f"{op!r}")
    match op:
        case ("submit", c, rid, prompt, max_out):
            h.command(c, Submit(make_request(rid, prompt, max_out)))
        case ("cancel", c, rid):
            if rid >= 0:
                h.command(c, Cancel(request_id(rid)))
            else:
                minted = sorted(h.sides[c].minted)
                if minted:
                    h.command(c, Cancel(minted[0]))
        case ("submit_prefill", c, hid, rid, prompt, max_out):
            h.command(c, SubmitHandoffPrefill(handoff_id(hid), make_request(rid, prompt, max_out)))
        case ("release_source", c, hid):
            h.command(c, ReleaseSource(handoff_id(hid)))
        case ("cancel_source", c, hid):
            h.command(c, CancelSource(handoff_id(hid)))
        case ("reserve", c, hid, rid, prompt, max_out):
            req = make_request(rid, prompt, max_out)
            h.command(c, ReserveDestination(handoff_id(hid), req))
        case ("reserve_held", k):
            if h.held_sources:
                hid, req = h.held_sources[k % len(h.held_sources)]
                h.command(DECODE, ReserveDestination(hid, req))
        case ("activate", c, hid):
            h.command(c, ActivateDestination(handoff_id(hid)))
        case ("activate_reserved", k):
            if h.reserved:
                c, hid = h.reserved[k % len(h.reserved)]
                h.command(c, ActivateDestination(hid))
        case ("cancel_destination", c, hid):
            h.command(c, CancelDestination(handoff_id(hid)))
        case ("advance", hid_index, rid, prompt, max_out):
            advance(h, handoff_id(hid_index), make_request(rid, prompt, max_out))
        case ("advance_tiers", c):
            # No tiers here: nothing lands, and the retry that follows finds nothing new.
            side = h.sides[c]
            advanced = side.core.advance_tiers(side.now_ms)
            note(f"  -> {advanced!r}")
            side.index(advanced.kv_events)
            assert not advanced.progressed
            h.check_lifecycle(c, advanced.lifecycle_events)
        case ("pass", c, n):
            for _ in range(n):
                h.run_pass(c)
        case ("set_vocabulary", c, vocab_size, excluded):
            h.command(c, SetVocabulary(vocab_size, tuple(excluded)))
        case ("pass_both", n):
            for _ in range(n):
                h.run_pass(PREFILL)
                h.run_pass(DECODE)
        case _:
            raise AssertionError(f"unknown op {op!r}")


def advance(h: Harness, hid: str, req: Request) -> None:
    """Take the next coordinator step of handoff `hid` (SourceFirst, as vLLM does)."""
    source, destination = h.sides[PREFILL].core, h.sides[DECODE].core
    held = [r for held_id, r in h.held_sources if held_id == hid]
    if destination_block_ids(destination, hid):
        h.command(DECODE, ActivateDestination(hid))
    elif destination_is_held(destination, hid):
        # Pending: the decode engine retries it after its next pass.
        h.run_pass(DECODE)
    elif (
        source_is_held(source, hid)
        and destination_stage(destination, hid) is DestinationStage.ACTIVE
    ):
        h.command(PREFILL, ReleaseSource(hid))
    elif source_is_held(source, hid) and held:
        h.command(DECODE, ReserveDestination(hid, held[-1]))
    elif not source_is_registered(source, hid):
        h.command(PREFILL, SubmitHandoffPrefill(hid, req))
    else:
        h.run_pass(PREFILL)


def finish(h: Harness) -> None:
    """Cancel or release whatever is left, then run passes until both cores are idle."""
    note("finish")
    for index, side in enumerate(h.sides):
        for hid in h.all_handoff_ids():
            h.command(index, ReleaseSource(hid))
            h.command(index, CancelSource(hid))
            h.command(index, CancelDestination(hid))
        for rid in h.all_request_ids(index):
            h.command(index, Cancel(rid))
        # A cancel may have reserved a pending destination that is now held: cancel again.
        for hid in h.all_handoff_ids():
            h.command(index, CancelDestination(hid))
        assert side.core.is_drained(), "everything was cancelled"
    for _ in range(8):
        if all(side.core.is_empty() and side.core.is_drained() for side in h.sides):
            break
        for index in (PREFILL, DECODE):
            h.run_pass(index)
    for side in h.sides:
        core = side.core
        assert core.is_drained()
        assert active_blocks(core) == 0
        assert core.metrics().active_blocks == 0
        assert core.metrics().running == 0
        assert core.metrics().waiting == 0
        side.indexer.assert_clean()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=configs, program=st.lists(ops, min_size=20, max_size=100))
def test_random_handoff_sequences_keep_both_cores_consistent(
    config: dict[str, Any], program: list[tuple[Any, ...]]
) -> None:
    """Random handoff traffic on a prefill and a decode core never corrupts either core.

    1. Build a prefill core (worker 1) and a decode core (worker 2) with the same small pool
       (4-16 blocks, block size 2-8, caching on or off, 1-3 sequences, budget 4-32, either
       prefix-hit rule, raw ids or a small vocabulary).
    2. Run a random program of Submit/Cancel, SubmitHandoffPrefill, Release/CancelSource,
       ReserveDestination (random, or for a source the prefill core reported held),
       Activate/CancelDestination, tier advances (the engine retries pending destinations
       after every call) and passes, and SetVocabulary (valid or not), over small id pools
       (duplicates and unknown
       ids, minted ids, empty prompts and negative max_tokens included), on either core.
    3. Release and cancel every handoff and request id left, then run passes until both cores
       are idle.

    Expected: only the documented CoreError subclasses are raised, each with a documented
    message, by the commands that may fail, and a failed command changes nothing (metrics,
    active blocks, requests, handoff state, no KV event); a Noop changes nothing either.
    Release/CancelSource are Applied exactly when the source was registered, Activate exactly
    when the destination was reserved; lifecycle events describe the core's state and a
    footprint of whole prompt blocks (under vLLM's rule at least one, when the destination
    generates). At the end both cores are drained with 0 active blocks,
    and each core's KV event stream, fed to its own reference indexer, has no violation.
    """
    sides = []
    for worker_id, worker_type in ((1, WorkerType.PREFILL), (2, WorkerType.DECODE)):
        core = Engine(make_args(worker_type=worker_type, **config), worker_id=worker_id)
        sides.append(Side(core, ReferenceIndexer(core.block_size, vllm=core.paged)))
    h = Harness(sides)
    for op in program:
        run_op(h, op)
        for side in sides:
            side.indexer.assert_clean()
    finish(h)
