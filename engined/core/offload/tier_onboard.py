"""Onboards: a request's missing prefix copied back to G1 from G2, staging G3 through G2.

The upstream contract (`prepare_onboard_prefix` / `start_onboard_prefix`, coordinator
leases):

* Prepare looks the keys after the cached G1 prefix up. G2 only: the G2 prefix hit, pinned
  now. With G3: a presence-only plan of the contiguous G2 prefix then a contiguous G3 run;
  when the run is non-empty and G2 can reserve room for it, a *staging* plan; otherwise the
  G2 prefix alone (pinned), or nothing.
* The caller reserves exactly `plan.block_count` destination G1 slots, then starts. A direct
  onboard is one G2->G1 transfer of `count * block_bytes` at `now`. A staged one first copies
  the G3 run into freshly allocated G2 slots over the G3->G2 link (status Pending(0)); at the
  tick where that lands, the blocks are registered in G2 and the G2->G1 transfer of the
  whole prefix starts at that tick's `now`.
* A completed onboard keeps its slots and prefix pins until the caller takes them. A
  cancelled one keeps them until its own transfer ends, then is reaped at that tick.
  Its G2 blocks stay pinned for the lifetime of the onboard either way.

Ordering rules: staged onboards whose staging lands in one tick start their G2->G1 transfers
in onboard id order; cancelled onboards are reaped in id order.
"""

from __future__ import annotations

from engined.core.offload.lanes import LanePair
from engined.core.offload.tier import Tier
from engined.core.offload.tier_values import (
    LandedOnboard,
    OnboardState,
    OnboardStatus,
    ReapedOnboard,
)


class OnboardPlan:
    """A prepared lookup, not yet started: pins or a G2 reservation it must give back.

    Start it with `TierEngine.start_onboard` or drop it with `abandon_onboard`; either
    spends it. `keys` are the keys it will land in G1, in order.
    """

    __slots__ = ("g2_blocks", "keys", "spent", "stage_count")

    def __init__(self, keys: list[int], g2_blocks: list[int], stage_count: int) -> None:
        self.keys = keys
        self.g2_blocks = g2_blocks
        self.stage_count = stage_count
        self.spent = False

    @property
    def block_count(self) -> int:
        """How many destination G1 slots the caller must reserve before starting."""
        return len(self.keys)

    @property
    def is_staged(self) -> bool:
        return self.stage_count > 0


class _Staging:
    __slots__ = ("dst_slots", "g3_blocks", "keys", "reserved", "transfer_id")

    def __init__(
        self, keys: list[int], g3_blocks: list[int], dst_slots: list[int], reserved: int
    ) -> None:
        self.keys = keys
        self.g3_blocks = g3_blocks
        self.dst_slots = dst_slots
        self.reserved = reserved
        self.transfer_id = -1


class _Onboard:
    __slots__ = (
        "cancel_requested",
        "count",
        "g2_blocks",
        "id",
        "pins",
        "slots",
        "staging",
        "state",
    )

    def __init__(
        self, onboard_id: int, slots: list[int], pins: list[int], g2_blocks: list[int]
    ) -> None:
        self.id = onboard_id
        self.slots = slots
        self.pins = pins
        self.g2_blocks = g2_blocks
        self.count = 0
        self.state = OnboardState.PENDING
        self.cancel_requested = False
        self.staging: _Staging | None = None


class Onboards:
    """Every live onboard of one engine, keyed by id."""

    __slots__ = (
        "_block_bytes",
        "_by_onboard",
        "_by_stage",
        "_cancelled",
        "_landed",
        "_leases",
        "g2",
        "g3",
        "local",
        "shared",
    )

    def __init__(
        self, g2: Tier, g3: Tier | None, local: LanePair, shared: LanePair | None, block_bytes: int
    ) -> None:
        self.g2 = g2
        self.g3 = g3
        self.local = local
        self.shared = shared
        self._block_bytes = block_bytes
        self._leases: dict[int, _Onboard] = {}
        self._by_onboard: dict[int, _Onboard] = {}
        self._by_stage: dict[int, _Onboard] = {}
        self._landed: list[_Onboard] = []
        self._cancelled: dict[int, _Onboard] = {}

    def __len__(self) -> int:
        return len(self._leases)

    # --- prepare ------------------------------------------------------------------------

    def prepare(self, keys: list[int]) -> OnboardPlan | None:
        g2 = self.g2
        g3 = self.g3
        if not keys:
            return None
        if g3 is None:
            return self._pin_g2_prefix(keys, len(keys))
        prefix = 0
        while prefix < len(keys) and g2.contains(keys[prefix]):
            prefix += 1
        run = 0
        while prefix + run < len(keys) and g3.contains(keys[prefix + run]):
            run += 1
        if run and g2.try_reserve(run):
            return OnboardPlan(keys[: prefix + run], [], run)
        return self._pin_g2_prefix(keys, prefix)

    def _pin_g2_prefix(self, keys: list[int], limit: int) -> OnboardPlan | None:
        g2 = self.g2
        pins: list[int] = []
        for key in keys[:limit]:
            block_id = g2.match(key)
            if block_id is None:
                break
            pins.append(block_id)
        if not pins:
            return None
        return OnboardPlan(keys[: len(pins)], pins, 0)

    def abandon(self, plan: OnboardPlan) -> None:
        _spend(plan)
        for block_id in plan.g2_blocks:
            self.g2.release(block_id)
        self.g2.release_reservation(plan.stage_count)

    # --- start --------------------------------------------------------------------------

    def start(
        self,
        onboard_id: int,
        plan: OnboardPlan,
        slots: list[int],
        pins: list[int],
        now_ms: float,
        worker_ms: float,
    ) -> None:
        if len(slots) != plan.block_count:
            raise ValueError(
                f"onboard needs {plan.block_count} destination slots, got {len(slots)}"
            )
        _spend(plan)
        lease = _Onboard(onboard_id, list(slots), list(pins), list(plan.g2_blocks))
        self._leases[onboard_id] = lease
        if plan.is_staged:
            self._start_staging(lease, plan, worker_ms)
        else:
            self._start_onboard(lease, now_ms)

    def _start_onboard(self, lease: _Onboard, now_ms: float) -> None:
        lease.count = len(lease.g2_blocks)
        if lease.count == 0:
            lease.state = OnboardState.COMPLETED
            return
        self.local.drain(now_ms)
        transfer_id = self.local.onboard.link.start(now_ms, lease.count * self._block_bytes)
        self._by_onboard[transfer_id] = lease

    def _start_staging(self, lease: _Onboard, plan: OnboardPlan, worker_ms: float) -> None:
        """Pin the G2 prefix and the G3 run, allocate G2 room, start the G3->G2 copy.

        Keys that vanished since prepare cut the plan short (the contiguous part is kept);
        with nothing left to stage the onboard proceeds from G2 alone.
        """
        g2 = self.g2
        g3 = self.g3
        shared = self.shared
        assert g3 is not None and shared is not None
        prefix = plan.block_count - plan.stage_count
        for key in plan.keys[:prefix]:
            block_id = g2.match(key)
            if block_id is None:
                break
            lease.g2_blocks.append(block_id)
        stage_keys: list[int] = []
        g3_blocks: list[int] = []
        if len(lease.g2_blocks) == prefix:
            for key in plan.keys[prefix:]:
                block_id = g3.match(key)
                if block_id is None:
                    break
                stage_keys.append(key)
                g3_blocks.append(block_id)
        dst_slots = g2.allocate(len(stage_keys)) if stage_keys else None
        if dst_slots is None:
            for block_id in g3_blocks:
                g3.release(block_id)
            g2.release_reservation(plan.stage_count)
            self._start_onboard(lease, worker_ms)
            return
        staging = _Staging(stage_keys, g3_blocks, dst_slots, plan.stage_count)
        shared.drain(worker_ms)
        staging.transfer_id = shared.onboard.link.start(
            worker_ms, len(stage_keys) * self._block_bytes
        )
        lease.staging = staging
        self._by_stage[staging.transfer_id] = lease

    # --- progress -----------------------------------------------------------------------

    def stage_landed(self, transfer_id: int) -> None:
        """A G3->G2 copy finished: register the blocks in G2, keep them pinned."""
        lease = self._by_stage.pop(transfer_id)
        staging = lease.staging
        assert staging is not None and self.g3 is not None
        g2 = self.g2
        g3 = self.g3
        for slot, key, g3_block in zip(
            staging.dst_slots, staging.keys, staging.g3_blocks, strict=True
        ):
            lease.g2_blocks.append(g2.register(slot, key, g3.parent_of(key)))
            g3.release(g3_block)
        g2.release_reservation(staging.reserved)
        lease.staging = None
        self._landed.append(lease)

    def onboard_done(self, transfer_id: int) -> int | None:
        """A G2->G1 copy finished; the onboard id when someone still wants it."""
        lease = self._by_onboard.pop(transfer_id)
        lease.state = OnboardState.COMPLETED
        return None if lease.cancel_requested else lease.id

    def pump(self, now_ms: float) -> None:
        """Start the G2->G1 hop of every onboard whose staging landed at this tick."""
        landed = sorted(self._landed, key=lambda lease: lease.id)
        self._landed = []
        for lease in landed:
            if lease.cancel_requested:
                lease.state = OnboardState.CANCELLED
            else:
                self._start_onboard(lease, now_ms)

    def reap(self) -> list[ReapedOnboard]:
        """Give back cancelled onboards whose transfers have ended, in id order."""
        reaped: list[ReapedOnboard] = []
        for onboard_id in sorted(self._cancelled):
            lease = self._cancelled[onboard_id]
            if lease.state is OnboardState.PENDING:
                continue
            del self._cancelled[onboard_id]
            self._drop(lease)
            reaped.append(ReapedOnboard(onboard_id, lease.slots, lease.pins))
        return reaped

    # --- caller-facing ------------------------------------------------------------------

    def status(self, onboard_id: int) -> OnboardStatus | None:
        lease = self._leases.get(onboard_id)
        if lease is None:
            return None
        if lease.cancel_requested:
            return OnboardStatus(OnboardState.CANCELLED, lease.count)
        return OnboardStatus(lease.state, lease.count)

    def take_completed(self, onboard_id: int) -> LandedOnboard | None:
        lease = self._leases.get(onboard_id)
        if lease is None or lease.cancel_requested or lease.state is not OnboardState.COMPLETED:
            return None
        self._drop(lease)
        return LandedOnboard(lease.slots, lease.pins)

    def cancel(self, onboard_id: int) -> bool:
        lease = self._leases.get(onboard_id)
        if lease is None or lease.cancel_requested:
            return False
        lease.cancel_requested = True
        self._cancelled[onboard_id] = lease
        return True

    def _drop(self, lease: _Onboard) -> None:
        del self._leases[lease.id]
        for block_id in lease.g2_blocks:
            self.g2.release(block_id)


def _spend(plan: OnboardPlan) -> None:
    if plan.spent:
        raise RuntimeError("an onboard plan can be started or abandoned only once")
    plan.spent = True
