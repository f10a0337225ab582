"""Dropped clients: an *episode* per client, from the failed send to the delivery of what it
must still learn, its *notices*.

A dropped client's requests were cancelled and its KV freed; the daemon keeps, in order, the
direct replies and lifecycle events that could not be sent, the final entries of any output
that could not be sent, one `cancelled` terminal per request that was ended, and an
`overloaded` error for each message it sent meanwhile (past MAX_UNANSWERED, one error without
an id counts the rest). Memory stays bounded whatever clients do: at most
MAX_DROPPED_CLIENTS episodes are remembered (the oldest is forgotten), all of them together
keep at most MAX_NOTICES notices, and none is a large reply (a `welcome` or `stats` reply a
dropped client was owed becomes an `overloaded` error: it asks again). When and how often a
dropped client is tried again is `engined.server.control.clients`'.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

import structlog

from engined.wire import control as wire

log = structlog.get_logger(__name__)

# The most episodes remembered, and their notices all together (a notice is a message or,
# for terminals and kept output entries, one entry: ~100-400 bytes).
MAX_DROPPED_CLIENTS: Final = 1024
MAX_NOTICES: Final = 65_536
# The most `overloaded` replies kept for messages a client sends while dropped; the rest
# are counted, in one `overloaded` error without an id, and in the log line that ends the
# episode.
MAX_UNANSWERED: Final = 1024
# The most terminals per `output` message when they are delivered.
TERMINALS_PER_MESSAGE: Final = 1024


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


# Delivers one notice now, or says it cannot (the client's pipe is still full).
Deliver = Callable[[wire.DaemonMessage], bool]


class Episodes:
    """The episodes of one control socket's dropped clients, oldest first."""

    def __init__(self, *, unanswered_text: str, forgotten: Callable[[bytes], None]) -> None:
        """`unanswered_text` is every kept `overloaded` reply's message (one string for a
        flooder's 1,024); `forgotten` is told of each identity whose episode is forgotten."""
        self._episodes: OrderedDict[bytes, Episode] = OrderedDict()
        self.notices = 0
        self._unanswered_text = unanswered_text
        self._forgotten = forgotten

    def __len__(self) -> int:
        return len(self._episodes)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._episodes

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._episodes)

    def get(self, identity: bytes) -> Episode | None:
        return self._episodes.get(identity)

    def values(self) -> Iterator[Episode]:
        return iter(self._episodes.values())

    def items(self) -> Iterator[tuple[bytes, Episode]]:
        return iter(self._episodes.items())

    def start(self, identity: bytes, reason: str) -> Episode:
        now = time.monotonic()
        episode = Episode(reason, now, now)
        self._episodes[identity] = episode
        while len(self._episodes) > MAX_DROPPED_CLIENTS:
            self._forget_oldest()
        return episode

    def keep(self, identity: bytes, episode: Episode, msg: wire.DaemonMessage) -> None:
        notice = self.notice(msg)
        if notice is None:
            return
        size = _notice_size(notice)
        if self._make_room(identity, episode, size):
            episode.kept.append(notice)
            self.notices += size

    def keep_terminals(
        self, identity: bytes, episode: Episode, rank: int, request_ids: list[str]
    ) -> None:
        for request_id in request_ids:
            if self._make_room(identity, episode, 1):
                episode.terminals.append((rank, request_id))
                self.notices += 1

    def unanswered(self, identity: bytes, msg_id: int | str | None) -> None:
        """A dropped client's message was not handled: it gets `overloaded` once it reads."""
        episode = self._episodes[identity]
        episode.unanswered += 1
        if episode.unanswered > MAX_UNANSWERED:
            episode.ignored += 1
            return
        reply = wire.ErrorReply(id=msg_id, code="overloaded", message=self._unanswered_text)
        self.keep(identity, episode, reply)

    def notice(self, msg: wire.DaemonMessage) -> wire.DaemonMessage | None:
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

    def flush(self, identity: bytes, deliver: Deliver) -> Episode | None:
        """Deliver the episode's notices in order; the episode once all are out (it has
        ended and is no longer kept), None while some wait."""
        episode = self._episodes[identity]
        while episode.kept:
            if not self._deliver(episode, episode.kept[0], deliver):
                return None
            self.notices -= _notice_size(episode.kept.popleft())
        while episode.terminals:
            rank = episode.terminals[0][0]
            count = 0
            for other, _ in episode.terminals[:TERMINALS_PER_MESSAGE]:
                if other != rank:
                    break
                count += 1
            chunk = [request_id for _, request_id in episode.terminals[:count]]
            if not self._deliver(episode, terminals_message(rank, chunk), deliver):
                return None
            del episode.terminals[:count]
            self.notices -= count
        if episode.ignored > episode.summarised:
            # The messages past MAX_UNANSWERED have no reply of their own; one line, no id,
            # says how many there were.
            text = f"{episode.ignored} more messages were not processed: {self._unanswered_text}"
            summary = wire.ErrorReply(code="overloaded", message=text)
            if not self._deliver(episode, summary, deliver):
                return None
            episode.summarised = episode.ignored
        del self._episodes[identity]
        return episode

    def forget(self, identity: bytes, why: str) -> None:
        episode = self._episodes.pop(identity)
        pending = sum(_notice_size(msg) for msg in episode.kept) + len(episode.terminals)
        self.notices -= pending
        log.info("dropped client forgotten", identity=identity.hex(), notices=pending, why=why)
        self._forgotten(identity)

    def _deliver(self, episode: Episode, msg: wire.DaemonMessage, deliver: Deliver) -> bool:
        if not deliver(msg):
            return False
        episode.delivered += _notice_size(msg)
        episode.heard = time.monotonic()
        return True

    def _make_room(self, identity: bytes, episode: Episode, size: int) -> bool:
        while self.notices + size > MAX_NOTICES:
            if not self._forget_oldest(but=identity):
                episode.lost += size
                return False
        return True

    def _forget_oldest(self, but: bytes | None = None) -> bool:
        for identity in self._episodes:
            if identity != but:
                self.forget(identity, "too many dropped clients")
                return True
        return False


def terminals_message(rank: int, request_ids: list[str]) -> wire.Output:
    """One `cancelled` terminal entry per request."""
    return wire.Output(
        dp_rank=rank,
        outputs=[
            wire.OutputEntry(
                request_id=request_id, token_ids=[], finished=True, finish_reason="cancelled"
            )
            for request_id in request_ids
        ],
    )


def _notice_size(msg: wire.DaemonMessage) -> int:
    return len(msg.outputs) if isinstance(msg, wire.Output) else 1
