"""Who may connect to the daemon's sockets, under which routing id, and in which role.

libzmq asks the process's ZAP handler (RFC 27) about every connection to a socket with a ZAP
domain, after the ZMTP greeting and before the connection carries a message. Every socket the
daemon binds has one, and this thread answers:

* **Routing ids.** An admitted connection to a ROUTER gets a routing id drawn here
  (`0x01` + 8 random bytes) in the reply's `Identity` property, which libzmq applies over the
  one the peer presented. Ids are unguessable and never reused, so no client can take over a
  departed client's identity, and none lands in libzmq's reserved `0x00` range, the range
  whose collision with its own counter aborts the process (`engined.zmq_sockets`). Under
  CURVE the peer's own properties are read before this reply is, so the daemon's id always
  wins; under NULL a peer that holds back its READY until the daemon's can keep its own id
  (docs/security.md §1 says what then still protects the daemon).
* **Roles.** A control connection is `operator` or `client`, in the `Role` property of every
  message it sends (libzmq lets ZAP properties win over the peer's). Under CURVE the role is
  the client key's in the authorized keys; without CURVE, an `ipc://` peer whose uid, as the
  kernel reports it, is the daemon's (or root) is an operator, and every other peer a client.
* **A connection cap.** Every socket reports its connections (ACCEPTED, DISCONNECTED); past
  `max_connections` open in this process a new one is refused with status 500, which the
  client sees as a failed handshake (`engined.client` raises `ConnectionRefused`).
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engined.zmq_sockets import SecurityOptions

log = structlog.get_logger(__name__)

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
ROLE_PROPERTY: Final = "Role"
# Long enough for a client across a slow network, short enough that connections that never
# finish their greeting give their file descriptors back soon (libzmq's default is 30 s).
HANDSHAKE_IVL_MS: Final = 10_000
ROUTING_ID_PREFIX: Final = b"\x01"


class Role(StrEnum):
    CLIENT = "client"
    OPERATOR = "operator"


def is_operator(frame: zmq.Frame) -> bool:
    """Whether the connection a frame came on has the operator role (the gatekeeper's say;
    a socket without a gatekeeper has no operators)."""
    try:
        return frame.get(ROLE_PROPERTY) == Role.OPERATOR
    except zmq.ZMQError:
        return False


def forbidden(what: str) -> str:
    """The message refusing an engine-wide command `what` to a client without the role."""
    return (
        f"{what} needs the operator role: connect to the welcome's operator_endpoint as the "
        "daemon's user, or with an operator CURVE key"
    )


class Domain(StrEnum):
    """What a socket is, as its ZAP requests say; roles matter on the control socket only."""

    CONTROL = "engined-control"
    REPLAY = "engined-replay"
    PUBLISH = "engined-publish"


# ZAP status codes (RFC 27): 400 is a refused identity, 500 a server-side refusal (here the
# connection cap). libzmq sends both to the client in an ERROR command; 300 would disconnect
# it silently and leave the server's side of the connection open.
DENIED: Final = b"400"
REFUSED: Final = b"500"


@dataclass(frozen=True, slots=True)
class GatePolicy:
    max_connections: int
    operator_uids: frozenset[int]
    # Z85 secret key of the daemon's CURVE server; None: NULL security (anyone may connect).
    curve_secret_key: bytes | None = None
    # Raw 32-byte client public keys admitted under CURVE, with their roles.
    authorized_keys: Mapping[bytes, Role] = field(default_factory=dict)
    # CURVE on the KV event and FPM publishers too (their subscribers then need keys).
    curve_publishers: bool = True


@dataclass(frozen=True, slots=True)
class Verdict:
    status: bytes
    text: str
    role: Role = Role.CLIENT


def decide(
    policy: GatePolicy,
    open_connections: int,
    domain: str,
    address: str,
    mechanism: str,
    credentials: list[bytes],
) -> Verdict:
    """The answer to one ZAP request; pure, so every rule is tested without sockets."""
    if policy.max_connections and open_connections > policy.max_connections:
        return Verdict(REFUSED, f"connection limit ({policy.max_connections}) reached")
    if mechanism == "CURVE":
        role = policy.authorized_keys.get(credentials[0]) if credentials else None
        if role is None:
            return Verdict(DENIED, "unknown client key")
        return Verdict(b"200", "OK", role)
    if mechanism != "NULL":
        return Verdict(DENIED, f"mechanism {mechanism} is not accepted")
    # A CURVE server's peers cannot present NULL (libzmq fails the greeting first): this
    # holds only if an option is ever forgotten.
    curve_here = domain != Domain.PUBLISH or policy.curve_publishers
    if policy.curve_secret_key is not None and curve_here:
        return Verdict(DENIED, "CURVE required")
    if domain == Domain.CONTROL and _ipc_uid(address) in policy.operator_uids:
        return Verdict(b"200", "OK", Role.OPERATOR)
    return Verdict(b"200", "OK", Role.CLIENT)


def _ipc_uid(address: str) -> int | None:
    """The uid libzmq read with SO_PEERCRED for an ipc peer (`localhost:uid:gid:pid`)."""
    parts = address.split(":")
    if len(parts) != 4 or parts[0] != "localhost":
        return None
    try:
        return int(parts[1])
    except ValueError:
        return None


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def new_routing_id() -> bytes:
    return ROUTING_ID_PREFIX + secrets.token_bytes(8)


@dataclass(slots=True)
class GateCounts:
    """What the gate has done, for `/metrics`, `stats` and tests."""

    open_connections: int = 0
    admitted: int = 0
    refused: int = 0
    denied: int = 0


class Gatekeeper:
    """The ZAP handler of one process (one per ZeroMQ context), on a thread of its own.

    A thread, not the event loop: libzmq waits for the answer inside the handshake, and a
    paced pass or a busy reader turn must not hold new connections back (nor the reverse).
    Call `options(domain)` for every socket to bind, before binding it.
    """

    def __init__(self, ctx: zmq.asyncio.Context, policy: GatePolicy) -> None:
        # Plain (blocking) sockets on the same libzmq context: inproc reaches only its own.
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self.policy = policy
        self.counts = GateCounts()
        self._names = itertools.count()
        self._tag = secrets.token_hex(4)
        self._new_monitors: queue.SimpleQueue[zmq.Socket[bytes]] = queue.SimpleQueue()
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        wake = f"inproc://engined-gate-wake-{self._tag}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.connect(wake)
        self._thread = threading.Thread(target=self._run, name="engined-gatekeeper", daemon=True)
        self._thread.start()

    def options(self, domain: Domain, *, router: bool = False) -> SecurityOptions:
        """The security options of a socket to bind for `domain` (`make_socket`'s)."""
        endpoint = f"inproc://engined-gate-{self._tag}-{next(self._names)}"
        # Connected before the socket's monitor binds (inproc allows it), so no event is lost.
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.linger = 0
        monitor.connect(endpoint)
        self._new_monitors.put(monitor)
        self._wake.send(b"monitor")
        options: SecurityOptions = {
            "zap_domain": domain.value,
            "monitor_endpoint": endpoint,
            "handshake_ivl": HANDSHAKE_IVL_MS,
        }
        curve = self.policy.curve_secret_key
        if curve is not None and (domain != Domain.PUBLISH or self.policy.curve_publishers):
            options["curve_secret_key"] = curve
        return options

    def close(self) -> None:
        """Stop the thread (after every gated socket is closed) and close its sockets."""
        if self._thread.is_alive():
            self._wake.send(b"stop")
            self._thread.join()
        self._wake.close(linger=0)

    # --- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        monitors: list[zmq.Socket[bytes]] = []
        try:
            while True:
                ready = dict(poller.poll())
                # Connections first: a ZAP request is answered knowing every accept before it.
                for monitor in monitors:
                    if monitor in ready:
                        self._count(monitor)
                if self._wake_rx in ready:
                    if self._wake_rx.recv() == b"stop":
                        return
                    while not self._new_monitors.empty():
                        monitor = self._new_monitors.get()
                        monitors.append(monitor)
                        poller.register(monitor, zmq.POLLIN)
                if self._zap in ready:
                    request = self._zap.recv_multipart()
                    try:
                        self._answer(request)
                    except Exception:  # a bug: refuse this peer, keep the gate (and REP) alive
                        log.exception("ZAP request failed", frames=len(request))
                        echo = request[1] if len(request) > 1 else b""
                        refusal = [b"1.0", echo, DENIED, b"internal error", b"", b""]
                        self._zap.send_multipart(refusal)
        finally:
            for sock in (*monitors, self._zap, self._wake_rx):
                sock.close(linger=0)

    def _count(self, monitor: zmq.Socket[bytes]) -> None:
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event == zmq.EVENT_ACCEPTED:
                self.counts.open_connections += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.counts.open_connections = max(0, self.counts.open_connections - 1)

    def _answer(self, request: list[bytes]) -> None:
        if len(request) < 6:
            # Not from libzmq (nothing else can reach an inproc endpoint of this context).
            log.error("malformed ZAP request", frames=len(request))
            self._zap.send_multipart([b"1.0", b"", DENIED, b"malformed request", b"", b""])
            return
        version, request_id, domain, address, _identity, mechanism = request[:6]
        verdict = decide(
            self.policy,
            self.counts.open_connections,
            domain.decode(errors="replace"),
            address.decode(errors="replace"),
            mechanism.decode(errors="replace"),
            request[6:],
        )
        metadata = b""
        if verdict.status == b"200":
            self.counts.admitted += 1
            metadata = _property(b"Identity", new_routing_id()) + _property(
                ROLE_PROPERTY.encode(), verdict.role.value.encode()
            )
        elif verdict.status == REFUSED:
            self.counts.refused += 1
        else:
            self.counts.denied += 1
        self._zap.send_multipart(
            [version, request_id, verdict.status, verdict.text.encode(), b"", metadata]
        )


def operator_uids() -> frozenset[int]:
    """The uids whose ipc peers are operators without CURVE: the daemon's own, and root."""
    return frozenset({os.getuid(), 0})
