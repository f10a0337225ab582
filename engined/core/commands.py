"""Commands an engine accepts between passes: submit, cancel, the handoff commands, vocabulary,
the prefix-cache reset, and vLLM's pause and sleep (engined/core/pausing.py; vLLM semantics).

Every command either succeeds with a typed result or raises a `CoreError` having changed
nothing. Every command is followed by a retry of the head of the pending-destination FIFO,
so a decode worker never waits a pass to reserve KV it already has room for; the retry runs
only when the capacity generation moved since the head last failed.
"""

from __future__ import annotations

from typing import NamedTuple

from engined.core.capacity import CapacityGeneration
from engined.core.errors import (
    CapacityError,
    DuplicateRequestError,
    HandoffConflictError,
    InvalidRequestError,
    UnsupportedError,
    handoff_repr,
)
from engined.core.finish import Finisher
from engined.core.handoff_book import HandoffBook, HeldDestination
from engined.core.intake import RequestIntake
from engined.core.kv_cache import KvCache
from engined.core.named_tuples import new_tuple
from engined.core.pause_types import PauseCommand
from engined.core.pausing import PauseControl
from engined.core.policy import AdmissionPolicy
from engined.core.state import SchedulerState
from engined.core.types import (
    APPLIED,
    NOOP,
    ActivateDestination,
    Applied,
    Cancel,
    CancelDestination,
    CancelSource,
    Command,
    CommandResult,
    DestinationAccepted,
    DestinationReserved,
    EndedRequest,
    FinishReason,
    LifecycleEvent,
    Pause,
    PauseMode,
    Refused,
    ReleaseKvCacheMemory,
    ReleaseSource,
    Request,
    RequestStatus,
    ReserveDestination,
    ResetPrefixCache,
    Resume,
    SetVocabulary,
    Sleep,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
    WakeUp,
)
from engined.core.vocab import Vocabulary, vocabulary_error

_CANCELLED = FinishReason.CANCELLED
_BLOCKS_IN_USE = "KV blocks are in use"


class CommandOutcome(NamedTuple):
    """What one command did, before the engine adds the KV events it caused."""

    result: CommandResult
    lifecycle_events: list[LifecycleEvent]
    ended: list[EndedRequest]


class Commands:
    __slots__ = (
        "_book",
        "_capacity",
        "_finisher",
        "_intake",
        "_kv",
        "_max_num_seqs",
        "_pausing",
        "_policy",
        "_state",
        "_vocab",
        "block_size",
        "num_blocks",
    )

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        intake: RequestIntake,
        state: SchedulerState,
        kv: KvCache,
        book: HandoffBook,
        finisher: Finisher,
        capacity: CapacityGeneration,
        policy: AdmissionPolicy,
        vocab: Vocabulary,
        pausing: PauseControl | None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._max_num_seqs = max_num_seqs
        self._intake = intake
        self._state = state
        self._kv = kv
        self._book = book
        self._finisher = finisher
        self._capacity = capacity
        self._policy = policy
        self._vocab = vocab
        # vLLM semantics only (None: refused).
        self._pausing = pausing

    def apply(self, command: Command, now_ms: float) -> CommandOutcome:
        """Apply `command` at `now_ms`, then retry the pending destination.

        Without offload tiers time plays no part in a command; with them, an offload the
        command causes (a reservation's eviction) starts at `now_ms`.
        """
        ended: list[EndedRequest] = []
        result: CommandResult
        match command:
            case Submit(request):
                result = Submitted(self._submit(request))
            case Cancel(request_id):
                result = self._drop(request_id, ended)
            case SubmitHandoffPrefill(handoff_id, request):
                result = Submitted(self._submit_source(handoff_id, request))
            case ReleaseSource(handoff_id):
                result = self._end_source(handoff_id, ended, drop_pending=False)
            case CancelSource(handoff_id):
                result = self._end_source(handoff_id, ended, drop_pending=True)
            case ReserveDestination(handoff_id, request):
                result = DestinationAccepted(self._reserve_destination(handoff_id, request))
            case ActivateDestination(handoff_id):
                result = self._activate_destination(handoff_id)
            case CancelDestination(handoff_id):
                result = self._cancel_destination(handoff_id, ended)
            case SetVocabulary(vocab_size, excluded):
                result = self._set_vocabulary(vocab_size, excluded)
            case ResetPrefixCache(reset_running_requests):
                result = self._reset_prefix_cache(reset_running_requests)
            case Pause() | Resume() | Sleep() | WakeUp() | ReleaseKvCacheMemory():
                result = self._pause_command(command, ended)
        if ended and self._pausing is not None:
            # vLLM's `finished_req_ids`: the next step runs to report them.
            self._pausing.finished_pending = True
        lifecycle: list[LifecycleEvent] = []
        if isinstance(result, Applied | DestinationAccepted):
            lifecycle = self.retry_pending_destinations(now_ms)
        return new_tuple(CommandOutcome, (result, lifecycle, ended))

    # --- requests -----------------------------------------------------------------------

    def _taken(self, request_id: str) -> bool:
        return request_id in self._state.requests or self._book.knows_request(request_id)

    def _new_request_id(self, request: Request) -> str:
        request_id = self._intake.request_id(request, self._taken)
        if self._taken(request_id):
            raise DuplicateRequestError(request_id)
        return request_id

    def _submit(self, request: Request) -> str:
        request_id = self._new_request_id(request)
        self._state.enqueue(self._intake.build(request, request_id, RequestStatus.WAITING))
        return request_id

    def _drop(self, request_id: str, ended: list[EndedRequest]) -> CommandResult:
        """Drop a request wherever it is; its KV is freed (or kept, if it is a held source)."""
        if not self._finisher.drop(request_id):
            return NOOP
        ended.append(EndedRequest(request_id, _CANCELLED))
        return APPLIED

    def _reset_prefix_cache(self, reset_running_requests: bool) -> CommandResult:
        if not reset_running_requests:
            return APPLIED if self._kv.reset_prefix_cache() else Refused(_BLOCKS_IN_USE)
        pausing = self._pausing
        if pausing is None:
            raise UnsupportedError("reset_running_requests needs vLLM semantics")
        pausing.reset_caches(reset_running_requests=True)
        return APPLIED

    def _pause_command(self, command: PauseCommand, ended: list[EndedRequest]) -> CommandResult:
        """vLLM's pause and sleep; an `abort` ends every request first, as cancels do, in
        the order the engine took them (vLLM's `finish_requests(None, ...)`), then the P/D
        destinations not yet activated, held ones first: vLLM aborts its requests waiting
        for remote KV with the rest, and a pause would otherwise wait on their transfers."""
        pausing = self._pausing
        if pausing is None:
            raise UnsupportedError("pause and sleep need vLLM semantics")
        pausing.validate(command)
        if isinstance(command, Pause | Sleep) and command.mode is PauseMode.ABORT:
            for request_id in list(self._state.requests):
                self._drop(request_id, ended)
            book = self._book
            for handoff_id in [*book.held.by_handoff, *book.pending.queue]:
                self._cancel_destination(handoff_id, ended)
            pausing.finished_pending = pausing.finished_pending or bool(ended)
        pausing.apply(command)
        return APPLIED

    def _set_vocabulary(self, vocab_size: int | None, excluded: tuple[int, ...]) -> CommandResult:
        error = vocabulary_error(vocab_size, excluded)
        if error is not None:
            raise InvalidRequestError(error)
        self._vocab.configure(vocab_size, excluded)
        return APPLIED

    # --- sources ------------------------------------------------------------------------

    def _submit_source(self, handoff_id: str, request: Request) -> str:
        request_id = self._new_request_id(request)
        sources = self._book.sources
        sources.validate(request_id, handoff_id)
        state = self._intake.build(request, request_id, RequestStatus.WAITING)
        sources.register(request_id, handoff_id)
        self._state.enqueue(state)
        return request_id

    def _end_source(
        self, handoff_id: str, ended: list[EndedRequest], *, drop_pending: bool
    ) -> CommandResult:
        hold = self._book.sources.pop(handoff_id)
        if hold is None:
            return NOOP
        if hold.release_moves is not None:
            self._kv.free_all(hold.release_moves)
            self._capacity.bump()
        elif drop_pending and self._finisher.drop(hold.request_id):
            ended.append(EndedRequest(hold.request_id, _CANCELLED))
        return APPLIED

    # --- destinations -------------------------------------------------------------------

    def _reserve_destination(self, handoff_id: str, request: Request) -> str:
        if not self._policy.supports_destination_reservation:
            raise UnsupportedError("destination reservation is not supported for TRT-LLM")

        request_id = self._new_request_id(request)
        book = self._book
        book.pending.validate(request_id, handoff_id)
        book.held.validate(request_id, handoff_id)
        if handoff_id in book.active:
            raise HandoffConflictError(
                f"destination handoff {handoff_repr(handoff_id)} is already active"
            )
        state = self._intake.build(request, request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        if state.seq.current_known_blocks() > self.num_blocks:
            raise CapacityError("destination prompt exceeds the KV pool capacity")
        book.pending.push(handoff_id, state)
        return request_id

    def retry_pending_destinations(self, now_ms: float) -> list[LifecycleEvent]:
        """Try to reserve KV for the head of the pending FIFO (at most one per call), at the
        `now_ms` of the pass, tier advance or command that retries."""
        generation = self._capacity.value
        pending = self._book.pending
        if len(self._state.running_members) >= self._max_num_seqs:
            pending.mark_front_attempted(generation)
            return []
        head = pending.front_due(generation)
        if head is None:
            return []
        kv = self._kv
        if head.request.offload_wait_live(kv.refresh_offload_wait):
            pending.mark_front_attempted(generation)
            return []
        reservation = kv.reserve_destination(head.request.seq, now_ms)
        pending.mark_front_attempted(generation)
        if reservation is None:
            wait = kv.take_offload_wait()
            if wait is not None:
                head.request.offload_wait = wait
            return []
        pending.pop(head.handoff_id)
        self._book.held.insert(HeldDestination(head.handoff_id, head.request, reservation))
        return [
            DestinationReserved(
                head.handoff_id, head.request.request_id, len(reservation.slots) * self.block_size
            )
        ]

    def _activate_destination(self, handoff_id: str) -> CommandResult:
        book = self._book
        held = book.held.pop(handoff_id)
        if held is None:
            return NOOP
        kv = self._kv
        active_before = kv.num_active_blocks()
        kv.activate_destination(held.reservation)
        req = held.request
        n = req.seq.num_input_tokens
        req.seq.num_allocated_tokens = n
        req.num_computed_tokens = n
        req.status = RequestStatus.WAITING
        book.active.insert(handoff_id, req.request_id)
        self._state.enqueue(req)
        if kv.num_active_blocks() < active_before:
            self._capacity.bump()
        return APPLIED

    def _cancel_destination(self, handoff_id: str, ended: list[EndedRequest]) -> CommandResult:
        book = self._book
        pending = book.pending.pop(handoff_id)
        if pending is not None:
            self._capacity.bump()
            ended.append(EndedRequest(pending.request.request_id, _CANCELLED))
            return APPLIED
        held = book.held.pop(handoff_id)
        if held is not None:
            self._kv.cancel_destination(held.reservation)
            self._capacity.bump()
            ended.append(EndedRequest(held.request.request_id, _CANCELLED))
            return APPLIED
        request_id = book.active.pop_handoff(handoff_id)
        if request_id is not None:
            if self._finisher.drop(request_id):
                ended.append(EndedRequest(request_id, _CANCELLED))
            return APPLIED
        return NOOP
