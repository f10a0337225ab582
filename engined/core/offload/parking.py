"""Swap-in parking: a waiting request whose prefix is in G2 (or G3) waits for it off the queue.

mocker-1.3.0.md §9.5. At admission, after the policy admits a fresh request, the blocks
after its cached G1 prefix are looked up in the lower tiers. On a hit the request is
*parked*: its cached G1 prefix is pinned and exactly as many G1 slots as the copy will fill
are reserved before the transfer starts, so nothing admitted meanwhile can take that room or
evict that prefix. The request leaves the waiting queue but keeps its id (a duplicate is
refused while it is parked).

Every pass entry (and `tick_offload_only`) advances the tiers, then lands completed copies:
their blocks become inactive G1 blocks and the requests go back to the *front* of the queue
in park order, so the admission of the same pass hits them before a cold request can evict
them. Dropping a parked request cancels its copy; its slots and pins stay reserved until the
copy's own completion time, when a later tick gives them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engined.core.offload.types import OnboardState

if TYPE_CHECKING:
    from engined.core.commands import CommandHandling
    from engined.core.kv_manager import KvManager
    from engined.core.prefix_hit import PrefillCost
    from engined.core.state import RequestState

NO_HIT = 0
PARKED = 1
BLOCKED = 2


class ParkedSwapIn:
    __slots__ = ("request_id", "skip", "swap_in_id")

    def __init__(self, request_id: str, swap_in_id: int, skip: int) -> None:
        self.request_id = request_id
        self.swap_in_id = swap_in_id
        # Cached G1 blocks before the swapped-in ones (pinned meanwhile).
        self.skip = skip

    def __repr__(self) -> str:
        return f"ParkedSwapIn({self.request_id!r}, swap_in={self.swap_in_id}, skip={self.skip})"


class SwapInParking:
    """The parked requests of one core, in park order."""

    __slots__ = ("by_request", "parked")

    def __init__(self) -> None:
        self.parked: list[ParkedSwapIn] = []
        self.by_request: dict[str, ParkedSwapIn] = {}

    def __len__(self) -> int:
        return len(self.parked)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.by_request

    def try_park(
        self, core: CommandHandling, req: RequestState, now_ms: float, cost: PrefillCost
    ) -> int:
        """Park `req` on a lower-tier prefix hit: NO_HIT, PARKED, or BLOCKED (stop admitting).

        BLOCKED: reserving the destination slots evicted G1 blocks whose offload is still in
        flight; the request keeps waiting with that dependency.
        """
        kv = core.kv
        offload = kv.offload
        assert offload is not None
        seq = req.seq
        # The resident prefix, not the hit: a block the rule recomputes is still in G1.
        skip = cost.resident_tokens // core.block_size
        keys = seq.keys
        if skip >= len(keys):
            return NO_HIT
        pins = offload.pin_prefix(kv, keys[:skip])
        if pins is None:
            return NO_HIT
        engine = offload.engine
        plan = engine.prepare_onboard(keys[skip:])
        if plan is None:
            offload.release_pins(kv, pins)
            return NO_HIT
        slots = offload.allocate(kv, plan.block_count)
        if slots is None:
            engine.abandon_onboard(plan)
            offload.release_pins(kv, pins)
            blocked = offload.take_blocked()
            if blocked is None:
                return NO_HIT
            req.offload_wait = blocked
            return BLOCKED
        swap_in_id = engine.start_onboard(plan, slots, pins, now_ms)
        request_id = req.request_id
        core.state.remove_waiting(request_id)
        parked = ParkedSwapIn(request_id, swap_in_id, skip)
        self.parked.append(parked)
        self.by_request[request_id] = parked
        return PARKED

    def tick_and_promote(self, core: CommandHandling, now_ms: float) -> None:
        """Advance the tiers, then re-queue completed swap-ins at the front in park order."""
        kv = core.kv
        offload = kv.offload
        assert offload is not None
        active_before = kv.num_active_blocks()
        offload.tick(kv, now_ms)
        if self.parked:
            engine = offload.engine
            completed: list[tuple[ParkedSwapIn, int]] = []
            pending: list[ParkedSwapIn] = []
            for parked in self.parked:
                status = engine.onboard_status(parked.swap_in_id)
                if status is None or status.state is OnboardState.CANCELLED:
                    del self.by_request[parked.request_id]
                elif status.state is OnboardState.COMPLETED:
                    completed.append((parked, status.block_count))
                else:
                    pending.append(parked)
            self.parked = pending
            for parked, count in reversed(completed):
                del self.by_request[parked.request_id]
                self._land(core, parked, count)
        if kv.num_active_blocks() < active_before:
            core.capacity_generation += 1

    def _land(self, core: CommandHandling, parked: ParkedSwapIn, count: int) -> None:
        kv = core.kv
        offload = kv.offload
        assert offload is not None
        taken = offload.engine.take_completed_onboard(parked.swap_in_id)
        assert taken is not None, "a completed swap-in must be takeable"
        slots, pins = taken
        req = core.state.requests[parked.request_id]
        offload.land_swap_in(kv, req.seq, parked.skip, count, slots, pins)
        core.state.prepend_waiting(parked.request_id)

    def drop(self, kv: KvManager, request_id: str) -> bool:
        """Forget a parked request; its copy is cancelled (ownership returns at a tick)."""
        parked = self.by_request.pop(request_id, None)
        if parked is None:
            return False
        self.parked.remove(parked)
        offload = kv.offload
        assert offload is not None
        offload.engine.cancel_onboard(parked.swap_in_id)
        return True
