"""Per-client state of the control socket, the one way out to a client, and the slow-reader policy.

Every message to a client leaves through `ClientTable.send`: NOBLOCK on a ROUTER_MANDATORY
socket, so a send never blocks the engine and fails at once, either because the peer is
gone (EHOSTUNREACH) or because it left SNDHWM messages unread (EAGAIN: the ROUTER's per-peer
pipe is full). A full pipe is only a client behind: what does not fit waits in the client's
`Backlog`, encoded and counted, and goes out, in order, as the pipe takes it (tried at each
send to the client, each message from it, and with the dropped clients' retries). A client
that is gone, or whose unread messages (pipe and backlog) pass `limit` or whose backlog
passes `byte_limit`, is **dropped**: its requests are cancelled and their KV freed (it
cannot take their outputs), and an *episode* starts, logged once, which keeps what the client
must still learn (`engined.server.control.episodes`). When the client can be written to again
(tried after DROPPED_RETRY_S, backing off to DROPPED_RETRY_MAX_S, every MOVING_RETRY_S while it
takes what is tried, and whenever it sends a message) its notices are delivered in order and the
episode ends; a `watch_load` client is subscribed again and gets every rank's load at once.

Memory is bounded whatever clients do: per-identity state lives only while the identity has
something in flight (a command being applied, a request, a handoff route, a load watch, a
backlog, an episode), a backlog holds at most `byte_limit` bytes, the episodes are bounded
(`engined.server.control.episodes`), and an episode whose client shows no sign of life for
DROPPED_FORGET_S is forgotten, so clients that vanish leave nothing behind.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import msgspec
import structlog
import zmq
import zmq.asyncio

from engined.config.schema import CONTROL_UNREAD_BYTES
from engined.server.control.backlog import Backlogs
from engined.server.control.episodes import (
    TERMINALS_PER_MESSAGE,
    Episode,
    Episodes,
    terminals_message,
)
from engined.wire import control as wire
from engined.zmq_sockets import send_frames_nowait

log = structlog.get_logger(__name__)

DELIMITER = b""
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
        # A message written as bytes is decoded again only to be kept (`send_encoded`).
        self._decode = wire.ReplyDecoder().decode
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
        self._episodes = Episodes(unanswered_text=self._unanswered_text, forgotten=self.settle)
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
        return self._episodes.notices

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
            self._episodes.keep(identity, episode, msg)
            return
        self._deliver(identity, self._encode(msg), msg)

    def send_encoded(self, identity: bytes, body: bytes) -> None:
        """`send` of a message written as bytes (a pass's `output`, `OutputWriter`): it is
        decoded again only if it has to be kept."""
        episode = self._episodes.get(identity)
        if episode is not None:
            self._episodes.keep(identity, episode, self._decode(body))
            return
        self._deliver(identity, body, None)

    def _deliver(self, identity: bytes, body: bytes, msg: wire.DaemonMessage | None) -> None:
        """Send `body` (`msg` encoded; None: decode it when it has to be kept)."""
        backlogs = self._backlogs
        if identity in backlogs and not backlogs.flush(identity, self._try_send):
            self._queue(identity, body, self._decode(body) if msg is None else msg)
            return
        reason = self._try_send(identity, body)
        if reason is None:
            return
        if msg is None:
            msg = self._decode(body)
        if reason == "too slow" and backlogs.enabled:
            self._queue(identity, body, msg)
            return
        self._episodes.keep(identity, self._drop(identity, reason), msg)

    def send_terminals(self, identity: bytes, rank: int, request_ids: list[str]) -> None:
        """Tell the owner its requests ended as `cancelled` (one terminal entry each)."""
        episode = self._episodes.get(identity)
        if episode is not None:
            self._episodes.keep_terminals(identity, episode, rank, request_ids)
            return
        for start in range(0, len(request_ids), TERMINALS_PER_MESSAGE):
            chunk = request_ids[start : start + TERMINALS_PER_MESSAGE]
            self.send(identity, terminals_message(rank, chunk))

    def unanswered(self, identity: bytes, msg_id: int | str | None) -> None:
        """A dropped client's message was not handled: it gets `overloaded` once it reads."""
        self._episodes.unanswered(identity, msg_id)

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
        if self._backlogs.queue(identity, body, self._episodes.notice(msg)):
            self._drop(identity, "too slow")

    # --- episodes -----------------------------------------------------------------------

    def _drop(self, identity: bytes, reason: str) -> Episode:
        episode = self._episodes.start(identity, reason)
        self._retry_wanted.set()
        # What waited in its backlog becomes its first notices, in order.
        backlog = self._backlogs.take(identity)
        for notice in backlog.notices():
            self._episodes.keep(identity, episode, notice)
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

    def _flush(self, identity: bytes) -> bool:
        """Deliver the episode's notices in order; True once all are out (it has ended)."""
        episode = self._episodes.flush(identity, lambda msg: self._sent(identity, msg))
        if episode is None:
            return False
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

    def _sent(self, identity: bytes, msg: wire.DaemonMessage) -> bool:
        return self._try_send(identity, self._encode(msg)) is None

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
                    self._episodes.forget(identity, f"silent for {DROPPED_FORGET_S:g} s")
                else:
                    episode.stalls += 1
                    episode.backoff = min(
                        max(2 * episode.backoff, DROPPED_RETRY_S), DROPPED_RETRY_MAX_S
                    )
                    episode.retry_at = now + episode.backoff
            delay = MOVING_RETRY_S if moved else DROPPED_RETRY_S
            if not self._episodes and not self._backlogs:
                self._retry_wanted.clear()
