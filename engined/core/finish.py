"""Where requests leave an engine: completion, and drops (cancel, rejection).

A request that generated its last tokens gets its last output here, whichever emitter
produced them (a plain step, an MTP burst, async scheduling's resolution), so the finish
reason and a prefill worker's handoff delay are decided in one place.
A completed request frees its KV, unless it is a registered handoff source: then its KV is
held until the coordinator releases it, and a `SourceHeld` carries the transfer timing the
coordinator needs. A dropped request frees its KV wherever it was (queued, running, parked
on an onboard). Either way the handoff tables forget it and the capacity generation moves,
so a pending destination is retried.
"""

from __future__ import annotations

from engined.core.args import EngineArgs, WorkerType
from engined.core.capacity import CapacityGeneration
from engined.core.handoff_book import HandoffBook
from engined.core.kv_cache import KvCache
from engined.core.offload.parking import OnboardParking
from engined.core.pass_context import PassContext
from engined.core.sequence import BlockMove
from engined.core.state import RequestState, SchedulerState
from engined.core.types import (
    EndedRequest,
    FinishReason,
    KvTransferTimingMode,
    RequestOutput,
    SourceHeld,
    TransferTiming,
)

_LENGTH = FinishReason.LENGTH
_STOP = FinishReason.STOP


class Finisher:
    __slots__ = ("_args", "_book", "_capacity", "_kv", "_parking", "_state", "is_prefill_worker")

    def __init__(
        self,
        state: SchedulerState,
        kv: KvCache,
        book: HandoffBook,
        parking: OnboardParking,
        capacity: CapacityGeneration,
        args: EngineArgs,
    ) -> None:
        self._state = state
        self._kv = kv
        self._book = book
        self._parking = parking
        self._capacity = capacity
        self._args = args
        self.is_prefill_worker = args.worker_type is WorkerType.PREFILL

    def handoff_delay_ms(self, prompt_len: int) -> float | None:
        """KV transfer time of a prefill worker's finished request (always the full prompt).

        Upstream's `compute_prefill_handoff_delay_ms`: the output's delay does not follow
        `kv_transfer_timing_mode`; only the coordinator's transfer does (`SourceHeld`).
        """
        if not self.is_prefill_worker:
            return None
        args = self._args
        return TransferTiming(
            KvTransferTimingMode.FULL_PROMPT,
            prompt_len,
            args.kv_bytes_per_token,
            args.kv_transfer_bandwidth,
        ).delay_ms(prompt_len)

    def finish(
        self, ctx: PassContext, req: RequestState, tokens: list[int], cleanup: list[BlockMove]
    ) -> None:
        """`req` produced its last tokens: its last output, then its KV freed or held."""
        request_id = req.request_id
        stop_reason = req.seq.stop_reason
        reason = _LENGTH if stop_reason is None else _STOP
        ctx.add_output(
            RequestOutput(
                request_id,
                tokens,
                reason,
                req.take_cached_tokens(),
                self.handoff_delay_ms(req.seq.num_input_tokens),
                stop_reason,
            )
        )
        ctx.ended.append(EndedRequest(request_id, reason))
        held = self.complete(req, cleanup)
        if held is not None:
            ctx.lifecycle.append(held)

    def transfer_timing(self, prompt_tokens: int) -> TransferTiming:
        """What a coordinator needs to model the KV transfer of a `prompt_tokens` prompt."""
        args = self._args
        return TransferTiming(
            args.kv_transfer_timing_mode,
            prompt_tokens,
            args.kv_bytes_per_token,
            args.kv_transfer_bandwidth,
        )

    def complete(self, req: RequestState, release_moves: list[BlockMove]) -> SourceHeld | None:
        """`req` finished: free its KV, or hold it if it is a handoff source (the event)."""
        request_id = req.request_id
        self._state.take(request_id)
        handoff_id = self._book.sources.hold(request_id, release_moves)
        held = None
        if handoff_id is None:
            self._kv.free_all(release_moves)
        else:
            held = SourceHeld(
                handoff_id, request_id, self.transfer_timing(req.seq.num_input_tokens)
            )
        self._book.active.discard_request(request_id)
        self._capacity.bump()
        return held

    def drop(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its KV; False if the engine has no such one.

        A held source is not a request any more: its KV stays until released.
        """
        req = self._state.requests.get(request_id)
        if req is None:
            return False
        kv = self._kv
        active_before = kv.num_active_blocks()
        parking = self._parking
        if parking.by_request:
            parking.drop(request_id)
        improved = req.seq.num_allocated_tokens > 0 or request_id in self._state.running_members
        kv.free_all(req.seq.free_moves())
        self._book.sources.discard_request(request_id)
        self._book.active.discard_request(request_id)
        self._state.take(request_id)
        if improved or kv.num_active_blocks() < active_before:
            self._capacity.bump()
        return True
