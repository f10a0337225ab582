"""Control clients' messages that ZeroMQ could not take yet, counted in bytes.

libzmq bounds a ROUTER's pipe to each peer in messages (SNDHWM) and says nothing per peer,
so a pipe of 100,000 messages let one client that does not read hold gigabytes of large
replies (20 unread `welcome`s of 60 MB each: +0.8 GB). The daemon therefore keeps each
peer's pipe small and queues what does not fit here, encoded, where the bytes are counted;
`engined.server.control.clients` sends through it and drops a client past its limits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from engined.wire import control as wire

# (identity, body) -> None when ZeroMQ took it, else why not.
Send = Callable[[bytes, bytes], str | None]


class Backlog:
    """Encoded messages for one client, in order, each with its notice: what the client
    must still learn of it should it be dropped (None: nothing)."""

    __slots__ = ("_items", "bytes", "moved_at")

    def __init__(self) -> None:
        self._items: deque[tuple[bytes, wire.DaemonMessage | None]] = deque()
        self.bytes = 0
        # When it started, or last sent something (monotonic seconds).
        self.moved_at = time.monotonic()

    def __len__(self) -> int:
        return len(self._items)

    def append(self, body: bytes, notice: wire.DaemonMessage | None) -> None:
        self._items.append((body, notice))
        self.bytes += len(body)

    def flush(self, identity: bytes, send: Send) -> int:
        """Send from the head while ZeroMQ takes it; the bytes sent."""
        sent = 0
        items = self._items
        while items and send(identity, items[0][0]) is None:
            sent += len(items.popleft()[0])
        if sent:
            self.bytes -= sent
            self.moved_at = time.monotonic()
        return sent

    def notices(self) -> Iterator[wire.DaemonMessage]:
        for _, notice in self._items:
            if notice is not None:
                yield notice


class Backlogs(dict[bytes, Backlog]):
    """The backlogs of one ROUTER's clients by identity, and the limits past which a client
    is dropped: `messages` unread in all (its pipe of `pipe` messages, then its backlog),
    `byte_limit` bytes in its backlog. With `messages` no more than `pipe` there are none.

    A dict, so that the test every send makes (`identity in backlogs`) stays a C lookup.
    """

    def __init__(self, *, pipe: int, messages: int, byte_limit: int) -> None:
        super().__init__()
        self.pipe = pipe
        self.messages = messages
        self.byte_limit = byte_limit
        self.enabled = messages > pipe
        # Of every backlog together.
        self.bytes = 0

    def queue(self, identity: bytes, body: bytes, notice: wire.DaemonMessage | None) -> bool:
        """Keep `body` for `identity`; True once that takes the client past its limits."""
        backlog = self.get(identity)
        if backlog is None:
            backlog = self[identity] = Backlog()
        backlog.append(body, notice)
        self.bytes += len(body)
        return backlog.bytes > self.byte_limit or self.pipe + len(backlog) > self.messages

    def flush(self, identity: bytes, send: Send) -> bool:
        """Send `identity`'s backlog while ZeroMQ takes it; True once it is all out."""
        backlog = self[identity]
        self.bytes -= backlog.flush(identity, send)
        if backlog:
            return False
        del self[identity]
        return True

    def stalled(self, identity: bytes, since: float) -> bool:
        """Whether `identity`'s backlog has sent nothing since `since`."""
        return self[identity].moved_at < since

    def take(self, identity: bytes) -> Backlog:
        """Remove `identity`'s backlog (the client was dropped); empty if it had none."""
        backlog = self.pop(identity, None) or Backlog()
        self.bytes -= backlog.bytes
        return backlog
