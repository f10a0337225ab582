"""Real-time scheduling for a paced daemon (`realtime_priority`).

On a shared machine a paced pass starts late mostly because its thread, woken at the
deadline, waits runnable on a CPU run queue behind another process: the fair scheduler gives
a waking thread no precedence (`benchmarks/e2e_throughput.py --pacing` counts such passes).
SCHED_FIFO does: a thread at any real-time priority runs as soon as it is runnable, before
every normal thread, and a paced daemon is asleep nearly all the time, so it takes little.

Every thread of the process is moved, the ZeroMQ I/O threads included (they carry the
outputs); threads and processes started later inherit the policy, and each rank worker
applies it again to its own threads. Only a paced daemon may ask (config validation): an
unpaced rank never sleeps, and at real-time priority it would hold its core against every
normal thread but for the kernel's real-time throttling share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

SchedulerSetter = Callable[[int, int, "os.sched_param"], None]


class RealtimeUnavailable(OSError):
    """The process may not run at the priority asked for (a start-up failure)."""


def threads_of_this_process() -> list[int]:
    """Every thread id of this process (Linux: /proc/self/task), or the calling thread (0)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def enter_realtime(
    priority: int,
    *,
    setter: SchedulerSetter | None = None,
    threads: Callable[[], Iterable[int]] = threads_of_this_process,
) -> None:
    """Run every thread of this process under SCHED_FIFO at `priority` (1-99).

    Raises `RealtimeUnavailable` naming the setting and what would allow it.
    """
    policy = getattr(os, "SCHED_FIFO", None)
    set_scheduler = setter or getattr(os, "sched_setscheduler", None)
    if policy is None or set_scheduler is None:
        raise RealtimeUnavailable("realtime_priority: SCHED_FIFO is not available on this platform")
    for tid in threads():
        try:
            set_scheduler(tid, policy, os.sched_param(priority))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as exc:
            raise RealtimeUnavailable(
                f"realtime_priority: cannot run at SCHED_FIFO priority {priority}: "
                f"{exc.strerror or exc}; it needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at "
                f"least {priority} (systemd: LimitRTPRIO={priority} and RestrictRealtime=no)"
            ) from None
