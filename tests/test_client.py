"""EngineClient against a scripted fake daemon (a ROUTER in the test), over real ipc sockets.

The fake decodes each client message with the real `ControlDecoder` and answers with what
the test's handler returns, in order, so a test controls exactly what the client sees and
when. Every wait has a timeout; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import zmq
import zmq.asyncio

from engined.client import ClientClosedError, EngineClient, EngineError, ProtocolError
from engined.core.args import EngineType, WorkerType
from engined.wire.control import (
    Applied,
    Cancel,
    ClientMessage,
    ControlDecoder,
    DaemonMessage,
    DestinationAccepted,
    DestinationReservedEvent,
    ErrorReply,
    Hello,
    Lifecycle,
    Noop,
    Output,
    OutputEntry,
    Ping,
    Pong,
    RankStats,
    ReleaseSource,
    ReplyDecoder,
    ReserveDestination,
    ResetPrefixCache,
    SourceHeldEvent,
    Stats,
    StatsReply,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
    Welcome,
    WireError,
    encode_reply,
)
from engined.zmq_sockets import SocketRegistry

WAIT_S = 5.0

Handler = Callable[[ClientMessage], list[DaemonMessage]]

T = TypeVar("T")


def async_test(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop (pytest-asyncio is not installed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout=30))

    return wrapper


def welcome(message_id: int | str | None) -> Welcome:
    return Welcome(
        id=message_id,
        protocol=1,
        version="0.1.0",
        engine_type=EngineType.VLLM,
        worker_type=WorkerType.AGGREGATED,
        block_size=16,
        num_gpu_blocks=1024,
        dp_size=1,
        model_name="fake",
        kv_events_endpoints=["tcp://127.0.0.1:5557"],
        kv_replay_endpoints=[],
        fpm_endpoints=["tcp://127.0.0.1:20380"],
    )


def entry(
    request_id: str, tokens: list[int], *, finished: bool = False, **extra: Any
) -> OutputEntry:
    return OutputEntry(
        request_id=request_id,
        token_ids=tokens,
        finished=finished,
        finish_reason="length" if finished else None,
        **extra,
    )


def basic(msg: ClientMessage) -> list[DaemonMessage]:
    """A daemon that answers everything and streams nothing."""
    match msg:
        case Hello():
            return [welcome(msg.id)]
        case Ping():
            return [Pong(id=msg.id)]
        case Stats():
            ranks = [
                RankStats(
                    dp_rank=0,
                    active_blocks=1,
                    inactive_blocks=2,
                    total_blocks=3,
                    kv_cache_usage=0.5,
                    running=1,
                    waiting=0,
                    preemptions_total=0,
                    passes_total=9,
                )
            ]
            return [StatsReply(id=msg.id, ranks=ranks)]
        case ResetPrefixCache():
            return [Applied(id=msg.id)]
        case Submit():
            return [Submitted(id=msg.id, request_id=msg.request.request_id or "minted", dp_rank=0)]
        case _:
            return [Noop(id=msg.id)]


class FakeDaemon:
    """A ROUTER that records what it receives and sends back what `handler` returns."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        registry: SocketRegistry,
        endpoint: str,
        handler: Handler,
        *,
        delimiter: bool = False,
    ) -> None:
        self.sock = registry.make(ctx, zmq.ROUTER, endpoint, bind=True, linger=0)
        self.endpoint = endpoint
        self.handler = handler
        self.delimiter = delimiter  # reply with a REQ-style empty frame before the body
        self.received: list[ClientMessage | WireError] = []
        self.identities: list[bytes] = []
        self._arrived = asyncio.Condition()
        self._decoder = ControlDecoder()

    async def serve(self) -> None:
        while True:
            identity, body = await self.sock.recv_multipart()
            self.identities.append(identity)
            try:
                msg = self._decoder.decode(body)
            except WireError as exc:
                self.received.append(exc)
                replies: list[DaemonMessage] = [
                    ErrorReply(id=exc.message_id, code=exc.code, message=exc.message)
                ]
            else:
                self.received.append(msg)
                replies = self.handler(msg)
            for reply in replies:
                envelope = [identity, b""] if self.delimiter else [identity]
                await self.sock.send_multipart([*envelope, encode_reply(reply)])
            async with self._arrived:
                self._arrived.notify_all()

    async def wait_received(self, count: int) -> None:
        """Until `count` messages have been received and answered."""
        async with self._arrived:
            await asyncio.wait_for(
                self._arrived.wait_for(lambda: len(self.received) >= count), WAIT_S
            )


@contextlib.asynccontextmanager
async def daemon_and_client(
    tmp_path: Path, handler: Handler = basic, *, delimiter: bool = False
) -> AsyncIterator[tuple[FakeDaemon, EngineClient]]:
    ctx = zmq.asyncio.Context()
    registry = SocketRegistry()
    task: asyncio.Task[None] | None = None
    try:
        daemon = FakeDaemon(
            ctx, registry, f"ipc://{tmp_path / 'ctl'}", handler, delimiter=delimiter
        )
        task = asyncio.create_task(daemon.serve())
        client = await EngineClient.connect(daemon.endpoint, ctx=ctx)
        async with client:
            yield daemon, client
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        registry.close()
        ctx.term()


async def collect(stream: AsyncIterator[T]) -> list[T]:
    return [e async for e in stream]


class TestDirectReplies:
    @pytest.mark.parametrize("delimiter", [False, True], ids=["dealer", "req-envelope"])
    @async_test
    async def test_calls_get_the_reply_with_their_id(self, tmp_path: Path, delimiter: bool) -> None:
        """Every message carries a fresh int id; each call returns the reply echoing it."""
        async with daemon_and_client(tmp_path, delimiter=delimiter) as (daemon, client):
            hello = await client.hello()
            assert hello.model_name == "fake"
            assert isinstance(await client.ping(), Pong)
            stats = await client.stats()
            assert stats.ranks[0].passes_total == 9
            assert isinstance(await client.reset_prefix_cache(dp_rank=0), Applied)
            assert isinstance(await client.release_source("h-unknown"), Noop)
            ids = [m.id for m in daemon.received if not isinstance(m, WireError)]
            assert ids == [1, 2, 3, 4, 5]
            assert isinstance(daemon.received[3], ResetPrefixCache)
            assert daemon.received[3].dp_rank == 0

    @async_test
    async def test_concurrent_calls_are_matched_by_id(self, tmp_path: Path) -> None:
        """1. the daemon answers each pair of messages in reverse order.

        Result: each call still gets its own reply.
        """
        held: list[ClientMessage] = []

        def reverse_pairs(msg: ClientMessage) -> list[DaemonMessage]:
            held.append(msg)
            if len(held) < 2:
                return []
            replies = [basic(m)[0] for m in reversed(held)]
            held.clear()
            return replies

        async with daemon_and_client(tmp_path, reverse_pairs) as (_, client):
            hello, pong = await asyncio.gather(client.hello(), client.ping())
            assert isinstance(hello, Welcome)
            assert isinstance(pong, Pong)

    @async_test
    async def test_error_reply_raises_engine_error(self, tmp_path: Path) -> None:
        def refuse(msg: ClientMessage) -> list[DaemonMessage]:
            return [
                ErrorReply(
                    id=msg.id, code="duplicate_request", message="request r1 is already active"
                )
            ]

        async with daemon_and_client(tmp_path, refuse) as (_, client):
            with pytest.raises(EngineError, match="already active") as info:
                await client.submit([1, 2, 3], 4, request_id="r1")
            assert info.value.code == "duplicate_request"
            assert info.value.message == "request r1 is already active"

    @async_test
    async def test_wrong_reply_type_is_a_protocol_error(self, tmp_path: Path) -> None:
        async with daemon_and_client(tmp_path, lambda m: [Pong(id=m.id)]) as (_, client):
            with pytest.raises(ProtocolError, match="welcome"):
                await client.hello()

    @async_test
    async def test_timeout_then_late_reply_is_not_misrouted(self, tmp_path: Path) -> None:
        """1. the daemon holds the first ping; the call times out.
        2. a raw ping: the daemon first sends the late pong of (1), then the raw one's.

        Result: TimeoutError; send_raw returns its own pong, not the late one.
        """

        def hold_first(msg: ClientMessage) -> list[DaemonMessage]:
            if msg.id == 1:
                return []
            if msg.id == "raw":
                return [Pong(id=1), Pong(id="raw")]
            return basic(msg)

        async with daemon_and_client(tmp_path, hold_first) as (_, client):
            with pytest.raises(TimeoutError):
                await client.ping(timeout=0.05)
            reply = await client.send_raw(msgspec.msgpack.encode({"type": "ping", "id": "raw"}))
            assert reply == Pong(id="raw")
            assert isinstance(await client.ping(), Pong)

    @async_test
    async def test_send_raw_returns_the_direct_reply(self, tmp_path: Path) -> None:
        async with daemon_and_client(tmp_path) as (_, client):
            reply = await client.send_raw(b"\x81\xa4type\xa6submit")  # {"type": "submit"}
            assert isinstance(reply, ErrorReply)
            assert reply.code == "bad_message"
            assert reply.id is None
            raw_ping = msgspec.msgpack.encode({"type": "ping", "id": "raw-1"})
            pong = await client.send_raw(raw_ping)
            assert isinstance(pong, Pong)
            assert pong.id == "raw-1"

    @async_test
    async def test_absent_daemon_times_out(self, tmp_path: Path) -> None:
        ctx = zmq.asyncio.Context()
        try:
            client = await EngineClient.connect(f"ipc://{tmp_path / 'nobody'}", ctx=ctx)
            async with client:
                with pytest.raises(TimeoutError):
                    await client.hello(timeout=0.05)
        finally:
            ctx.term()


class TestStreams:
    @async_test
    async def test_outputs_are_routed_per_request(self, tmp_path: Path) -> None:
        """1. two requests in flight; 2. one `output` message carries entries of both.

        Result: each stream sees only its own entries, up to its finished one.
        """
        submitted: list[str] = []

        def stream_two(msg: ClientMessage) -> list[DaemonMessage]:
            if not isinstance(msg, Submit):
                return basic(msg)
            rid = msg.request.request_id or "?"
            submitted.append(rid)
            replies: list[DaemonMessage] = [Submitted(id=msg.id, request_id=rid, dp_rank=0)]
            if len(submitted) == 2:
                a, b = submitted
                replies += [
                    Output(dp_rank=0, outputs=[entry(a, [1], cached_tokens=0), entry(b, [10])]),
                    Output(dp_rank=0, outputs=[entry(b, [11, 12]), entry(a, [2], finished=True)]),
                    Output(dp_rank=0, outputs=[entry(b, [13], finished=True)]),
                ]
            return replies

        async with daemon_and_client(tmp_path, stream_two) as (_, client):
            first = await client.submit([1, 2], 2, request_id="a")
            gen_b = asyncio.create_task(client.generate([3, 4], 4, request_id="b"))
            entries_a = await collect(client.outputs(first.request_id))
            assert [e.token_ids for e in entries_a] == [[1], [2]]
            assert entries_a[0].cached_tokens == 0
            assert entries_a[-1].finish_reason == "length"
            result_b = await gen_b
            assert result_b.token_ids == [10, 11, 12, 13]
            assert result_b.finish_reason == "length"
            assert result_b.num_outputs == 3

    @async_test
    async def test_output_batches_take_everything_queued_at_once(self, tmp_path: Path) -> None:
        """1. a submit whose three outputs arrive before the caller reads; 2. a later one.

        Result: the first read yields the two queued entries together, up to (not past) the
        finished one, and the stream is forgotten once it ended.
        """

        def stream(msg: ClientMessage) -> list[DaemonMessage]:
            if not isinstance(msg, Submit):
                return basic(msg)
            rid = msg.request.request_id or "?"
            return [
                Submitted(id=msg.id, request_id=rid, dp_rank=0),
                Output(dp_rank=0, outputs=[entry(rid, [1], cached_tokens=16)]),
                Output(dp_rank=0, outputs=[entry(rid, [2, 3])]),
                Output(dp_rank=0, outputs=[entry(rid, [4], finished=True)]),
            ]

        async with daemon_and_client(tmp_path, stream) as (_, client):
            await client.submit([1, 2], 4, request_id="r")
            await client.ping()  # sent after the outputs: they are all queued by now
            batches = await collect(client.output_batches("r"))
            assert [[e.token_ids for e in batch] for batch in batches] == [[[1], [2, 3], [4]]]
            assert batches[0][0].cached_tokens == 16
            assert "r" not in client._streams

    @pytest.mark.parametrize("request_id", ["mine", None], ids=["client-id", "daemon-id"])
    @async_test
    async def test_outputs_that_beat_the_reply_are_kept(
        self, tmp_path: Path, request_id: str | None
    ) -> None:
        """The daemon sends the whole output before `submitted`. Result: nothing is lost."""

        def early(msg: ClientMessage) -> list[DaemonMessage]:
            assert isinstance(msg, Submit)
            rid = msg.request.request_id or "daemon-minted"
            return [
                Output(dp_rank=1, outputs=[entry(rid, [5, 6], finished=True)]),
                Submitted(id=msg.id, request_id=rid, dp_rank=1),
            ]

        async with daemon_and_client(tmp_path, early) as (_, client):
            result = await client.generate([1], 2, request_id=request_id)
            assert result.request_id == (request_id or "daemon-minted")
            assert result.token_ids == [5, 6]
            assert result.dp_rank == 1

    @async_test
    async def test_request_fields_reach_the_daemon(self, tmp_path: Path) -> None:
        async with daemon_and_client(tmp_path) as (daemon, client):
            await client.submit(
                [7, 8, 9], 3, request_id="r", output_token_ids=[1, 2], dp_rank=0, timeout=1
            )
            (msg,) = daemon.received
            assert isinstance(msg, Submit)
            assert msg.request.token_ids == [7, 8, 9]
            assert msg.request.max_tokens == 3
            assert msg.request.output_token_ids == [1, 2]
            assert msg.request.dp_rank == 0

    @async_test
    async def test_cancel_ends_the_stream(self, tmp_path: Path) -> None:
        """1. a request emits one token; 2. the client cancels it (`applied`).

        Result: the stream yields that token and then ends without a finished entry.
        """

        def one_token(msg: ClientMessage) -> list[DaemonMessage]:
            match msg:
                case Submit():
                    rid = msg.request.request_id or "?"
                    return [
                        Submitted(id=msg.id, request_id=rid, dp_rank=0),
                        Output(dp_rank=0, outputs=[entry(rid, [42])]),
                    ]
                case Cancel():
                    return [Applied(id=msg.id)]
            return basic(msg)

        async with daemon_and_client(tmp_path, one_token) as (_, client):
            seen = []
            async for e in client.stream([1], 10, request_id="c"):
                seen.append(e.token_ids)
                assert isinstance(await client.cancel("c"), Applied)
            assert seen == [[42]]

    @async_test
    async def test_stream_waits_are_bounded(self, tmp_path: Path) -> None:
        async with daemon_and_client(tmp_path) as (_, client):
            with pytest.raises(TimeoutError):
                await collect(client.stream([1], 1, request_id="silent", timeout=0.05))


class TestLifecycle:
    @async_test
    async def test_events_go_to_their_handoff_and_the_feed(self, tmp_path: Path) -> None:
        """1. a prefill handoff and a destination reservation, each followed by its event.

        Result: each event is readable from its handoff's queue and from the general feed,
        in arrival order.
        """

        def handoffs(msg: ClientMessage) -> list[DaemonMessage]:
            match msg:
                case SubmitHandoffPrefill():
                    return [
                        Submitted(id=msg.id, request_id="p1", dp_rank=0),
                        Lifecycle(
                            dp_rank=0,
                            events=[SourceHeldEvent(handoff_id=msg.handoff_id, request_id="p1")],
                        ),
                    ]
                case ReserveDestination():
                    return [
                        DestinationAccepted(id=msg.id, request_id="d1", dp_rank=0),
                        Lifecycle(
                            dp_rank=0,
                            events=[
                                DestinationReservedEvent(
                                    handoff_id=msg.handoff_id,
                                    request_id="d1",
                                    transferable_prompt_tokens=32,
                                )
                            ],
                        ),
                    ]
                case ReleaseSource():
                    return [Applied(id=msg.id)]
            return basic(msg)

        async with daemon_and_client(tmp_path, handoffs) as (_, client):
            submitted = await client.submit_handoff_prefill("h1", [1, 2, 3], 1)
            assert submitted.request_id == "p1"
            accepted = await client.reserve_destination("h2", [1, 2, 3], 4)
            assert isinstance(accepted, DestinationAccepted)

            held = await client.next_lifecycle("h1")
            assert held == SourceHeldEvent(handoff_id="h1", request_id="p1")
            reserved = await client.next_lifecycle("h2")
            assert isinstance(reserved, DestinationReservedEvent)
            assert reserved.transferable_prompt_tokens == 32

            feed = client.lifecycle_events(timeout=WAIT_S)
            assert await anext(feed) == held
            assert await anext(feed) == reserved
            assert isinstance(feed, AsyncGenerator)  # what EngineClient returns is one
            await feed.aclose()

            assert isinstance(await client.release_source("h1"), Applied)
            with pytest.raises(TimeoutError):
                await client.next_lifecycle("h1", timeout=0.05)


class TestFailures:
    @async_test
    async def test_reader_failure_reaches_waiting_calls(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """1. decoding a reply raises an unexpected error.

        Result: the waiting call raises it; later calls raise ClientClosedError from it.
        """

        def broken(self: ReplyDecoder, body: Any) -> DaemonMessage:
            raise RuntimeError("decoder exploded")

        async with daemon_and_client(tmp_path) as (_, client):
            monkeypatch.setattr(ReplyDecoder, "decode", broken)
            with pytest.raises(RuntimeError, match="decoder exploded"):
                await client.ping()
            with pytest.raises(ClientClosedError) as info:
                await client.ping()
            assert isinstance(info.value.__cause__, RuntimeError)

    @async_test
    async def test_undecodable_reply_is_skipped(self, tmp_path: Path) -> None:
        async with daemon_and_client(tmp_path, lambda m: []) as (daemon, client):
            ping = asyncio.create_task(client.ping())
            await daemon.wait_received(1)
            ident = daemon.identities[0]
            await daemon.sock.send_multipart([ident, b"\xc1"])
            await daemon.sock.send_multipart([ident, encode_reply(Pong(id=1))])
            assert isinstance(await ping, Pong)

    @async_test
    async def test_close_fails_waiting_calls(self, tmp_path: Path) -> None:
        async with daemon_and_client(tmp_path, lambda m: []) as (daemon, client):
            ping = asyncio.create_task(client.ping())
            stream = asyncio.create_task(collect(client.outputs("never")))
            await daemon.wait_received(1)
            await client.close()
            await client.close()  # idempotent
            with pytest.raises(ClientClosedError):
                await ping
            with pytest.raises(ClientClosedError):
                await stream
            with pytest.raises(ClientClosedError):
                await client.hello()
            for _ in range(2):  # the feed's close notice, then the closed client itself
                with pytest.raises(ClientClosedError):
                    await client.next_lifecycle(timeout=WAIT_S)
            assert [e async for e in client.lifecycle_events("h")] == []

    @async_test
    async def test_own_context_and_identity(self, tmp_path: Path) -> None:
        """ctx=None: the client makes its context and terminates it on close."""
        ctx = zmq.asyncio.Context()
        registry = SocketRegistry()
        try:
            daemon = FakeDaemon(ctx, registry, f"ipc://{tmp_path / 'ctl'}", basic)
            task = asyncio.create_task(daemon.serve())
            async with await EngineClient.connect(daemon.endpoint, identity=b"client-7") as c:
                await c.ping()
            assert daemon.identities == [b"client-7"]
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            registry.close()
            ctx.term()
