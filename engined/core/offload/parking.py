"""Onboard parking: a waiting request whose prefix is in G2 (or G3) waits for it off the queue.

docs/upstream/dynamo-mocker.md §6.3. At admission, after the policy admits a fresh request, the
blocks after its cached G1 prefix are looked up in the lower tiers. On a hit the request is
*parked*: its cached G1 prefix is pinned and exactly as many G1 slots as the onboard will
fill are reserved before the transfer starts, so nothing admitted meanwhile can take that
room or evict that prefix. The request leaves the waiting queue but keeps its id (a
duplicate is refused while it is parked).

Every pass entry (and `Engine.advance_tiers`) advances the tiers, then lands completed
onboards: their blocks become inactive G1 blocks and the requests go back to the *front* of
the queue in park order, so the admission of the same pass hits them before a cold request
can evict them. Dropping a parked request cancels its onboard; its slots and pins stay
reserved until the onboard's own completion time, when a later tick gives them back.
"""

from __future__ import annotations

import enum

from engined.core.capacity import CapacityGeneration
from engined.core.kv_cache import KvCache
from engined.core.offload.g1_glue import G1Glue
from engined.core.offload.tier_values import OnboardState
from engined.core.prefix_hit import PrefillCost
from engined.core.state import RequestState, SchedulerState


class ParkOutcome(enum.Enum):
    NO_HIT = "no_hit"  # nothing below G1 to onboard: admit the request normally
    PARKED = "parked"  # the onboard started; the request left the queue
    WAITS_ON_OFFLOAD = "waits_on_offload"  # its G1 slots wait on an offload: stop admitting


class ParkedRequest:
    __slots__ = ("onboard_id", "request_id", "skip")

    def __init__(self, request_id: str, onboard_id: int, skip: int) -> None:
        self.request_id = request_id
        self.onboard_id = onboard_id
        # Cached G1 blocks before the onboarded ones (pinned meanwhile).
        self.skip = skip

    def __repr__(self) -> str:
        return f"ParkedRequest({self.request_id!r}, onboard={self.onboard_id}, skip={self.skip})"


class OnboardParking:
    """The parked requests of one engine, in park order.

    Built from the queues, the KV manager (whose G1 glue runs the onboards: parking is used
    only while tiers are attached) and the capacity generation it bumps when a tick frees
    G1 blocks.
    """

    __slots__ = ("_block_size", "_capacity", "_kv", "_state", "by_request", "parked")

    def __init__(self, state: SchedulerState, kv: KvCache, capacity: CapacityGeneration) -> None:
        self._state = state
        self._kv = kv
        self._capacity = capacity
        self._block_size = kv.block_size
        self.parked: list[ParkedRequest] = []
        self.by_request: dict[str, ParkedRequest] = {}

    def __len__(self) -> int:
        return len(self.parked)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.by_request

    def _glue(self) -> G1Glue:
        glue = self._kv.offload
        assert glue is not None, "parking runs only with offload tiers"
        return glue

    def try_park(self, req: RequestState, now_ms: float, cost: PrefillCost) -> ParkOutcome:
        """Park `req` on a lower-tier prefix hit.

        WAITS_ON_OFFLOAD: reserving the destination slots evicted G1 blocks whose offload is
        still in flight; the request keeps waiting with that offload wait.
        """
        glue = self._glue()
        seq = req.seq
        # The resident prefix, not the hit: a block the rule recomputes is still in G1.
        skip = cost.resident_tokens // self._block_size
        keys = seq.keys
        if skip >= len(keys):
            return ParkOutcome.NO_HIT
        pins = glue.pin_prefix(keys[:skip])
        if pins is None:
            return ParkOutcome.NO_HIT
        engine = glue.engine
        plan = engine.prepare_onboard(keys[skip:])
        if plan is None:
            glue.release_pins(pins)
            return ParkOutcome.NO_HIT
        slots = glue.allocate(plan.block_count, now_ms)
        if slots is None:
            engine.abandon_onboard(plan)
            glue.release_pins(pins)
            wait = glue.take_wait()
            if wait is None:
                return ParkOutcome.NO_HIT
            req.offload_wait = wait
            return ParkOutcome.WAITS_ON_OFFLOAD
        onboard_id = engine.start_onboard(plan, slots, pins, now_ms)
        request_id = req.request_id
        self._state.remove_waiting(request_id)
        parked = ParkedRequest(request_id, onboard_id, skip)
        self.parked.append(parked)
        self.by_request[request_id] = parked
        return ParkOutcome.PARKED

    def advance(self, now_ms: float) -> None:
        """Tick the tiers to `now_ms`, then re-queue landed onboards at the front in park order."""
        kv = self._kv
        glue = self._glue()
        active_before = kv.num_active_blocks()
        glue.tick(now_ms)
        if self.parked:
            engine = glue.engine
            landed: list[tuple[ParkedRequest, int]] = []
            pending: list[ParkedRequest] = []
            for parked in self.parked:
                status = engine.onboard_status(parked.onboard_id)
                if status is None or status.state is OnboardState.CANCELLED:
                    del self.by_request[parked.request_id]
                elif status.state is OnboardState.COMPLETED:
                    landed.append((parked, status.block_count))
                else:
                    pending.append(parked)
            self.parked = pending
            for parked, count in reversed(landed):
                del self.by_request[parked.request_id]
                self._land(glue, parked, count)
        if kv.num_active_blocks() < active_before:
            self._capacity.bump()

    def _land(self, glue: G1Glue, parked: ParkedRequest, count: int) -> None:
        taken = glue.engine.take_completed_onboard(parked.onboard_id)
        assert taken is not None, "a completed onboard must be takeable"
        slots, pins = taken
        req = self._state.requests[parked.request_id]
        glue.land_onboard(req.seq, parked.skip, count, slots, pins)
        self._state.prepend_waiting(parked.request_id)

    def drop(self, request_id: str) -> bool:
        """Forget a parked request; its onboard is cancelled (ownership returns at a tick)."""
        parked = self.by_request.pop(request_id, None)
        if parked is None:
            return False
        self.parked.remove(parked)
        self._glue().engine.cancel_onboard(parked.onboard_id)
        return True
