"""Where what a daemon sends waits for its reader: the bookkeeping under `Connection`.

Kept apart from the socket and its reader so that the routing rules read in one place and
touch no socket: a direct reply resolves the call that sent its `id` (or the oldest raw
sender), an `output` entry goes to its request's queue, a `lifecycle` event to its
handoff's queue and to the general feed, and a failure to every one of them.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import AsyncGenerator
from typing import Final, TypeAlias, TypeVar

import structlog

from engined.wire.control import DirectReply, Lifecycle, Output, OutputEntry, WireLifecycleEvent

log = structlog.get_logger()

# The general lifecycle feed keeps the newest events only: a caller that reads per handoff
# never drains it.
LIFECYCLE_FEED_SIZE: Final = 10_000

_T = TypeVar("_T")


class _End(enum.Enum):
    """Ends a stream once the client's own cancel was applied.

    A current daemon sends the request's `cancelled` terminal before `applied`, so the
    stream has ended on that entry already; an older one sends no terminal, and this marker
    is what ends the stream.
    """

    END = enum.auto()


_StreamItem: TypeAlias = OutputEntry | _End | BaseException
_LifecycleItem: TypeAlias = WireLifecycleEvent | BaseException


class Mailboxes:
    """The pending calls and the queues of one connection, and whether it still works.

    `Connection` adds the socket, fills these from its reader and says what makes it
    unusable (`_check_usable`, which knows the daemon's liveness).
    """

    def __init__(self) -> None:
        self._pending: dict[int, asyncio.Future[DirectReply]] = {}
        # ids of calls that gave up (timeout, cancellation): their late replies are dropped
        # instead of being taken for the reply to a raw message.
        self._abandoned: set[int] = set()
        # send_raw() callers, oldest first: they take the direct replies no call claims.
        self._raw_waiters: deque[asyncio.Future[DirectReply]] = deque()
        self._streams: dict[str, asyncio.Queue[_StreamItem]] = {}
        # Requests whose queue holds their finished entry, not read yet: a lost connection
        # keeps them, since what the daemon sent before it went is theirs to collect.
        self._settled: set[str] = set()
        self._handoffs: dict[str, asyncio.Queue[_LifecycleItem]] = {}
        self._lifecycle: asyncio.Queue[_LifecycleItem] = asyncio.Queue(LIFECYCLE_FEED_SIZE)
        self._failure: BaseException | None = None
        self._closed = False

    def _check_usable(self) -> None:
        """Raise what a call would meet on this connection now; `Connection` decides."""
        raise NotImplementedError

    def _stream_queue(self, request_id: str) -> asyncio.Queue[_StreamItem]:
        queue = self._streams.get(request_id)
        if queue is None:
            if self._failure is not None or self._closed:
                self._check_usable()
            queue = self._streams[request_id] = asyncio.Queue()
        return queue

    def _handoff_queue(self, handoff_id: str) -> asyncio.Queue[_LifecycleItem]:
        queue = self._handoffs.get(handoff_id)
        if queue is None:
            if self._failure is not None or self._closed:
                self._check_usable()
            queue = self._handoffs[handoff_id] = asyncio.Queue()
        return queue

    async def _get(self, queue: asyncio.Queue[_T], timeout: float | None) -> _T:
        # What is queued is taken without a wait (nor its timeout scope): a relay streaming
        # tokens calls this once per chunk.
        if not queue.empty():
            return queue.get_nowait()
        # Nothing will ever arrive on a closed client: fail now rather than time out.
        self._check_usable()
        if timeout is None:
            return await queue.get()
        async with asyncio.timeout(timeout):
            return await queue.get()

    def _end_stream(self, request_id: str) -> None:
        """End the stream of a request this client cancelled (see `_End`)."""
        self._settled.discard(request_id)
        queue = self._streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(_End.END)

    async def _entries(
        self, request_id: str, timeout: float | None, *, backlog: bool
    ) -> AsyncGenerator[list[OutputEntry], None]:
        """The request's output entries until its finished one, in lists.

        With `backlog` each list is every entry that had arrived by then, else one entry: the
        one loop behind `outputs` and `output_batches`, so both end, forget their queue and
        hand on a reader failure alike. Entries still queued stay there for a later reader.
        `timeout` bounds the wait for each list.
        """
        queue = self._stream_queue(request_id)
        while True:
            item = await self._get(queue, timeout)
            batch: list[OutputEntry] = []
            end = False
            while True:
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                if item is _End.END:
                    end = True
                    break
                batch.append(item)
                if item.finished or not backlog or queue.empty():
                    end = item.finished
                    break
                item = queue.get_nowait()
            # Once the stream is over, forget its queue so finished requests do not pile up.
            if end and self._streams.get(request_id) is queue:
                del self._streams[request_id]
                self._settled.discard(request_id)
            if batch:
                yield batch
            if end:
                return

    def _route(self, msg: Output | Lifecycle) -> None:
        """Queue streamed entries by the request or handoff they name."""
        if isinstance(msg, Output):
            for entry in msg.outputs:
                self._stream_queue(entry.request_id).put_nowait(entry)
                if entry.finished:
                    self._settled.add(entry.request_id)
            return
        for event in msg.events:
            self._handoff_queue(event.handoff_id).put_nowait(event)
            _put_dropping_oldest(self._lifecycle, event)

    def _forget_all(self) -> None:
        """Drop every request, handoff and late reply: a lost connection's are gone with it,
        but for the requests that finished before it, whose outputs wait for their reader."""
        self._streams = {rid: q for rid, q in self._streams.items() if rid in self._settled}
        self._handoffs.clear()
        self._abandoned.clear()

    def _resolve(self, reply: DirectReply) -> None:
        message_id = reply.id
        if isinstance(message_id, int):
            future = self._pending.pop(message_id, None)
            if future is not None:
                if not future.done():
                    future.set_result(reply)
                return
            if message_id in self._abandoned:
                self._abandoned.discard(message_id)
                log.debug("late reply dropped", id=message_id)
                return
        while self._raw_waiters:
            waiter = self._raw_waiters.popleft()
            if not waiter.done():
                waiter.set_result(reply)
                return
        log.warning("unclaimed daemon reply", type=reply_tag(type(reply)), id=message_id)

    def _fail_all(self, exc: BaseException) -> None:
        """Hand `exc` to every waiting call and every stream and lifecycle consumer."""
        futures = [*self._pending.values(), *self._raw_waiters]
        self._pending.clear()
        self._raw_waiters.clear()
        for future in futures:
            if not future.done():
                future.set_exception(exc)
        for queue in self._streams.values():
            queue.put_nowait(exc)
        for handoff_queue in self._handoffs.values():
            handoff_queue.put_nowait(exc)
        _put_dropping_oldest(self._lifecycle, exc)


def _put_dropping_oldest(queue: asyncio.Queue[_LifecycleItem], item: _LifecycleItem) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


def reply_tag(cls: type[DirectReply]) -> str:
    tag = cls.__struct_config__.tag
    return tag if isinstance(tag, str) else cls.__name__
