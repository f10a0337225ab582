"""The one socket factory and the one owner of every socket (style anchor §11).

A neutral module: the daemon, the client, the tools and the Dynamo worker all make their
sockets here, and it imports no `engined` module but the neutral `engined.ipc_paths` (who may
bind an `ipc://` path, kept apart because it is about files and locks, not sockets;
tests/test_architecture.py).

Every option is explicit at the call site: whether a socket binds or connects is an argument,
never guessed from the endpoint (vLLM binds when the endpoint contains `*`, which turns a typo
into a silently reversed topology). High-water marks are always set, so no queue is unbounded
by accident.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Final, Self, TypedDict, Unpack

import structlog
import zmq
import zmq.asyncio

from engined.ipc_paths import IpcClaim, check_ipc_path, ipc_path

__all__ = [
    "CurveClientKeys",
    "IpcClaim",
    "SecurityOptions",
    "SocketOptions",
    "SocketRegistry",
    "bound_endpoint",
    "check_ipc_path",
    "ipc_path",
    "make_socket",
    "nonblocking_sender",
    "overflow_aware_sender",
    "send_frames_nowait",
]

log = structlog.get_logger()

# libzmq's own defaults, restated so every call site reads the value it gets.
DEFAULT_HWM: Final = 1000
# Long enough for a final publish to reach a connected peer at shutdown, short enough that
# `Context.term()` never hangs on a peer that went away (jupyter_client uses the same value).
DEFAULT_LINGER_MS: Final = 1000


class CurveClientKeys(TypedDict):
    """A CURVE client's own key pair and the server's public key, each Z85 (40 bytes)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes


class SecurityOptions(TypedDict, total=False):
    """Who may connect, and how: the options a gatekeeper chooses for a bound socket."""

    zap_domain: str | None
    curve_secret_key: bytes | None
    curve_client: CurveClientKeys | None
    monitor_endpoint: str | None
    handshake_ivl: int | None


class SocketOptions(SecurityOptions, total=False):
    """The options of `make_socket`, declared once for it and `SocketRegistry.make`."""

    sndhwm: int
    rcvhwm: int
    linger: int
    maxmsgsize: int | None
    router_mandatory: bool
    routing_id: bytes | None
    heartbeat_ivl: int | None
    heartbeat_timeout: int | None


# libzmq gives a ROUTER peer that sets no routing id `0x00` + a u32 counter whose start is
# the C library's `rand()` when the socket is created, and never seeded (0x6b8b4567 in every
# process); a peer that claimed the counter's next value as its own id makes libzmq abort
# (`socket_base.cpp: Assertion failed`) when the next anonymous peer connects. Seeding rand()
# from the OS before every ROUTER makes that value unguessable (docs/security.md §1).
_LIBC: Final = ctypes.CDLL(None)


def _seed_routing_ids() -> None:
    _LIBC.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))


def make_socket(
    ctx: zmq.asyncio.Context,
    socket_type: int,
    endpoint: str,
    *,
    bind: bool,
    **options: Unpack[SocketOptions],
) -> zmq.asyncio.Socket:
    """Create a socket, set its options (`SocketOptions`, each optional), then bind or
    connect it.

    Args:
        ctx: the asyncio context that owns the socket.
        socket_type: `zmq.PUB`, `zmq.ROUTER`, `zmq.DEALER`, ...
        endpoint: `tcp://host:port` or `ipc://path` (`tcp://host:*` binds an ephemeral port;
            read the real one from `socket.last_endpoint`).
        bind: bind when True, connect when False.
        sndhwm, rcvhwm: high-water marks in messages (DEFAULT_HWM); 0 means unbounded, so
            pass it only where the peer is trusted.
        linger: ms that unsent messages survive `close()` (DEFAULT_LINGER_MS).
        maxmsgsize: largest accepted inbound message in bytes (the control ROUTER sets it
            so a hostile client cannot make the daemon buffer gigabytes); None (default)
            keeps libzmq's unlimited default.
        router_mandatory: ROUTER only: an unroutable send raises (EHOSTUNREACH, or EAGAIN at
            the HWM) instead of being dropped silently (default False).
        routing_id: the identity a DEALER presents to a ROUTER; None (default) lets libzmq
            pick one.
        heartbeat_ivl: ms between the ZMTP PINGs sent on every connection; None (default)
            sends none. A peer's libzmq answers them below any protocol, so a peer that does
            not is dead, stopped or cut off.
        heartbeat_timeout: ms after a PING without any traffic from the peer before the
            connection is dropped (DISCONNECTED on a monitor, then libzmq reconnects).
        zap_domain: ask the process's ZAP handler (`engined.server.security.gatekeeper`) about every
            connection; None (default) admits every peer unasked.
        curve_secret_key: be a CURVE server with this Z85 secret key (needs `zap_domain`
            for the keys it admits to be checked).
        curve_client: be a CURVE client with these keys.
        monitor_endpoint: an `inproc://` address where the socket reports its connections
            (ACCEPTED and DISCONNECTED), set up before the bind so none is missed.
        handshake_ivl: ms a peer gets to complete the ZMTP handshake (libzmq: 30,000).

    Raises:
        ValueError: `router_mandatory` on a socket that is not a ROUTER.
        OSError: binding an `ipc://` path that a live socket owns, or that is not a socket
            (see `check_ipc_path`).
        zmq.ZMQError: the bind or connect failed; the socket is closed before re-raising.
    """
    if bind:
        check_ipc_path(endpoint)
    sock = configured_socket(ctx, socket_type, **options)
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def configured_socket(
    ctx: zmq.asyncio.Context, socket_type: int, **options: Unpack[SocketOptions]
) -> zmq.asyncio.Socket:
    """`make_socket` without the bind or connect: for a caller that must attach something
    first (a client's monitor, so that it sees even the first connection's refusal)."""
    router_mandatory = options.get("router_mandatory", False)
    maxmsgsize = options.get("maxmsgsize")
    routing_id = options.get("routing_id")
    heartbeat_ivl = options.get("heartbeat_ivl")
    heartbeat_timeout = options.get("heartbeat_timeout")
    if router_mandatory and socket_type != zmq.ROUTER:
        raise ValueError(f"router_mandatory only applies to ROUTER sockets, not type {socket_type}")
    if socket_type == zmq.ROUTER:
        _seed_routing_ids()
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.SNDHWM, options.get("sndhwm", DEFAULT_HWM))
        sock.setsockopt(zmq.RCVHWM, options.get("rcvhwm", DEFAULT_HWM))
        sock.setsockopt(zmq.LINGER, options.get("linger", DEFAULT_LINGER_MS))
        if maxmsgsize is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
        if router_mandatory:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if heartbeat_ivl is not None:
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl)
        if heartbeat_timeout is not None:
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout)
        _set_security(sock, options)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _set_security(sock: zmq.asyncio.Socket, options: SecurityOptions) -> None:
    zap_domain = options.get("zap_domain")
    secret_key = options.get("curve_secret_key")
    client = options.get("curve_client")
    monitor_endpoint = options.get("monitor_endpoint")
    handshake_ivl = options.get("handshake_ivl")
    if zap_domain is not None:
        sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode())
    if secret_key is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
    if client is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, client["server_key"])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, client["public_key"])
        sock.setsockopt(zmq.CURVE_SECRETKEY, client["secret_key"])
    if handshake_ivl is not None:
        sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ivl)
    if monitor_endpoint is not None:
        sock.monitor(monitor_endpoint, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)


def bound_endpoint(sock: zmq.asyncio.Socket, fallback: str) -> str:
    """The endpoint a socket really listens on (resolves `tcp://host:*` to its port).

    `fallback` is returned for a socket that only connected (LAST_ENDPOINT is then the last
    connect target, which is the same string in practice).
    """
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    if isinstance(raw, bytes) and raw:
        return raw.decode()
    return fallback


# Plain ints, not pyzmq's IntFlag members: `send_multipart` ORs SNDMORE into the flags for
# every frame but the last, and each `IntFlag | IntFlag` builds a new member in Python
# (enum's `__call__` and `__new__`): ~5.4 us for a 3-frame message against ~1.8 us this way.
_MORE_NOBLOCK: Final = int(zmq.SNDMORE | zmq.NOBLOCK)
_NOBLOCK: Final = int(zmq.NOBLOCK)


def send_frames_nowait(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    """`sock.send_multipart(frames, flags=zmq.NOBLOCK)`, frame by frame with int flags.

    The same libzmq calls in the same order, so the same errors: only the first frame can be
    refused (EAGAIN at the high-water mark, EHOSTUNREACH from a ROUTER_MANDATORY socket);
    once it is queued, libzmq takes the rest of the message.
    """
    last = len(frames) - 1
    send = sock.send
    for index in range(last):
        send(frames[index], _MORE_NOBLOCK)
    send(frames[last], _NOBLOCK)


def nonblocking_sender(sock: zmq.asyncio.Socket) -> Callable[[Sequence[bytes]], bool]:
    """A synchronous, never-blocking multipart send for a socket nothing awaits on (PUB).

    The engine loop publishes from plain functions. An asyncio socket's `send_multipart`
    returns a Future (and allocates one per call); a synchronous shadow of the same libzmq
    socket sends directly. The returned function answers False when libzmq refuses with
    EAGAIN (the message is dropped, as a PUB at its HWM drops it).

    NOTE: a shadow does not own the socket; sending through it after the owner closed the
    socket would touch freed memory, so every call checks the owner first.
    """
    shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)

    def send(frames: Sequence[bytes]) -> bool:
        if sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket is closed")
        try:
            send_frames_nowait(shadow, frames)
        except zmq.Again:
            return False
        return True

    return send


def overflow_aware_sender(sock: zmq.asyncio.Socket) -> Callable[[Sequence[bytes]], bool]:
    """A never-blocking PUB send that reports when a subscriber could not take the message.

    A PUB drops a message silently for a subscriber whose queue is at its high-water mark.
    With XPUB_NODROP set, that send fails with EAGAIN instead (and reaches no one); it is then
    repeated with XPUB_NODROP off, so every other subscriber still gets the message and the
    full one drops it, exactly as a plain PUB would. Returns False when some subscriber missed
    the message.

    NOTE: libzmq stops writing to a full subscriber until it has read down to half its
    queue, so from then until it catches up no further send fails: False marks the start of
    each subscriber's overflow, not every message it misses.
    """
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    send = nonblocking_sender(sock)

    def send_or_overflow(frames: Sequence[bytes]) -> bool:
        if send(frames):
            return True
        sock.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            send(frames)
        finally:
            sock.setsockopt(zmq.XPUB_NODROP, 1)
        return False

    return send_or_overflow


class SocketRegistry:
    """Owns every socket of a daemon (or client) and closes them in reverse creation order.

    Reverse order mirrors construction: a socket made later may depend on an earlier one
    (a replay ROUTER next to its PUB). `close()` is idempotent and closes every socket even
    when one of them fails, then raises the first failure.
    """

    def __init__(self) -> None:
        self._sockets: list[zmq.asyncio.Socket] = []
        self._claims: list[IpcClaim] = []
        self._closed = False

    def make(
        self,
        ctx: zmq.asyncio.Context,
        socket_type: int,
        endpoint: str,
        *,
        bind: bool,
        **options: Unpack[SocketOptions],
    ) -> zmq.asyncio.Socket:
        """`make_socket` with the same arguments, registering the result.

        A bound `ipc://` path is also claimed (`IpcClaim`) until `close()`.
        """
        self._check_open()
        path = ipc_path(endpoint) if bind else None
        claim = IpcClaim(path) if path is not None else None
        if claim is not None:
            self._claims.append(claim)
        return self.add(make_socket(ctx, socket_type, endpoint, bind=bind, **options))

    def bind_also(self, sock: zmq.asyncio.Socket, endpoint: str) -> None:
        """Bind a socket `make` returned to one more endpoint, checked and claimed alike."""
        self._check_open()
        check_ipc_path(endpoint)
        path = ipc_path(endpoint)
        if path is not None:
            self._claims.append(IpcClaim(path))
        sock.bind(endpoint)

    def add(self, sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        """Take ownership of `sock`; returns it for chaining."""
        if self._closed:
            # Nobody would close it: refuse rather than leak.
            sock.close(linger=0)
        self._check_open()
        self._sockets.append(sock)
        return sock

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._sockets)

    def close(self) -> None:
        """Close every socket, newest first, each with the linger it was created with."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        while self._sockets:
            sock = self._sockets.pop()
            try:
                sock.close()
            except Exception as exc:  # keep closing the rest, report the first failure
                log.error("socket close failed", error=repr(exc))
                if first_error is None:
                    first_error = exc
        while self._claims:
            self._claims.pop().release()
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SocketRegistry is closed")
