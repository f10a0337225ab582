"""The connection under `EngineClient`: one DEALER socket and its reader task.

Every message the client sends carries an int `id` it picked; the reader resolves the waiting
call's future when the direct reply echoing that `id` arrives, and routes streamed messages by
what they name: `output` entries to a queue per request, `lifecycle` events to a queue per
handoff and to one general feed. Nothing is lost between a call and its consumer: a request's
output queue is registered before its submit is sent, and a message naming a request or
handoff without a queue creates one.

The reader never dies silently: if it fails, the failure is logged, every waiting call and
every stream raises it, and later calls raise `ClientClosedError`. Who waits for what (the
futures and queues) is `engined.client.mailboxes`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Final, Self, TypeVar

import structlog
import zmq
import zmq.asyncio

from engined.client.client_errors import (
    ClientClosedError,
    ConnectionRefused,
    DaemonLost,
    EngineError,
    ProtocolError,
)
from engined.client.liveness import (
    DEFAULT_LIVENESS_S,
    ConnectionEvent,
    Liveness,
    heartbeat_ms,
)
from engined.client.mailboxes import Mailboxes, reply_tag
from engined.config.certificates import client_keys_from_environment
from engined.wire.control import (
    Applied,
    ClientMessage,
    DaemonMessage,
    DirectReply,
    ErrorReply,
    Hello,
    Lifecycle,
    Load,
    Noop,
    Output,
    ReplyDecoder,
    Welcome,
    WireError,
    encode_message,
)
from engined.zmq_sockets import CurveClientKeys, configured_socket

log = structlog.get_logger()

DEFAULT_TIMEOUT: Final = 30.0
# A client reads everything at once into its queues, so these only bound bursts.
_HWM: Final = 10_000

R = TypeVar("R", bound=DirectReply)


class Connection(Mailboxes):
    """A DEALER to one daemon's control socket with its reader; `EngineClient` adds the calls.

    Build it with `await connect(...)`. The protocol calls live in the subclass so that this
    class holds only what the reader and the calls share: the socket, and the pending futures
    and queues of `Mailboxes`.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        ctx: zmq.asyncio.Context,
        *,
        owns_ctx: bool,
        liveness_s: float | None = None,
    ) -> None:
        # Private: `connect()` builds the socket and starts the reader.
        self._sock = sock
        self._ctx = ctx
        self._owns_ctx = owns_ctx
        super().__init__()
        self._decoder = ReplyDecoder()
        self._ids = itertools.count(1)
        self._on_load: Callable[[Load], None] | None = None
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name="engine-client-reader"
        )
        # A refused handshake, a lost daemon and its return show on the monitor only.
        self._liveness_s = liveness_s
        self._liveness = Liveness(
            sock,
            watch_losses=liveness_s is not None,
            refused=self._refused,
            lost=self._lose,
            greet=self._greet,
        )

    @classmethod
    async def connect(
        cls,
        endpoint: str,
        *,
        ctx: zmq.asyncio.Context | None = None,
        identity: bytes | None = None,
        curve: CurveClientKeys | None = None,
        liveness_s: float | None = DEFAULT_LIVENESS_S,
    ) -> Self:
        """Connect a DEALER to the daemon's control endpoint.

        Returns at once: ZeroMQ connects in the background and queues messages until then,
        so a daemon that is not there shows up as a TimeoutError on the first call
        (`hello()` is the usual first call).

        Args:
            endpoint: the daemon's `control_endpoint`.
            ctx: a context to share; when None the client makes one and terminates it on
                close.
            identity: the DEALER's routing id. A daemon since 0.1 gives every connection
                an id of its own (protocol §1.5), so this no longer carries state across
                connections; kept for peers that are not engined daemons.
            curve: this client's CURVE keys and the daemon's public key, for a daemon that
                requires CURVE (`curve_secret_key_file`); None: those the files named by
                ENGINED_CURVE_CLIENT_KEY_FILE and ENGINED_CURVE_SERVER_KEY_FILE hold, if set
                (so every tool and the Dynamo worker can use CURVE), else none.
            liveness_s: a daemon that died, hung or was cut off is noticed within this many
                seconds (ZMTP heartbeats, `engined.client.liveness`): what waits then
                raises `DaemonLost`, and `next_connection_event` reports the loss and the
                return. None: no heartbeats, and a vanished daemon shows only as timeouts.

        Raises:
            ValueError: the CURVE environment names one file only, or a file it names
                cannot be used; `liveness_s` below 0.1 s.
        """
        beats = None if liveness_s is None else heartbeat_ms(liveness_s)
        if curve is None:
            curve = client_keys_from_environment()
        owns_ctx = ctx is None
        context = zmq.asyncio.Context() if ctx is None else ctx
        try:
            # NOTE: linger 0: every message that matters is followed by an awaited reply,
            # so what is still queued at close was abandoned, and close must not hang on a
            # daemon that went away.
            sock = configured_socket(
                context,
                zmq.DEALER,
                sndhwm=_HWM,
                rcvhwm=_HWM,
                linger=0,
                routing_id=identity,
                curve_client=curve,
                heartbeat_ivl=None if beats is None else beats[0],
                heartbeat_timeout=None if beats is None else beats[1],
                # Not ZMQ_IMMEDIATE: it would keep what is sent while the daemon is away from
                # its successor, but it also drops what the daemon sent and this client has
                # not read yet when the connection ends (a drained daemon's last outputs).
            )
        except BaseException:
            if owns_ctx:
                context.term()
            raise
        # Connected only once the monitor is attached: libzmq may refuse the handshake
        # before this coroutine runs again, and a refusal nobody saw would leave every call
        # waiting for its timeout instead of raising ConnectionRefused.
        client = cls(sock, context, owns_ctx=owns_ctx, liveness_s=liveness_s)
        try:
            sock.connect(endpoint)
        except BaseException:
            await client.close()
            raise
        return client

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader, fail what still waits with ClientClosedError, close the socket."""
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        await self._liveness.close()
        # A reader failure was logged and handed to every waiter when it happened; awaiting
        # here only collects it, so it is not reported twice.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        if self._failure is None:
            self._fail_all(ClientClosedError("client closed"))
        self._sock.close()
        if self._owns_ctx:
            self._ctx.term()

    # --- internals ------------------------------------------------------------------------

    def _next_id(self) -> int:
        return next(self._ids)

    def _check_usable(self) -> None:
        if isinstance(self._failure, ConnectionRefused):
            raise ConnectionRefused(self._failure.status)
        if self._failure is not None:
            raise ClientClosedError("client reader failed") from self._failure
        if self._closed:
            raise ClientClosedError("client closed")
        if self._liveness.lost is not None and not self._unread():
            raise DaemonLost(str(self._liveness.lost))

    def _unread(self) -> bool:
        """Whether the DEALER still holds messages for the reader: they come before a loss."""
        return not self._reader.done() and bool(int(self._sock.get(zmq.EVENTS)) & zmq.POLLIN)

    async def _request(
        self, msg: ClientMessage, timeout: float | None, *, while_lost: bool = False
    ) -> DirectReply:
        """Send `msg` (stamped with an int id) and wait for the reply echoing that id;
        `while_lost` sends it although the daemon is lost (the `hello` that ends a loss)."""
        if not (while_lost and self._liveness.lost is not None):
            self._check_usable()
        message_id = msg.id
        assert isinstance(message_id, int), "the client stamps every message with an int id"
        future: asyncio.Future[DirectReply] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        try:
            async with asyncio.timeout(timeout):
                await self._send((encode_message(msg),), future)
                reply = await future
        except BaseException:
            if self._pending.pop(message_id, None) is not None:
                self._abandoned.add(message_id)
            raise
        if isinstance(reply, ErrorReply):
            raise EngineError(reply.code, reply.message)
        return reply

    async def _send(self, frames: tuple[bytes], answered: asyncio.Future[DirectReply]) -> None:
        """Send at once when libzmq takes the message, else wait until it does or until
        `answered` is failed: past the high-water mark a send waits, and the loss that fails
        the call must end that wait too."""
        try:
            await self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        sending = asyncio.ensure_future(self._sock.send_multipart(frames))
        try:
            await asyncio.wait((sending, answered), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                sending.cancel()
        if sending.done() and not sending.cancelled():
            sending.result()

    async def _call(self, msg: ClientMessage, expected: type[R], timeout: float | None) -> R:
        reply = await self._request(msg, timeout)
        if not isinstance(reply, expected):
            raise ProtocolError(f"expected `{reply_tag(expected)}` reply, got {reply!r}")
        return reply

    async def _call_either(self, msg: ClientMessage, timeout: float | None) -> Applied | Noop:
        reply = await self._request(msg, timeout)
        if not isinstance(reply, Applied | Noop):
            raise ProtocolError(f"expected `applied` or `noop` reply, got {reply!r}")
        return reply

    async def _call_with_stream(
        self, msg: ClientMessage, expected: type[R], request_id: str | None, timeout: float | None
    ) -> R:
        # Registered before sending so no output of the request can arrive unrouted.
        created = request_id is not None and request_id not in self._streams
        if request_id is not None:
            self._stream_queue(request_id)
        try:
            return await self._call(msg, expected, timeout)
        except BaseException:
            # Keep a queue that was already there: on `duplicate_request` it belongs to the
            # active request of the same id.
            if created and request_id is not None:
                queue = self._streams.get(request_id)
                if queue is not None and queue.empty():
                    del self._streams[request_id]
            raise

    async def _end_handoff(
        self, handoff_id: str, msg: ClientMessage, timeout: float | None
    ) -> Applied | Noop:
        reply = await self._call_either(msg, timeout)
        # After release/cancel/activate no lifecycle event can follow for this handoff.
        self._handoffs.pop(handoff_id, None)
        return reply

    # --- the reader -----------------------------------------------------------------------

    async def _read(self) -> None:
        # One awaited receive per readiness wake, then what else is queued without the
        # asyncio socket's future per message: a sync shadow of the same libzmq socket reads
        # until EAGAIN, in order, and nothing can run between two messages (no await).
        drain: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                while True:
                    self._take(frames)
                    try:
                        frames = drain.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine client reader failed")
            self._failure = exc
            self._fail_all(exc)
            raise

    def _take(self, frames: list[zmq.Frame]) -> None:
        """Decode one daemon message and hand it on; a malformed one is logged and dropped."""
        # A DEALER reply is [body]; tolerate the REQ-style [b"", body] envelope too.
        if len(frames) == 2 and len(frames[0]) == 0:
            frames = frames[1:]
        if not self._liveness.up:
            self._liveness.heard()
        if len(frames) != 1:
            log.warning("daemon message with unexpected frames", frames=len(frames))
            return
        try:
            msg = self._decoder.decode(frames[0].buffer)
        except WireError as exc:
            log.warning("undecodable daemon message", error=exc.message)
            return
        self._dispatch(msg)

    def _refused(self, status: int) -> None:
        """A refused handshake ends the client: libzmq does not try that endpoint again, so
        every waiting call and every later one raises the refusal at once."""
        self._failure = ConnectionRefused(status)
        self._fail_all(self._failure)

    def _lose(self, lost: DaemonLost) -> None:
        """End the lost connection's requests and handoffs (a daemon that returns knows it
        no more); finished requests keep their outputs (`_forget_all`). What the daemon sent
        before it went comes first: a draining daemon's last outputs stay readable in the
        DEALER, and the monitor's DISCONNECTED can be read before them."""
        if self._unread():
            asyncio.get_running_loop().call_soon(self._lose, lost)
            return
        self._fail_all(lost)
        self._forget_all()

    async def _greet(self) -> Welcome:
        timeout = self._liveness_s or DEFAULT_TIMEOUT
        reply = await self._request(Hello(id=self._next_id()), timeout, while_lost=True)
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected `welcome` reply, got {reply!r}")
        return reply

    async def next_connection_event(self, *, timeout: float | None = None) -> ConnectionEvent:
        """The next loss (`ConnectionLost`) or return (`ConnectionBack`) of the daemon.

        Only with a liveness bound (`connect(liveness_s=...)`); events queue until read, so
        a consumer that reads them in turn sees every loss before its return.
        """
        return await self._liveness.next_event(timeout)

    @property
    def daemon_lost(self) -> bool:
        """True from a loss of the daemon until it answers again."""
        return self._liveness.lost is not None

    @property
    def instance_id(self) -> str | None:
        """The daemon's start, from the last `welcome` this client read (None: none yet)."""
        return self._liveness.instance_id

    def _dispatch(self, msg: DaemonMessage) -> None:
        match msg:
            case Output() | Lifecycle():
                self._route(msg)
            case Load():
                if self._on_load is not None:
                    self._on_load(msg)
            case DirectReply():
                if isinstance(msg, Welcome):
                    self._liveness.saw_welcome(msg)
                self._resolve(msg)
