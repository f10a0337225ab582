"""Whoever ends a request, its owner's stream ends with exactly one terminal (issue 10, 5).

Against a real paced daemon (10 ms per decode pass, 1 ms per prompt token), with raw DEALER
sockets so every message a client receives is seen and counted:

1. Another client's `cancel`: the canceller gets `applied`; the owner's stream ends with one
   token-less `cancelled` entry and nothing after it; a second cancel is a `noop`.
2. The owner's own `cancel`: the `cancelled` terminal comes first, then `applied`, then
   nothing more for the request.
3. Two other clients cancel the same request at once: one `applied`, one `noop`; the owner
   gets one terminal.
4. Another client's `cancel_destination` of a reserved destination, and its `cancel_source`
   of a running prefill: the owner's stream ends with one `cancelled` terminal.
5. `EngineClient` (what the CLI and the Dynamo worker use) sees a foreign cancel as a stream
   ending with finish_reason "cancelled", and its own cancel still ends its stream.

Unit level, a hypothesis state machine drives `Ownership` through every way a request ends
(completion, cancel, drop of its owner, handoff commands, shutdown) in any order: each
request is ended at most once, its owner is told exactly when it did not complete by
itself, and the per-identity index empties with the requests.

Every wait is bounded by a timeout; each "nothing after" is checked by a ping round trip
(replies to one client keep their order), never by waiting for silence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engined.client import EngineClient
from engined.core.types import Cancel, EndedRequest, FinishReason
from engined.server.control.ownership import HandoffRoute, Ownership
from engined.wire.control import (
    Applied,
    DaemonMessage,
    DirectReply,
    Lifecycle,
    Noop,
    Output,
    OutputEntry,
    Pong,
    ReplyDecoder,
)
from tests.server.daemon_harness import PACED_FLAGS, DaemonProcess
from tests.support import run

WAIT_S = 10.0
PACED = (
    *PACED_FLAGS,
    "--fixed-prefill-ms-per-token",
    "1",
    "--max-num-batched-tokens",
    "64",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "1024",
    "--drain-timeout",
    "1",
)
DAEMON_FLAGS = PACED  # the `daemon` fixture's (tests/server/conftest.py)
LONG = 2000  # output tokens: 20 s at 10 ms a pass, far longer than any scenario


class Raw:
    """A DEALER that keeps every daemon message it receives, in order."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seen: list[DaemonMessage] = []
        self._decoder = ReplyDecoder()
        self._ids = 0

    async def send(self, **fields: Any) -> int:
        self._ids += 1
        await self.sock.send(msgspec.msgpack.encode({**fields, "id": self._ids}))
        return self._ids

    async def until(self, done: Callable[[DaemonMessage], bool]) -> DaemonMessage:
        """The first message received, already or next, for which `done` holds."""
        for msg in self.seen:
            if done(msg):
                return msg
        async with asyncio.timeout(WAIT_S):
            while True:
                msg = self._decoder.decode(await self.sock.recv())
                self.seen.append(msg)
                if done(msg):
                    return msg

    async def reply(self, message_id: int) -> DirectReply:
        msg = await self.until(lambda m: isinstance(m, DirectReply) and m.id == message_id)
        assert isinstance(msg, DirectReply)
        return msg

    async def call(self, **fields: Any) -> DirectReply:
        return await self.reply(await self.send(**fields))

    async def submit(self, request_id: str, tokens: int = 16, max_tokens: int = LONG) -> None:
        reply = await self.call(
            type="submit",
            request={"request_id": request_id, "token_ids": [7] * tokens, "max_tokens": max_tokens},
        )
        assert type(reply).__name__ == "Submitted", reply

    async def first_output(self, request_id: str) -> None:
        await self.until(lambda m: any(e.request_id == request_id for e in _entries(m)))

    async def settle(self) -> None:
        """Everything sent to this client before now has arrived (a ping round trip)."""
        assert isinstance(await self.call(type="ping"), Pong)

    def entries(self, request_id: str) -> list[OutputEntry]:
        return [e for m in self.seen for e in _entries(m) if e.request_id == request_id]

    def terminals(self, request_id: str) -> list[OutputEntry]:
        return [e for e in self.entries(request_id) if e.finished]


def _entries(msg: DaemonMessage) -> list[OutputEntry]:
    return msg.outputs if isinstance(msg, Output) else []


def assert_cancelled_once(client: Raw, request_id: str) -> None:
    entries = client.entries(request_id)
    terminals = client.terminals(request_id)
    assert len(terminals) == 1, entries
    assert (terminals[0].token_ids, terminals[0].finish_reason) == ([], "cancelled")
    assert entries[-1] is terminals[0], "an entry followed the terminal"


@asynccontextmanager
async def clients(daemon: DaemonProcess, count: int) -> AsyncIterator[list[Raw]]:
    ctx = zmq.asyncio.Context()
    raws = [Raw(ctx, daemon.control) for _ in range(count)]
    try:
        yield raws
    finally:
        for raw in raws:
            raw.sock.close()
        ctx.term()


def test_another_clients_cancel_ends_the_owners_stream(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with clients(daemon, 2) as (owner, router):
            await owner.submit("foreign")
            await owner.first_output("foreign")
            assert isinstance(await router.call(type="cancel", request_id="foreign"), Applied)
            await owner.until(lambda m: bool([e for e in _entries(m) if e.finished]))
            await owner.settle()
            assert_cancelled_once(owner, "foreign")
            assert isinstance(await router.call(type="cancel", request_id="foreign"), Noop)
            await owner.settle()
            assert len(owner.terminals("foreign")) == 1
            # The canceller owns nothing: it got its replies and no output.
            assert not [m for m in router.seen if isinstance(m, Output)]

    run(scenario())


def test_an_owners_own_cancel_gets_the_terminal_then_applied(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with clients(daemon, 1) as (owner,):
            await owner.submit("own")
            await owner.first_output("own")
            cancel_id = await owner.send(type="cancel", request_id="own")
            assert isinstance(await owner.reply(cancel_id), Applied)
            await owner.settle()
            assert_cancelled_once(owner, "own")
            terminal = owner.terminals("own")[0]
            order = owner.seen
            at_terminal = next(i for i, m in enumerate(order) if terminal in _entries(m))
            at_applied = next(
                i for i, m in enumerate(order) if isinstance(m, Applied) and m.id == cancel_id
            )
            assert at_terminal < at_applied

    run(scenario())


def test_racing_cancels_end_the_request_once(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with clients(daemon, 3) as (owner, first, second):
            await owner.submit("raced")
            await owner.first_output("raced")
            ids = [await c.send(type="cancel", request_id="raced") for c in (first, second)]
            replies = [await c.reply(i) for c, i in zip((first, second), ids, strict=True)]
            assert sorted(type(r).__name__ for r in replies) == ["Applied", "Noop"]
            await owner.until(lambda m: bool([e for e in _entries(m) if e.finished]))
            await owner.settle()
            assert_cancelled_once(owner, "raced")

    run(scenario())


def test_another_clients_handoff_cancels_end_the_owners_stream(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with clients(daemon, 2) as (owner, coordinator):
            reply = await owner.call(
                type="reserve_destination",
                handoff_id="dest",
                request={"request_id": "d", "token_ids": [3] * 32, "max_tokens": 4},
            )
            assert type(reply).__name__ == "DestinationAccepted", reply
            await owner.until(lambda m: isinstance(m, Lifecycle))
            applied = await coordinator.call(type="cancel_destination", handoff_id="dest")
            assert isinstance(applied, Applied)

            prefill = await owner.call(
                type="submit_handoff_prefill",
                handoff_id="src",
                # 2048 prompt tokens at 1 ms each, 64 per pass: about 2 s of prefill.
                request={"request_id": "s", "token_ids": [5] * 2048, "max_tokens": 1},
            )
            assert type(prefill).__name__ == "Submitted", prefill
            applied = await coordinator.call(type="cancel_source", handoff_id="src")
            assert isinstance(applied, Applied)
            await owner.settle()
            assert_cancelled_once(owner, "d")
            assert_cancelled_once(owner, "s")
            noop = await coordinator.call(type="cancel_source", handoff_id="src")
            assert isinstance(noop, Noop)

    run(scenario())


def test_engine_client_streams_end_on_any_cancel(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with (
            await EngineClient.connect(daemon.control) as owner,
            await EngineClient.connect(daemon.control) as router,
        ):
            submitted = await owner.submit([1] * 16, LONG, request_id="ec-foreign")
            stream = owner.outputs(submitted.request_id, timeout=WAIT_S)
            await anext(stream)
            assert isinstance(await router.cancel("ec-foreign"), Applied)
            rest = [entry async for entry in stream]
            assert [(e.finished, e.finish_reason) for e in rest][-1:] == [(True, "cancelled")]

            submitted = await owner.submit([2] * 16, LONG, request_id="ec-own")
            seen = []
            async for entry in owner.outputs(submitted.request_id, timeout=WAIT_S):
                seen.append(entry)
                if len(seen) == 1:
                    assert isinstance(await owner.cancel("ec-own"), Applied)
            assert seen[-1].finish_reason == "cancelled"
            assert sum(e.finished for e in seen) == 1

    run(scenario())


# --- unit level: every path through Ownership ------------------------------------------------


class _Loop:
    """An EngineLoop's command inbox, recording the cancels it was sent."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def send(self, command: Cancel) -> None:
        self.cancelled.append(command.request_id)

    async def call(self, command: Cancel) -> None:
        self.send(command)


IDENTITIES = [b"a", b"b", b"c"]
REQUESTS = [f"r{i}" for i in range(6)]


class OwnershipMachine(RuleBasedStateMachine):
    """Requests on two ranks, ended by every path in random order."""

    @initialize()
    def start(self) -> None:
        self.loops = [_Loop(), _Loop()]
        self.told: list[tuple[bytes, int, str]] = []
        self.released: list[bytes] = []
        self.ownership = Ownership(
            self.loops,  # type: ignore[arg-type]
            notify=lambda who, rank, ids: self.told.extend((who, rank, r) for r in ids),
            released=self.released.append,
        )
        # (rank, request id) -> owner, for requests that should still be owned
        self.live: dict[tuple[int, str], bytes] = {}
        self.ended: set[tuple[int, str]] = set()
        self.completed: set[tuple[int, str]] = set()
        self.routes = 0
        # (rank, request id) -> what its claim charged its owner
        self.costs: dict[tuple[int, str], int] = {}

    @rule(
        rank=st.integers(0, 1),
        request_id=st.sampled_from(REQUESTS),
        who=st.sampled_from(IDENTITIES),
        destination=st.booleans(),
        cost=st.integers(0, 10**9),
    )
    def claim(self, rank: int, request_id: str, who: bytes, destination: bool, cost: int) -> None:
        key = (rank, request_id)
        claimed = self.ownership.claim(rank, request_id, who, cost)
        assert claimed == (key not in self.live)
        if claimed:
            self.live[key] = who
            self.costs[key] = cost
            self.ended.discard(key)
            self.completed.discard(key)
            self.told = [t for t in self.told if (t[1], t[2]) != key]
            if destination:
                handoff = f"h-{rank}-{request_id}"
                if handoff not in self.ownership.destinations:
                    route = HandoffRoute(rank, who, request_id)
                    self.ownership.add_route(self.ownership.destinations, handoff, route)

    @rule(rank=st.integers(0, 1), request_id=st.sampled_from(REQUESTS))
    def complete(self, rank: int, request_id: str) -> None:
        key = (rank, request_id)
        owner = self.ownership.owner(rank, request_id)
        self.ownership.finished(rank, request_id)
        if owner is not None:
            self.live.pop(key)
            self.completed.add(key)

    @rule(rank=st.integers(0, 1), request_id=st.sampled_from(REQUESTS), in_core=st.booleans())
    def cancel(self, rank: int, request_id: str, in_core: bool) -> None:
        key = (rank, request_id)
        assert self.ownership.end(rank, request_id, in_core=in_core) == (key in self.live)
        if self.live.pop(key, None) is not None:
            self.ended.add(key)

    @rule(rank=st.integers(0, 1), request_id=st.sampled_from(REQUESTS))
    def handoff_command(self, rank: int, request_id: str) -> None:
        handoff = f"h-{rank}-{request_id}"
        route = self.ownership.drop_route(self.ownership.destinations, handoff)
        if route is not None:
            self.ownership.end_ended(
                route.rank, [EndedRequest(route.request_id, FinishReason.CANCELLED)]
            )
            key = (route.rank, route.request_id)
            if self.live.pop(key, None) is not None:
                self.ended.add(key)

    @rule(who=st.sampled_from(IDENTITIES))
    def drop_client(self, who: bytes) -> None:
        mine = [key for key, owner in self.live.items() if owner == who]
        for loop in self.loops:
            loop.cancelled.clear()
        assert self.ownership.end_client(who) == len(mine)
        sent = [(rank, r) for rank, loop in enumerate(self.loops) for r in loop.cancelled]
        assert sorted(sent) == sorted(mine)  # the engines are told, once per request
        for key in mine:
            self.live.pop(key)
            self.ended.add(key)

    @rule()
    def shutdown(self) -> None:
        for loop in self.loops:
            loop.cancelled.clear()
        asyncio.run(self.ownership.end_all())
        for rank, request_id in self.live:
            assert request_id in self.loops[rank].cancelled  # the engine is told as well
        self.ended |= set(self.live)
        self.live.clear()

    @invariant()
    def each_early_end_told_once_and_completions_never(self) -> None:
        if not hasattr(self, "ownership"):
            return
        told = [(rank, request_id) for _, rank, request_id in self.told]
        assert len(told) == len(set(told)), self.told
        assert set(told) == self.ended
        assert not set(told) & self.completed

    @invariant()
    def index_matches_the_owners(self) -> None:
        if not hasattr(self, "ownership"):
            return
        ownership = self.ownership
        assert ownership.owned_requests() == len(self.live)
        for who in IDENTITIES:
            owns = any(owner == who for owner in self.live.values())
            has_route = any(r.identity == who for r in ownership.destinations.values())
            assert ownership.holds(who) == (owns or has_route)
        if not self.live and not ownership.destinations:
            assert ownership.clients() == 0

    @invariant()
    def each_client_is_charged_what_it_owns(self) -> None:
        if not hasattr(self, "ownership"):
            return
        for who in IDENTITIES:
            owned = sum(self.costs[key] for key, owner in self.live.items() if owner == who)
            assert self.ownership.inflight_bytes(who) == owned


TestOwnershipMachine = OwnershipMachine.TestCase
TestOwnershipMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_a_released_identity_holds_nothing() -> None:
    """`released` fires once an identity's last request and route are gone, not before."""
    loops = [_Loop()]
    released: list[bytes] = []
    ownership = Ownership(loops, notify=lambda *_: None, released=released.append)  # type: ignore[arg-type]
    ownership.claim(0, "r1", b"a")
    ownership.claim(0, "r2", b"a")
    ownership.add_route(ownership.sources, "h", HandoffRoute(0, b"a", "r2"))
    ownership.finished(0, "r1")
    ownership.end(0, "r2")
    assert released == []
    ownership.drop_route(ownership.sources, "h")
    assert released == [b"a"]
    assert not ownership.holds(b"a")
    assert ownership.clients() == 0
