"""Per-client state of the control socket, the one way out to a client, and the slow-reader policy.

Every message to a client leaves through `ClientTable.send`: NOBLOCK on a ROUTER_MANDATORY
socket, so a send never blocks the engine and fails at once, either because the peer is
gone (EHOSTUNREACH) or because it left SNDHWM messages unread (EAGAIN: the ROUTER's per-peer
pipe is full). A full pipe is only a client behind: what does not fit waits in the client's
`Backlog`, encoded and counted, and goes out, in order, as the pipe takes it (tried at each
send to the client, each message from it, and with the dropped clients' retries). A client
that is gone, or whose unread messages (pipe and backlog) pass `limit` or whose backlog
passes `byte_limit`, is **dropped**: its requests are cancelled and their KV freed (it
cannot take their outputs), and an *episode* starts, logged once. During the
episode the daemon keeps what the client must still learn, its *notices*: one `cancelled`
terminal per request that was ended, the direct replies and lifecycle events that could not
be sent, the final entries of any output that could not be sent, and an `overloaded` error
for each message it sends meanwhile (not processed: it would only add to the backlog; past
MAX_UNANSWERED, one error without an id counts the rest). When the client can be written to
again (tried after DROPPED_RETRY_S, backing off to DROPPED_RETRY_MAX_S, every MOVING_RETRY_S
while it takes what is tried, and whenever it sends a message) the notices are delivered in
order and the episode ends; a `watch_load` client is subscribed again and gets every rank's
load at once.

Memory is bounded whatever clients do: per-identity state lives only while the identity has
something in flight (a command being applied, a request, a handoff route, a load watch, a
backlog, an episode), a backlog holds at most `byte_limit` bytes, at most
MAX_DROPPED_CLIENTS episodes are remembered (the oldest is forgotten), and all episodes
together keep at most MAX_NOTICES notices, none of them a large reply (a `welcome` or
`stats` reply a dropped client was owed becomes an `overloaded` error: it asks again). An
episode whose client shows no sign of life for DROPPED_FORGET_S is forgotten too, so clients
that vanish leave nothing behind.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import msgspec
import structlog
import zmq
import zmq.asyncio

from engined.config.schema import CONTROL_UNREAD_BYTES
from engined.server.backlog import Backlogs
from engined.wire import control as wire
from engined.zmq_sockets import send_frames_nowait

log = structlog.get_logger(__name__)

DELIMITER = b""
# The most episodes remembered, and their notices all together (a notice is a message or,
# for terminals and kept output entries, one entry: ~100-400 bytes).
MAX_DROPPED_CLIENTS: Final = 1024
MAX_NOTICES: Final = 65_536
# The most `overloaded` replies kept for messages a client sends while dropped; the rest
# are counted, in one `overloaded` error without an id, and in the log line that ends the
# episode.
MAX_UNANSWERED: Final = 1024
# How often a dropped client is tried again: DROPPED_RETRY_S at first, doubling after each
# failure up to DROPPED_RETRY_MAX_S (and again at once whenever it sends a message). A peer
# that is gone for good then costs one failed send every 2 s until it is forgotten.
DROPPED_RETRY_S: Final = 0.05
DROPPED_RETRY_MAX_S: Final = 2.0
# A dropped client that sends nothing and takes nothing for this long is forgotten with its
# notices. ZeroMQ never says that a ROUTER peer has gone for good (a vanished one and one
# that stopped reading look alike), so without this every vanished client kept its episode,
# its framing and a failed send every DROPPED_RETRY_MAX_S until MAX_DROPPED_CLIENTS newer
# episodes pushed it out (issue 21, 4).
DROPPED_FORGET_S: Final = 60.0
# While a client takes what is retried (its small pipe had room again), the next retry comes
# this soon, so a client catching up on a backlog or notices is not held to one pipe's worth
# per DROPPED_RETRY_S.
MOVING_RETRY_S: Final = 0.005
# The most terminals per `output` message when they are delivered.
TERMINALS_PER_MESSAGE: Final = 1024
# A backlog that has sent nothing for this long, of a client with nothing in flight (so
# nothing more is coming to it), is dropped: its replies become notices, which the episodes'
# bounds cover, instead of a backlog kept for a peer that may be gone for good.
BACKLOG_STALL_S: Final = 10.0


@dataclass(slots=True)
class Client:
    """What the daemon keeps about an identity while something of it is in flight."""

    delimited: bool
    # Commands of this client being applied (their replies are still to come).
    busy: int = 0


@dataclass(slots=True)
class Episode:
    """A dropped client, from the failed send to the delivery of its notices."""

    # "too slow" (EAGAIN: the pipe is full) or "unreachable" (EHOSTUNREACH). NOTE: libzmq
    # also answers EHOSTUNREACH for a present peer whose pipe filled up and has not yet
    # been read down to its low-water mark, so both are retried alike.
    reason: str
    started: float
    # The drop, or since then the client's last message or notice taken.
    heard: float
    retry_at: float = 0.0
    backoff: float = 0.0
    # Retries that found the pipe still full. A first EAGAIN can be a transient (libzmq's
    # I/O thread behind, not the client); one that outlasts retries is a client not reading.
    stalls: int = 0
    # Messages to deliver, in order, then terminals (rank, request id), then the load.
    kept: deque[wire.DaemonMessage] = field(default_factory=deque)
    terminals: list[tuple[int, str]] = field(default_factory=list)
    watching: bool = False
    cancelled: int = 0
    unanswered: int = 0
    ignored: int = 0  # unanswered beyond MAX_UNANSWERED
    summarised: int = 0  # of those, how many the summary `error` delivered counts
    lost: int = 0  # notices past MAX_NOTICES
    delivered: int = 0


def _notice_size(msg: wire.DaemonMessage) -> int:
    return len(msg.outputs) if isinstance(msg, wire.Output) else 1


class ClientTable:
    """The clients of one control ROUTER: framing, work in flight, dropped clients."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        *,
        in_flight: Callable[[bytes], bool],
        dropped: Callable[[bytes, Episode], None],
        recovered: Callable[[bytes, Episode], None],
        unread_messages: int | None = None,
        unread_bytes: int = CONTROL_UNREAD_BYTES,
    ) -> None:
        """A client is dropped past `unread_messages` unread (its pipe, SNDHWM messages, and
        its backlog; None: the pipe alone, no backlog) or `unread_bytes` in its backlog."""
        self._sock = sock
        # Sends go through a synchronous shadow: NOBLOCK, errors raised at the call.
        self._send_sock: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._encode = msgspec.msgpack.Encoder().encode
        self._in_flight = in_flight
        self._dropped = dropped
        self._recovered = recovered
        pipe = int(sock.get(zmq.SNDHWM))
        self.limit = pipe if unread_messages is None else unread_messages
        self.byte_limit = unread_bytes
        self._backlogs = Backlogs(pipe=pipe, messages=self.limit, byte_limit=unread_bytes)
        # One string for every kept `overloaded` reply (a dropped flooder may need 1,024).
        self._unanswered_text = (
            f"not processed: this client left more than {self.limit} messages unread, or more "
            f"than {self.byte_limit} bytes (control_unread_bytes), so it was dropped and its "
            "requests were cancelled; read, then send again"
        )
        self._clients: dict[bytes, Client] = {}
        self._episodes: OrderedDict[bytes, Episode] = OrderedDict()
        self._notices = 0
        self._retry_wanted = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._rearm_pending = False

    # --- state --------------------------------------------------------------------------

    @property
    def tracked(self) -> int:
        """Identities with per-client state (in flight or dropped)."""
        return len(self._clients)

    @property
    def episodes(self) -> int:
        return len(self._episodes)

    @property
    def notices(self) -> int:
        return self._notices

    @property
    def backlogs(self) -> Backlogs:
        return self._backlogs

    @property
    def stalls(self) -> int:
        """Failed retries of the clients dropped now."""
        return sum(episode.stalls for episode in self._episodes.values())

    def is_dropped(self, identity: bytes) -> bool:
        return identity in self._episodes

    def arrived(self, identity: bytes, delimited: bool) -> bool:
        """A message came from `identity`: track it; False while it stays dropped.

        A dropped client that sends again may have read its backlog: its notices are
        delivered now if they fit, and then its message is handled as any other.
        """
        client = self._clients.get(identity)
        if client is None:
            self._clients[identity] = Client(delimited)
        else:
            client.delimited = delimited
        episode = self._episodes.get(identity)
        if episode is not None:
            # It is there: try again now, and soon after.
            episode.backoff = 0.0
            episode.heard = time.monotonic()
            self._flush(identity)
        elif identity in self._backlogs:
            self._backlogs.flush(identity, self._try_send)
        return identity not in self._episodes

    def hold(self, identity: bytes) -> None:
        """Something for `identity` is under way (a command): keep its state until released."""
        client = self._clients.get(identity)
        if client is not None:
            client.busy += 1

    def release(self, identity: bytes) -> None:
        client = self._clients.get(identity)
        if client is not None and client.busy:
            client.busy -= 1
        self.settle(identity)

    def settle(self, identity: bytes) -> None:
        """Free the identity's state if nothing of it is in flight any more."""
        client = self._clients.get(identity)
        if (
            client is not None
            and not client.busy
            and identity not in self._episodes
            and identity not in self._backlogs
            and not self._in_flight(identity)
        ):
            del self._clients[identity]

    # --- sending ------------------------------------------------------------------------

    def send(self, identity: bytes, msg: wire.DaemonMessage) -> None:
        """Send now, or after the client's backlog, or keep it as a notice if the client is
        dropped (or is now)."""
        episode = self._episodes.get(identity)
        if episode is not None:
            self._keep(identity, episode, msg)
            return
        body = self._encode(msg)
        backlogs = self._backlogs
        if identity in backlogs and not backlogs.flush(identity, self._try_send):
            self._queue(identity, body, msg)
            return
        reason = self._try_send(identity, body)
        if reason is None:
            return
        if reason == "too slow" and backlogs.enabled:
            self._queue(identity, body, msg)
            return
        self._keep(identity, self._drop(identity, reason), msg)

    def send_terminals(self, identity: bytes, rank: int, request_ids: list[str]) -> None:
        """Tell the owner its requests ended as `cancelled` (one terminal entry each)."""
        episode = self._episodes.get(identity)
        if episode is not None:
            for request_id in request_ids:
                if self._make_room(identity, episode, 1):
                    episode.terminals.append((rank, request_id))
                    self._notices += 1
            return
        for start in range(0, len(request_ids), TERMINALS_PER_MESSAGE):
            chunk = request_ids[start : start + TERMINALS_PER_MESSAGE]
            self.send(identity, _terminals(rank, chunk))

    def unanswered(self, identity: bytes, msg_id: int | str | None) -> None:
        """A dropped client's message was not handled: it gets `overloaded` once it reads."""
        episode = self._episodes[identity]
        episode.unanswered += 1
        if episode.unanswered > MAX_UNANSWERED:
            episode.ignored += 1
            return
        self._keep(
            identity,
            episode,
            wire.ErrorReply(id=msg_id, code="overloaded", message=self._unanswered_text),
        )

    def _try_send(self, identity: bytes, body: bytes) -> str | None:
        """None when sent, else why the client cannot take it."""
        client = self._clients.get(identity)
        delimited = client is not None and client.delimited
        frames = [identity, DELIMITER, body] if delimited else [identity, body]
        try:
            send_frames_nowait(self._send_sock, frames)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return "unreachable"
            if exc.errno == zmq.EAGAIN:
                return "too slow"
            raise
        finally:
            # NOTE: the ZMQ FD is edge-triggered, and a send through the shadow may consume
            # the edge announcing incoming messages, leaving serve()'s pending recv asleep
            # with messages queued. Reading EVENTS through the asyncio socket reschedules it
            # (pyzmq does the same after its own sends).
            self._rearm_soon()
        return None

    def _rearm_soon(self) -> None:
        """Read EVENTS once this turn of the event loop is over, not after every send.

        It only has to happen before the loop next waits in select, which `call_soon`
        guarantees; a turn that sends a pass's output and the replies the pass's commands
        woke reads it once. Each read is a getsockopt that polls libzmq's mailbox (two system
        calls) plus pyzmq's rescheduling in Python: ~4% of the daemon's CPU when every send
        paid for one (py-spy, e2e_throughput over tcp).
        """
        if not self._rearm_pending:
            self._rearm_pending = True
            self._loop.call_soon(self._rearm)

    def _rearm(self) -> None:
        self._rearm_pending = False
        if not self._sock.closed:
            self._sock.get(zmq.EVENTS)

    # --- backlogs -----------------------------------------------------------------------

    def _queue(self, identity: bytes, body: bytes, msg: wire.DaemonMessage) -> None:
        """Keep `body` until the client's pipe has room; drop the client past its limits.

        A backlog is sent at each send to its client, each message from it and each retry.
        Any refusal, EHOSTUNREACH included, leaves it waiting: libzmq answers that for a full
        pipe too (`Episode.reason`), and a gone peer whose pipe was full answers EAGAIN; such
        a peer is dropped past the limits, or once stalled with nothing in flight.
        """
        if identity not in self._backlogs:
            # Its framing must outlive the message that found the pipe full.
            self._clients.setdefault(identity, Client(delimited=False))
            self._retry_wanted.set()
        if self._backlogs.queue(identity, body, self._notice(msg)):
            self._drop(identity, "too slow")

    # --- episodes -----------------------------------------------------------------------

    def _drop(self, identity: bytes, reason: str) -> Episode:
        now = time.monotonic()
        episode = Episode(reason, now, now)
        self._episodes[identity] = episode
        while len(self._episodes) > MAX_DROPPED_CLIENTS:
            self._forget_oldest()
        self._retry_wanted.set()
        # What waited in its backlog becomes its first notices, in order.
        backlog = self._backlogs.take(identity)
        for notice in backlog.notices():
            self._keep(identity, episode, notice)
        # Its requests end here; their terminals become notices of the new episode.
        self._dropped(identity, episode)
        limits = {"unread_limit": self.limit, "unread_bytes_limit": self.byte_limit}
        log.warning(
            "client gone",
            identity=identity.hex(),
            reason=reason,
            cancelled=episode.cancelled,
            **(limits if reason == "too slow" else {}),
            **({"queued": len(backlog), "queued_bytes": backlog.bytes} if backlog else {}),
        )
        return episode

    def _notice(self, msg: wire.DaemonMessage) -> wire.DaemonMessage | None:
        """What a dropped client must still learn of `msg` (None: nothing)."""
        match msg:
            case wire.Load():
                # Stale by the time the client reads; it gets fresh figures on recovery.
                return None
            case wire.Output():
                # Its requests were ended by the drop; only entries that were already final
                # (their owners forgotten before the send) would otherwise be lost.
                final = [entry for entry in msg.outputs if entry.finished]
                return wire.Output(dp_rank=msg.dp_rank, outputs=final) if final else None
            case wire.Welcome() | wire.StatsReply():
                # Answers to questions that changed nothing, and large: it asks again.
                return wire.ErrorReply(id=msg.id, code="overloaded", message=self._unanswered_text)
        return msg

    def _keep(self, identity: bytes, episode: Episode, msg: wire.DaemonMessage) -> None:
        notice = self._notice(msg)
        if notice is None:
            return
        size = _notice_size(notice)
        if self._make_room(identity, episode, size):
            episode.kept.append(notice)
            self._notices += size

    def _make_room(self, identity: bytes, episode: Episode, size: int) -> bool:
        while self._notices + size > MAX_NOTICES:
            if not self._forget_oldest(but=identity):
                episode.lost += size
                return False
        return True

    def _forget_oldest(self, but: bytes | None = None) -> bool:
        for identity in self._episodes:
            if identity != but:
                self._forget(identity, "too many dropped clients")
                return True
        return False

    def _forget(self, identity: bytes, why: str) -> None:
        pending = _pending(self._episodes.pop(identity))
        self._notices -= pending
        log.info("dropped client forgotten", identity=identity.hex(), notices=pending, why=why)
        self.settle(identity)

    def _flush(self, identity: bytes) -> bool:
        """Deliver the episode's notices in order; True once all are out (it has ended)."""
        episode = self._episodes[identity]
        while episode.kept:
            if not self._deliver(identity, episode, episode.kept[0]):
                return False
            self._notices -= _notice_size(episode.kept.popleft())
        while episode.terminals:
            rank = episode.terminals[0][0]
            count = 0
            for other, _ in episode.terminals[:TERMINALS_PER_MESSAGE]:
                if other != rank:
                    break
                count += 1
            chunk = [request_id for _, request_id in episode.terminals[:count]]
            if not self._deliver(identity, episode, _terminals(rank, chunk)):
                return False
            del episode.terminals[:count]
            self._notices -= count
        if episode.ignored > episode.summarised:
            # The messages past MAX_UNANSWERED have no reply of their own; one line, no id,
            # says how many there were.
            text = f"{episode.ignored} more messages were not processed: {self._unanswered_text}"
            summary = wire.ErrorReply(code="overloaded", message=text)
            if not self._deliver(identity, episode, summary):
                return False
            episode.summarised = episode.ignored
        del self._episodes[identity]
        log.info(
            "client back",
            identity=identity.hex(),
            reason=episode.reason,
            delivered=episode.delivered,
            unanswered=episode.unanswered,
            ignored=episode.ignored,
            lost=episode.lost,
            dropped_s=round(time.monotonic() - episode.started, 3),
        )
        self._recovered(identity, episode)
        self.settle(identity)
        return True

    def _deliver(self, identity: bytes, episode: Episode, msg: wire.DaemonMessage) -> bool:
        reason = self._try_send(identity, self._encode(msg))
        if reason is None:
            episode.delivered += _notice_size(msg)
            episode.heard = time.monotonic()
            return True
        return False

    async def retry_dropped(self) -> None:
        """Send backlogs, and deliver dropped clients' notices (with backoff), once the
        clients can take them.

        A client that stops sending as well, or that nothing more is sent to, would otherwise
        never get them: ZeroMQ tells nobody when a ROUTER peer's pipe has room again, so it is
        tried.
        """
        delay = DROPPED_RETRY_S
        while True:
            await self._retry_wanted.wait()
            await asyncio.sleep(delay)
            now = time.monotonic()
            queued = self._backlogs.bytes
            for identity in list(self._backlogs):
                if self._backlogs.flush(identity, self._try_send):
                    self.settle(identity)
                elif self._backlogs.stalled(identity, now - BACKLOG_STALL_S):
                    client = self._clients.get(identity)
                    if not (client and client.busy) and not self._in_flight(identity):
                        self._drop(identity, "too slow")
            moved = self._backlogs.bytes < queued
            due = [i for i, e in self._episodes.items() if e.retry_at <= now]
            for identity in due:
                episode = self._episodes.get(identity)
                if episode is None:
                    continue
                delivered = episode.delivered
                if self._flush(identity):
                    continue
                if episode.delivered > delivered:
                    moved = True
                    episode.backoff = 0.0
                    episode.retry_at = now
                elif now - episode.heard >= DROPPED_FORGET_S:
                    self._forget(identity, f"silent for {DROPPED_FORGET_S:g} s")
                else:
                    episode.stalls += 1
                    episode.backoff = min(
                        max(2 * episode.backoff, DROPPED_RETRY_S), DROPPED_RETRY_MAX_S
                    )
                    episode.retry_at = now + episode.backoff
            delay = MOVING_RETRY_S if moved else DROPPED_RETRY_S
            if not self._episodes and not self._backlogs:
                self._retry_wanted.clear()


def _pending(episode: Episode) -> int:
    return sum(_notice_size(msg) for msg in episode.kept) + len(episode.terminals)


def _terminals(rank: int, request_ids: list[str]) -> wire.Output:
    return wire.Output(
        dp_rank=rank,
        outputs=[
            wire.OutputEntry(
                request_id=request_id, token_ids=[], finished=True, finish_reason="cancelled"
            )
            for request_id in request_ids
        ],
    )
