"""Commands a core accepts between passes: submit, cancel, the handoff commands, vocabulary.

Every command either succeeds with a typed result or raises a `CoreError` having changed
nothing. Commands that free capacity retry the head of the pending-destination FIFO at once,
so a decode worker never waits a pass to reserve KV it already has room for.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from engined.core.errors import (
    CapacityError,
    DuplicateRequestError,
    HandoffConflictError,
    InvalidRequestError,
    UnsupportedError,
    handoff_repr,
)
from engined.core.handoff import HeldDestination
from engined.core.sequence import BlockMove, Sequence
from engined.core.state import RequestState, RequestStatus
from engined.core.types import (
    APPLIED,
    NOOP,
    ActivateDestination,
    Cancel,
    CancelDestination,
    CancelSource,
    Command,
    CommandEffects,
    CommandResult,
    DestinationAccepted,
    DestinationReserved,
    LifecycleEvent,
    ReleaseSource,
    Request,
    ReserveDestination,
    SetVocabulary,
    SourceHeld,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
    TransferTiming,
)
from engined.core.vocab import Vocabulary, vocabulary_error

if TYPE_CHECKING:
    from engined.core.args import EngineArgs
    from engined.core.handoff import (
        ActiveDestinations,
        DestinationHolds,
        PendingDestinations,
        SourceHolds,
    )
    from engined.core.kv_manager import KvManager
    from engined.core.offload.parking import SwapInParking
    from engined.core.policy import AdmissionPolicy
    from engined.core.state import SchedulerState


class CommandHandling:
    """The command half of VllmCore (kept apart so the pass stays readable)."""

    args: EngineArgs
    block_size: int
    num_blocks: int
    max_num_seqs: int
    caching: bool
    kv: KvManager
    state: SchedulerState
    policy: AdmissionPolicy
    rng: random.Random
    vocab: Vocabulary
    _partial_ids: Callable[[], int]
    source_holds: SourceHolds
    pending_destinations: PendingDestinations
    destination_holds: DestinationHolds
    active_destinations: ActiveDestinations
    swap_ins: SwapInParking
    capacity_generation: int
    _lifecycle: list[LifecycleEvent]

    def make_request_state(
        self, request: Request, request_id: str, status: RequestStatus
    ) -> RequestState:
        if not request.token_ids:
            raise InvalidRequestError("request.token_ids must not be empty")
        if request.max_tokens < 0:
            raise InvalidRequestError("request.max_tokens must be >= 0")
        planned = request.output_token_ids
        max_out = len(planned) if planned is not None else request.max_tokens
        prompt_len = len(request.token_ids)
        max_out = self.policy.clamp_max_output(prompt_len, max_out)
        seq = Sequence(
            request.token_ids,
            max_out,
            self.block_size,
            caching=self.caching,
            rng=self.rng,
            next_partial_id=self._partial_ids,
            planned=planned,
            vocab=self.vocab,
        )
        return RequestState(request_id, seq, status)

    def apply_command(self, command: Command) -> CommandResult:
        return self.apply_command_effects(command).result

    def apply_live_command(
        self, command: Command, allow_destination_admission: bool, now_ms: float
    ) -> CommandEffects:
        """`apply_command_effects` at `now_ms`: an offload the command causes starts then.

        Without offload tiers time plays no part in a command. With them, a command applied
        between passes (a live daemon's) evicts at its own time, not at the last pass's.
        """
        offload = self.kv.offload
        if offload is None:
            return self.apply_command_effects(command, allow_destination_admission)
        previous = offload.eviction_now_ms
        offload.eviction_now_ms = now_ms
        try:
            return self.apply_command_effects(command, allow_destination_admission)
        finally:
            offload.eviction_now_ms = previous

    def offload_wait_live(self, req: RequestState) -> bool:
        """Refresh `req`'s offload dependency; True while its offload is still in flight."""
        dependency = req.offload_wait
        if dependency is None:
            return False
        offload = self.kv.offload
        fresh = offload.engine.offload_wait(dependency.lease_id) if offload is not None else None
        req.offload_wait = fresh
        return fresh is not None

    def apply_command_effects(
        self, command: Command, allow_destination_admission: bool = True
    ) -> CommandEffects:
        lifecycle: list[LifecycleEvent] = []
        result: CommandResult
        match command:
            case Submit(request):
                result = Submitted(self._submit(request))
            case Cancel(request_id):
                result = self.cancel(request_id)
            case SubmitHandoffPrefill(handoff_id, request):
                request_id = self._request_id(request)
                self._validate_request_id(request_id)
                self.source_holds.validate(request_id, handoff_id)
                state = self.make_request_state(request, request_id, RequestStatus.WAITING)
                self.source_holds.register(request_id, handoff_id)
                self._enqueue(state)
                result = Submitted(request_id)
            case ReleaseSource(handoff_id):
                result = self._end_source(handoff_id, drop_pending=False)
            case CancelSource(handoff_id):
                result = self._end_source(handoff_id, drop_pending=True)
            case ReserveDestination(handoff_id, request):
                request_id = self._reserve_destination(handoff_id, request)
                result = DestinationAccepted(request_id)
                if allow_destination_admission:
                    lifecycle.extend(self.retry_pending_destinations())
                return CommandEffects(result, lifecycle)
            case ActivateDestination(handoff_id):
                result = self._activate_destination(handoff_id)
            case CancelDestination(handoff_id):
                result = self._cancel_destination(handoff_id)
            case SetVocabulary(vocab_size, excluded):
                result = self._set_vocabulary(vocab_size, excluded)
        if result is APPLIED and allow_destination_admission:
            lifecycle.extend(self.retry_pending_destinations())
        return CommandEffects(result, lifecycle)

    # --- requests -----------------------------------------------------------------------

    @staticmethod
    def _request_id(request: Request) -> str:
        return request.request_id if request.request_id is not None else str(uuid.uuid4())

    def _validate_request_id(self, request_id: str) -> None:
        if (
            request_id in self.state.requests
            or request_id in self.source_holds.by_request
            or request_id in self.pending_destinations.by_request
            or request_id in self.destination_holds.by_request
            or request_id in self.active_destinations.by_request
        ):
            raise DuplicateRequestError(request_id)

    def _submit(self, request: Request) -> str:
        request_id = self._request_id(request)
        self._validate_request_id(request_id)
        self._enqueue(self.make_request_state(request, request_id, RequestStatus.WAITING))
        return request_id

    def _enqueue(self, state: RequestState) -> None:
        self.state.requests[state.request_id] = state
        self.state.push_waiting(state.request_id)

    def cancel(self, request_id: str) -> CommandResult:
        """Drop a request wherever it is; its KV is freed (or kept, if it is a held source)."""
        if request_id not in self.state.requests:
            return NOOP
        self.drop_request(request_id)
        return APPLIED

    def drop_request(self, request_id: str) -> None:
        kv = self.kv
        active_before = kv.num_active_blocks()
        req = self.state.requests.get(request_id)
        if req is None:
            if kv.num_active_blocks() < active_before:
                self.capacity_generation += 1
            return
        if self.swap_ins.by_request:
            self.swap_ins.drop(kv, request_id)
        improved = req.seq.num_allocated_tokens > 0 or request_id in self.state.running_members
        ok = kv.apply_all(req.seq.free_moves())
        assert ok, "request drop cleanup must be infallible"
        self.source_holds.discard_request(request_id)
        self.active_destinations.discard_request(request_id)
        self.state.take(request_id)
        if improved or kv.num_active_blocks() < active_before:
            self.capacity_generation += 1

    def complete_source(self, req: RequestState, release_moves: list[BlockMove]) -> None:
        """A request finished: free its KV, or hold it if it is a handoff source."""
        request_id = req.request_id
        self.state.take(request_id)
        handoff_id = self.source_holds.hold(request_id, release_moves)
        if handoff_id is None:
            ok = self.kv.apply_all(release_moves)
            assert ok, "completion cleanup must be infallible"
        else:
            args = self.args
            timing = TransferTiming(
                args.kv_transfer_timing_mode,
                req.seq.num_input_tokens,
                args.kv_bytes_per_token,
                args.kv_transfer_bandwidth,
            )
            self._lifecycle.append(SourceHeld(handoff_id, request_id, timing))
        self.active_destinations.discard_request(request_id)
        self.capacity_generation += 1

    def _set_vocabulary(self, vocab_size: int | None, excluded: tuple[int, ...]) -> CommandResult:
        error = vocabulary_error(vocab_size, excluded)
        if error is not None:
            raise InvalidRequestError(error)
        self.vocab.configure(vocab_size, excluded)
        return APPLIED

    # --- sources ------------------------------------------------------------------------

    def _end_source(self, handoff_id: str, *, drop_pending: bool) -> CommandResult:
        hold = self.source_holds.pop(handoff_id)
        if hold is None:
            return NOOP
        if hold.release_moves is not None:
            ok = self.kv.apply_all(hold.release_moves)
            assert ok, "source release must be infallible"
            self.capacity_generation += 1
        elif drop_pending:
            self.drop_request(hold.request_id)
        return APPLIED

    def source_is_held(self, handoff_id: str) -> bool:
        hold = self.source_holds.by_handoff.get(handoff_id)
        return hold is not None and hold.release_moves is not None

    def source_is_registered(self, handoff_id: str) -> bool:
        return handoff_id in self.source_holds.by_handoff

    # --- destinations -------------------------------------------------------------------

    def _reserve_destination(self, handoff_id: str, request: Request) -> str:
        if not self.policy.supports_destination_reservation:
            raise UnsupportedError("destination reservation is not supported for TRT-LLM")
        request_id = self._request_id(request)
        self._validate_request_id(request_id)
        self.pending_destinations.validate(request_id, handoff_id)
        self.destination_holds.validate(request_id, handoff_id)
        if handoff_id in self.active_destinations:
            raise HandoffConflictError(
                f"destination handoff {handoff_repr(handoff_id)} is already active"
            )
        state = self.make_request_state(request, request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        if state.seq.current_known_blocks() > self.num_blocks:
            raise CapacityError("destination prompt exceeds the KV pool capacity")
        self.pending_destinations.push(handoff_id, state)
        return request_id

    def retry_pending_destinations(self) -> list[LifecycleEvent]:
        """Try to reserve KV for the head of the pending FIFO (at most one per call)."""
        generation = self.capacity_generation
        pending = self.pending_destinations
        if len(self.state.running_members) >= self.max_num_seqs:
            pending.mark_front_attempted(generation)
            return []
        head = pending.front_due(generation)
        if head is None:
            return []
        if self.offload_wait_live(head.request):
            pending.mark_front_attempted(generation)
            return []
        reservation = self.kv.reserve_destination(head.request.seq)
        pending.mark_front_attempted(generation)
        if reservation is None:
            blocked = self.kv.take_offload_wait()
            if blocked is not None:
                head.request.offload_wait = blocked
            return []
        pending.pop(head.handoff_id)
        self.destination_holds.insert(HeldDestination(head.handoff_id, head.request, reservation))
        return [
            DestinationReserved(
                head.handoff_id, head.request.request_id, len(reservation.slots) * self.block_size
            )
        ]

    def _activate_destination(self, handoff_id: str) -> CommandResult:
        held = self.destination_holds.pop(handoff_id)
        if held is None:
            return NOOP
        active_before = self.kv.num_active_blocks()
        self.kv.activate_destination(held.reservation)
        req = held.request
        n = req.seq.num_input_tokens
        req.seq.num_allocated_tokens = n
        req.num_computed_tokens = n
        req.status = RequestStatus.WAITING
        self.active_destinations.insert(handoff_id, req.request_id)
        self._enqueue(req)
        if self.kv.num_active_blocks() < active_before:
            self.capacity_generation += 1
        return APPLIED

    def _cancel_destination(self, handoff_id: str) -> CommandResult:
        if self.pending_destinations.pop(handoff_id) is not None:
            self.capacity_generation += 1
            return APPLIED
        held = self.destination_holds.pop(handoff_id)
        if held is not None:
            self.kv.cancel_destination(held.reservation)
            self.capacity_generation += 1
            return APPLIED
        request_id = self.active_destinations.pop_handoff(handoff_id)
        if request_id is not None:
            self.drop_request(request_id)
            return APPLIED
        return NOOP

    def destination_is_held(self, handoff_id: str) -> bool:
        return handoff_id in self.destination_holds or handoff_id in self.pending_destinations

    def destination_block_ids(self, handoff_id: str) -> list[int]:
        held = self.destination_holds.by_handoff.get(handoff_id)
        return held.reservation.block_ids() if held is not None else []
