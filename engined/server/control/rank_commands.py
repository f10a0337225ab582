"""The client messages that become core commands: submissions, cancels, handoff steps,
prefix-cache resets and vocabularies, each checked, applied on its rank and answered.

Apart from the control server, which reads, dispatches and delivers: these handlers are what
a command means to the ranks and to ownership (`engined.server.control.ownership`), and each awaits
its rank's report of it (`CommandReport`) before it answers.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Sequence

import msgspec

from engined.core import types as core
from engined.core.errors import CoreError
from engined.server.control.budgets import over_budget, request_bytes, text_bytes
from engined.server.control.ownership import HandoffRoute, Ownership
from engined.server.control.pauses import PAUSED_MESSAGE
from engined.server.control.request_ids import RequestIds
from engined.server.control.settings import RuntimeSettings
from engined.server.ranks.rank_handle import RankHandle
from engined.wire import control as wire
from engined.wire.convert import to_core_command

Reply = Callable[[bytes, wire.DaemonMessage], None]
# (identity, message id, error code, message): an `error` reply.
Error = Callable[[bytes, int | str | None, str, str], None]


class RankCommands:
    """Every command handler of one control server, over its ranks."""

    def __init__(
        self,
        ranks: Sequence[RankHandle],
        *,
        ownership: Ownership,
        ids: RequestIds,
        settings: RuntimeSettings,
        reply: Reply,
        error: Error,
        max_queued_requests: int,
        inflight_bytes: int,
        rejecting: Sequence[bool] = (),
    ) -> None:
        """`rejecting[rank]`: whether the rank refuses new requests, generation being paused
        (`engined.server.control.pauses`); empty: none ever does."""
        self._ranks = ranks
        self._ownership = ownership
        self._ids = ids
        self._settings = settings
        self._reply = reply
        self._error = error
        self._max_queued = max_queued_requests
        self._inflight_bytes = inflight_bytes
        self._rejecting = rejecting
        self._unnamed = itertools.count()
        self._rr = itertools.cycle(range(len(ranks)))
        # Submits refused for a full queue (`max_queued_requests`): vLLM's admission rejections.
        self.queue_refusals = 0

    def _pick_rank(self, requested: int | None) -> int | None:
        if requested is None:
            return next(self._rr)
        return requested if requested < len(self._ranks) else None

    async def submit(
        self,
        identity: bytes,
        msg: wire.Submit | wire.SubmitHandoffPrefill | wire.ReserveDestination,
    ) -> None:
        request = msg.request
        rank = self._pick_rank(request.dp_rank)
        if rank is None:
            self._error(
                identity,
                msg.id,
                "invalid_request",
                f"request.dp_rank: {request.dp_rank} is out of range [0, {len(self._ranks)})",
            )
            return
        if self._rejecting and self._rejecting[rank]:
            # vLLM's engine finishes such a request at once with a retryable error.
            self._error(identity, msg.id, "paused", PAUSED_MESSAGE)
            return
        loop = self._ranks[rank]
        capacity = loop.capacity_tokens
        # NOTE: a destination's prompt is left to the core, which refuses it with `capacity`.
        if len(request.token_ids) > capacity and not isinstance(msg, wire.ReserveDestination):
            self._error(
                identity,
                msg.id,
                "invalid_request",
                f"request.token_ids: {len(request.token_ids)} tokens exceed the KV pool "
                f"capacity of {capacity} tokens",
            )
            return
        if self._max_queued and loop.backlog() >= self._max_queued:
            self.queue_refusals += 1
            self._error(
                identity,
                msg.id,
                "overloaded",
                f"rank {rank} has {self._max_queued} queued requests",
            )
            return
        cost = request_bytes(
            len(request.token_ids),
            len(request.output_token_ids or ()),
            len(request.stop_token_ids or ()),
            text_bytes(request),
        )
        held = self._ownership.inflight_bytes(identity)
        if held + cost > self._inflight_bytes:
            self._error(
                identity, msg.id, "overloaded", over_budget(held, cost, self._inflight_bytes)
            )
            return
        # An unnamed request's tokens are keyed by its count, not by the UUID it is given.
        unnamed = None if request.request_id else next(self._unnamed)
        request_id = request.request_id or str(uuid.uuid4())
        command = to_core_command(msg, request_id=request_id, stream_name=unnamed)
        assert command is not None
        routes: dict[str, HandoffRoute] | None = None
        handoff_id = ""
        match msg:
            case wire.SubmitHandoffPrefill():
                routes, handoff_id = self._ownership.sources, msg.handoff_id
            case wire.ReserveDestination():
                routes, handoff_id = self._ownership.destinations, msg.handoff_id
        existing = None if routes is None else routes.get(handoff_id)
        if existing is not None:
            # The core that owns the handoff id must see the duplicate and refuse it.
            rank, loop = existing.rank, self._ranks[existing.rank]
        ownership = self._ownership
        core_id = request_id
        # An alias of this client's by that name is as active as the name itself.
        aliased = self._ids.core_id(identity, request_id) != request_id
        if aliased or not ownership.claim(rank, request_id, identity, cost):
            holder = ownership.owner(rank, request_id)
            own = aliased or holder == identity
            if not isinstance(msg, wire.Submit) or holder is None or own:
                self._error(
                    identity,
                    msg.id,
                    "duplicate_request",
                    f"request {request_id} is already active",
                )
                return
            # Another client's name: this request runs under an alias (request_ids).
            core_id = self._ids.alias(identity, request_id)
            command = to_core_command(msg, request_id=core_id, stream_name=request_id)
            assert command is not None and ownership.claim(rank, core_id, identity, cost)
        new_route: HandoffRoute | None = None
        if routes is not None and existing is None:
            new_route = HandoffRoute(rank, identity, request_id)
            ownership.add_route(routes, handoff_id, new_route)
        try:
            report = await loop.call(command)
        except CoreError as exc:
            ownership.disown(rank, core_id, identity)
            self._ids.forget(core_id)
            if routes is not None and new_route is not None and routes.get(handoff_id) is new_route:
                ownership.drop_route(routes, handoff_id)
            self._error(identity, msg.id, exc.code, str(exc))
            return
        if isinstance(report.result, core.DestinationAccepted):
            self._reply(
                identity, wire.DestinationAccepted(id=msg.id, request_id=request_id, dp_rank=rank)
            )
        else:
            self._reply(identity, wire.Submitted(id=msg.id, request_id=request_id, dp_rank=rank))

    async def cancel(self, identity: bytes, msg: wire.Cancel, operator: bool) -> None:
        """A client cancels its own requests, an operator anyone's; another client's
        request is answered as an unknown one (`noop`), so ids of others do not leak.

        The owner's stream ends with one `cancelled` terminal, sent before the canceller's
        `applied`, so it comes first when the owner is the canceller.
        """
        ownership = self._ownership
        request_id = self._ids.core_id(identity, msg.request_id)
        cancel = to_core_command(msgspec.structs.replace(msg, request_id=request_id))
        for rank in ownership.ranks_owning(request_id):
            if not operator and ownership.owner(rank, request_id) != identity:
                continue
            report = await self._ranks[rank].call(cancel)
            if isinstance(report.result, core.Applied):
                self._ownership.end(rank, request_id)
                self._reply(identity, wire.Applied(id=msg.id))
                return
        self._reply(identity, wire.Noop(id=msg.id))

    async def handoff(
        self,
        identity: bytes,
        msg: wire.ReleaseSource
        | wire.CancelSource
        | wire.ActivateDestination
        | wire.CancelDestination,
        routes: dict[str, HandoffRoute],
    ) -> None:
        """From any client: a handoff id is a capability, shared by the parties of one
        handoff (Dynamo's decode worker releases the source its prefill worker registered,
        on another connection); Dynamo's are uuids, and an id nobody else can guess is
        what keeps others off (protocol §1.7)."""
        route = routes.get(msg.handoff_id)
        if route is None:
            self._reply(identity, wire.Noop(id=msg.id))
            return
        command = to_core_command(msg)
        assert command is not None
        loop = self._ranks[route.rank]
        report = await loop.call(command)
        applied = isinstance(report.result, core.Applied)
        if applied and isinstance(msg, wire.ActivateDestination):
            route.deadline = None
        if applied and not isinstance(msg, wire.ActivateDestination):
            if routes.get(msg.handoff_id) is route:
                self._ownership.drop_route(routes, msg.handoff_id)
            self._ownership.end_ended(route.rank, report.ended)
        self._reply(identity, wire.Applied(id=msg.id) if applied else wire.Noop(id=msg.id))

    async def reset_prefix_cache(self, identity: bytes, msg: wire.ResetPrefixCache) -> None:
        ranks = range(len(self._ranks)) if msg.dp_rank is None else [msg.dp_rank]
        if msg.dp_rank is not None and msg.dp_rank >= len(self._ranks):
            self._error(
                identity, msg.id, "invalid_request", f"dp_rank: {msg.dp_rank} is out of range"
            )
            return
        refused = []
        reset = to_core_command(msg)
        for rank in ranks:
            try:
                report = await self._ranks[rank].call(reset)
            except CoreError as exc:
                # `reset_running_requests` under mocker semantics, or vLLM's failed reset.
                self._error(identity, msg.id, exc.code, str(exc))
                return
            if not isinstance(report.result, core.Applied):
                refused.append(rank)
        if refused:
            self._error(
                identity,
                msg.id,
                "invalid_request",
                f"reset_prefix_cache: rank(s) {refused} still hold KV blocks in use",
            )
        else:
            self._reply(identity, wire.Applied(id=msg.id))

    async def set_vocabulary(self, identity: bytes, msg: wire.SetVocabulary) -> None:
        """Every rank or none: the cores validate alike, so only the first can refuse."""
        command = to_core_command(msg)
        for loop in self._ranks:
            try:
                await loop.call(command)
            except CoreError as exc:
                self._error(identity, msg.id, exc.code, str(exc))
                return
        self._settings.vocabulary_applied(msg.vocab_size, msg.excluded_token_ids)
        self._reply(identity, wire.Applied(id=msg.id))

    async def set_weight_version(self, identity: bytes, msg: wire.SetWeightVersion) -> None:
        """Every rank in turn, once the outputs of its passes so far are here (a worker
        process answers `fresh_gauges` after them), so that a pass's outputs carry the
        version in force when it ran, as each vLLM step's outputs do."""
        versions = self._settings.weight_versions
        for rank, loop in enumerate(self._ranks):
            await loop.fresh_gauges()
            if msg.weight_version == wire.DEFAULT_WEIGHT_VERSION:
                versions.pop(rank, None)
            else:
                versions[rank] = msg.weight_version
        self._reply(identity, wire.Applied(id=msg.id))

    def set_fpm_worker_id(self, identity: bytes, msg: wire.SetFpmWorkerId) -> None:
        """Kept by the daemon (`RuntimeSettings`), which stamps the ranks' FPM with it."""
        if msg.dp_rank is not None and msg.dp_rank >= len(self._ranks):
            self._error(
                identity,
                msg.id,
                "invalid_request",
                f"dp_rank: {msg.dp_rank} is out of range [0, {len(self._ranks)})",
            )
        else:
            self._settings.set_fpm_worker_id(msg.worker_id, msg.dp_rank)
            self._reply(identity, wire.Applied(id=msg.id))
