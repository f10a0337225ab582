"""Sleeping until an absolute deadline on the event loop, on time and without spinning.

A paced rank waits for each pass's modeled end. asyncio's own timers are not precise enough
for that: the epoll selector rounds its timeout UP to whole milliseconds, so `asyncio.sleep`
wakes up to 1 ms late on every pass. Waking early and yielding (`sleep(0)`) until the deadline
was on time but re-polled the event loop thousands of times a second on every rank.

`TimerfdPacer` asks the kernel instead: a Linux timerfd (CLOCK_MONOTONIC, armed with an
absolute expiry in nanoseconds) is registered with the loop's selector via `add_reader`, so
epoll returns exactly when the timer expires, with nothing to poll in between. One timerfd
serves one waiter and is re-armed for every deadline (no fd per pass); `close` releases it.

`SleepPacer` is the fallback where that is not possible (no timerfd, e.g. not Linux; or a
clock other than `time.monotonic`, whose deadlines the kernel timer cannot express): plain
`asyncio.sleep`, which may wake a little late but never early and never spins.

Deadlines are in seconds of the pacer's clock. A deadline in the past (also a negative one)
fires at once, still through the event loop; a non-finite one (NaN, +-inf) is refused with
ValueError: it is a bug in the caller's arithmetic, and sleeping forever on it would hide it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Protocol

# Linux <sys/timerfd.h> / <time.h>, for the ctypes path (Python < 3.13 has no os.timerfd_*).
_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = 0o4000  # = O_NONBLOCK
_TFD_CLOEXEC = 0o2000000  # = O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class Pacer(Protocol):
    """Sleeps until deadlines of one clock; one waiter at a time."""

    async def sleep_until(self, deadline: float) -> None:
        """Return once the clock has reached `deadline` (seconds); see the module doc."""
        ...

    def close(self) -> None:
        """Release what the pacer holds; it must not be used afterwards."""
        ...


def _check(deadline: float) -> None:
    if not math.isfinite(deadline):
        raise ValueError(f"pacing deadline must be finite, got {deadline!r}")


class SleepPacer:
    """The event loop's timers: a little late (epoll's whole milliseconds), never spinning."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock

    async def sleep_until(self, deadline: float) -> None:
        _check(deadline)
        # One sleep for the whole remainder, as measured by `clock`. asyncio rounds the
        # selector's timeout up, so with the loop's own clock this is never early.
        await asyncio.sleep(max(deadline - self._clock(), 0.0))

    def close(self) -> None:
        pass


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


class _LibcTimerfd:
    """timerfd_create/timerfd_settime through ctypes (Linux, Python < 3.13)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._create = libc.timerfd_create
        self._create.argtypes = (ctypes.c_int, ctypes.c_int)
        self._create.restype = ctypes.c_int
        self._settime = libc.timerfd_settime
        self._settime.argtypes = (
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.POINTER(_Itimerspec),
        )
        self._settime.restype = ctypes.c_int
        self._spec = _Itimerspec()  # reused: arming allocates nothing

    def create(self) -> int:
        fd: int = self._create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
        return fd

    def set_abs_ns(self, fd: int, ns: int) -> None:
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
        if self._settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))


class _OsTimerfd:
    """The same through the os module (Python >= 3.13 on Linux)."""

    def create(self) -> int:
        fd: int = os.timerfd_create(  # type: ignore[attr-defined,unused-ignore]
            time.CLOCK_MONOTONIC,
            flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC,  # type: ignore[attr-defined,unused-ignore]
        )
        return fd

    def set_abs_ns(self, fd: int, ns: int) -> None:
        os.timerfd_settime_ns(  # type: ignore[attr-defined,unused-ignore]
            fd,
            flags=os.TFD_TIMER_ABSTIME,  # type: ignore[attr-defined,unused-ignore]
            initial=ns,
        )


_Backend = _LibcTimerfd | _OsTimerfd
_backend: _Backend | None = None
_backend_failed = False


def _timerfd_backend() -> _Backend | None:
    """The process's timerfd functions, or None where there are none (looked up once)."""
    global _backend, _backend_failed
    if _backend is None and not _backend_failed:
        try:
            if not sys.platform.startswith("linux"):
                raise OSError("timerfd is Linux only")
            if time.get_clock_info("monotonic").implementation != "clock_gettime(CLOCK_MONOTONIC)":
                raise OSError("time.monotonic is not CLOCK_MONOTONIC")
            backend: _Backend = _OsTimerfd() if hasattr(os, "timerfd_create") else _LibcTimerfd()
            os.close(backend.create())  # probe: seccomp or an old kernel may refuse it
            _backend = backend
        except (OSError, AttributeError):
            _backend_failed = True
    return _backend


class TimerfdPacer:
    """A timerfd on the running event loop's selector: wakes on the nanosecond, no polling.

    The fd stays registered with `add_reader` while the pacer lives (one epoll_ctl, not two
    per pass); a disarmed timerfd is never readable, so it costs nothing between deadlines.
    Each `sleep_until` re-arms it with `timerfd_settime`, which replaces the previous expiry
    and resets the expiration count, so a deadline never fires for a later waiter.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, backend: _Backend) -> None:
        self._loop = loop
        self._backend = backend
        self._fd: int | None = backend.create()
        self._waiter: asyncio.Future[None] | None = None
        try:
            loop.add_reader(self._fd, self._fired)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    @property
    def fd(self) -> int | None:
        """The timerfd (None once closed)."""
        return self._fd

    def arm(self, deadline: float) -> asyncio.Future[None]:
        """Set the timer for `deadline` (seconds of time.monotonic) and return the future it
        resolves. Re-arming replaces the previous deadline; a waiter still pending on it gets
        the same future, now resolved at the new deadline."""
        _check(deadline)
        fd = self._fd
        if fd is None:
            raise RuntimeError("the pacer is closed")
        # Rounded up (never early), and at least 1 ns: an it_value of 0 would disarm it;
        # any expiry in the past fires at once.
        self._backend.set_abs_ns(fd, max(math.ceil(deadline * 1e9), 1))
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = self._loop.create_future()
        return waiter

    async def sleep_until(self, deadline: float) -> None:
        waiter = self.arm(deadline)
        try:
            await waiter
        finally:
            if self._waiter is waiter:
                self._waiter = None

    def _fired(self) -> None:
        fd = self._fd
        if fd is None:
            return
        try:
            os.read(fd, 8)  # the expiration count: reading it makes the fd unreadable again
        except BlockingIOError:
            return  # re-armed after epoll reported it: the new deadline is not due yet
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(fd)
        os.close(fd)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.cancel()


def open_pacer(clock: Callable[[], float] = time.monotonic) -> Pacer:
    """The best pacer for `clock` on the running event loop: a timerfd for time.monotonic
    where Linux has one, else `SleepPacer`. Call it inside the loop; `close` the result."""
    if clock is time.monotonic:
        backend = _timerfd_backend()
        if backend is not None:
            try:
                return TimerfdPacer(asyncio.get_running_loop(), backend)
            except (OSError, NotImplementedError):
                pass  # out of fds, or a loop without add_reader (e.g. Proactor): fall back
    return SleepPacer(clock)
