"""The systemd notify protocol, spoken directly: one datagram per message to `$NOTIFY_SOCKET`.

A `Type=notify` unit learns from these messages when the daemon is ready (`READY=1`, once
every socket is bound, so units ordered after it can connect), what it is doing (`STATUS=`,
shown by `systemctl status`), that its event loop is alive (`WATCHDOG=1`, which systemd
expects every `WatchdogSec=`; a loop that stops pinging is killed and restarted), and that it
is stopping on purpose (`STOPPING=1`). The protocol is a few `KEY=VALUE` lines in one
AF_UNIX datagram, so we write it ourselves rather than depend on libsystemd bindings.

Outside systemd (`NOTIFY_SOCKET` unset) `Notifier.from_env` returns a `NullNotifier`, and the
daemon calls the same methods without checking where it runs.

The environment is read, not cleared: sd_notify's `unset_environment` exists so that child
processes do not talk to systemd in the daemon's name, but the daemon starts no children,
the units set `NotifyAccess=main` (systemd ignores any other sender), and `WATCHDOG_PID`
already tells a child that the watchdog is not its job. Reading a mapping also keeps
`from_env` free of side effects, so tests pass a dict.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence

import structlog

from engined.server.ranks.rank_gauges import RankGauges

log = structlog.get_logger(__name__)

# How often the daemon refreshes STATUS= (the one-line summary of `systemctl status`).
STATUS_INTERVAL_S = 5.0


class _Messages:
    """The named messages, all spelled through `notify`; shared by both notifiers."""

    def notify(self, **fields: object) -> bool:
        raise NotImplementedError

    def ready(self, status: str | None = None) -> bool:
        """Startup is complete: every socket is bound and clients may connect."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown has begun, so systemd does not take the exit for a crash."""
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=status)


class NullNotifier(_Messages):
    """Not under systemd: every message is dropped, so callers never check where they run."""

    enabled = False

    def notify(self, **fields: object) -> bool:
        return False

    def close(self) -> None:
        pass


class Notifier(_Messages):
    """Sends notify messages to one socket; never raises on a failed send.

    A failed send (socket gone, receiver's queue full) is logged once at warning and counted
    in `failures`: the daemon must keep serving even if its supervisor went away, and a
    watchdog ping every few seconds must not flood the log.
    """

    enabled = True

    def __init__(self, address: str) -> None:
        """`address` is a filesystem path or `@name` for the abstract namespace."""
        self.address = address
        # NOTE: the abstract namespace is spelled `@name` in NOTIFY_SOCKET and `\0name` to
        # the kernel (sd_notify does the same translation).
        self._target = "\0" + address[1:] if address.startswith("@") else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # NOTE: non-blocking because the sender is the event loop: a datagram to a full
        # AF_UNIX queue would otherwise block every rank. A dropped ping is repeated at the
        # next interval; systemd reads its socket promptly, so READY=1 does not get dropped.
        self._sock.setblocking(False)
        self.failures = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Notifier | NullNotifier:
        """The notifier `NOTIFY_SOCKET` asks for, or a `NullNotifier` when there is none."""
        address = environ.get("NOTIFY_SOCKET", "")
        if not address:
            return NullNotifier()
        if not address.startswith(("/", "@")) or len(address) < 2:
            # e.g. systemd >= 253's `vsock:` addresses, for virtual machines.
            log.warning("unsupported NOTIFY_SOCKET, not notifying systemd", address=address)
            return NullNotifier()
        return cls(address)

    def notify(self, **fields: object) -> bool:
        """Send `KEY=VALUE` lines in one datagram; True when the datagram went out.

        A newline inside a value would start a new field, so it becomes a space.
        """
        payload = "\n".join(f"{key}={_one_line(value)}" for key, value in fields.items())
        try:
            self._sock.sendto(payload.encode(), self._target)
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning(
                    "systemd notify failed; further failures are not logged",
                    address=self.address,
                    error=str(exc),
                )
            return False
        return True

    def close(self) -> None:
        self._sock.close()


AnyNotifier = Notifier | NullNotifier


def _one_line(value: object) -> str:
    return str(value).replace("\n", " ")


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of `WATCHDOG_USEC`), or None for no watchdog.

    Half the timeout is what sd_watchdog_enabled(3) recommends: one late ping is not yet a
    missed deadline. `WATCHDOG_PID` names the process the watchdog is for; when it is set
    and is not us (we were started by the supervised process), the watchdog is not ours.
    """
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    pid = environ.get("WATCHDOG_PID", "")
    try:
        if pid and int(pid) != os.getpid():
            return None
        timeout_us = int(usec)
    except ValueError:
        log.warning("bad watchdog environment, watchdog off", watchdog_usec=usec, watchdog_pid=pid)
        return None
    if timeout_us <= 0:
        return None
    return timeout_us / 2 / 1e6


async def keepalive(
    notifier: AnyNotifier,
    status: Callable[[], str],
    *,
    watchdog_s: float | None,
    status_s: float = STATUS_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    healthy: Callable[[], bool] | None = None,
) -> None:
    """Ping the watchdog every `watchdog_s` and refresh STATUS every `status_s`, forever.

    This is a task on the daemon's own event loop, so the pings prove that the loop is
    turning: a rank stuck in a pass (or any blocking call) stops them and systemd restarts
    the daemon. The first ping goes out at once. The next deadline counts from when a ping
    was actually sent, so a loop that was late catches up with one ping, not a burst.

    `healthy` covers what this loop cannot see turning (rank worker processes): while it
    answers False no ping goes out (checked again every quarter interval), so systemd
    restarts a daemon one of whose processes is stuck.
    """
    now = clock()
    next_ping = now if watchdog_s else math.inf
    next_status = now + status_s
    unhealthy = False
    while True:
        now = clock()
        if now >= next_ping:
            if healthy is None or healthy():
                notifier.watchdog()
                next_ping = now + (watchdog_s or math.inf)
                unhealthy = False
            else:
                if not unhealthy:
                    log.warning("a rank worker is not answering; watchdog pings withheld")
                unhealthy = True
                next_ping = now + (watchdog_s or math.inf) / 4
        if now >= next_status:
            notifier.status(status())
            next_status = now + status_s
        await asyncio.sleep(max(min(next_ping, next_status) - clock(), 0.0))


class StatusLine:
    """systemd's STATUS=, one line: the ranks' load, and output tokens/s since the last line."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tokens = 0
        self._at = clock()

    def __call__(self, ranks: Sequence[RankGauges], *, stopping: bool) -> str:
        now = self._clock()
        tokens = sum(g.tokens_total for g in ranks)
        rate = (tokens - self._tokens) / max(now - self._at, 1e-6)
        self._tokens, self._at = tokens, now
        line = (
            f"{len(ranks)} ranks, {sum(g.metrics.running for g in ranks)} running, "
            f"{sum(g.metrics.waiting for g in ranks)} waiting, {rate:.0f} tokens/s"
        )
        return f"stopping: {line}" if stopping else line
