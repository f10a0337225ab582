"""`realtime_priority`: every thread of a paced daemon and of its rank workers runs SCHED_FIFO.

The policy is checked with stand-in setters, the daemon's refusal in this test's loop (the
setter replaced, so this process never changes policy), and the real thing on a real
`engined serve` with two rank workers, read back from /proc.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engined.client import EngineClient
from engined.config import load_config
from engined.server import daemon as daemon_module
from engined.server.daemon import STARTUP_FAILURE, Daemon
from engined.server.ranks.realtime import (
    RealtimeUnavailable,
    enter_realtime,
    threads_of_this_process,
)
from tests.server.daemon_harness import DaemonProcess, start_daemon

SCHED_FIFO = getattr(os, "SCHED_FIFO", 1)


def test_every_thread_is_moved_and_one_that_ended_is_passed_over() -> None:
    calls: list[tuple[int, int, int]] = []

    def setter(tid: int, policy: int, param: os.sched_param) -> None:
        if tid == 12:
            raise ProcessLookupError(errno.ESRCH, "No such process")
        calls.append((tid, policy, param.sched_priority))

    enter_realtime(3, setter=setter, threads=lambda: [10, 11, 12, 13])
    assert calls == [(10, SCHED_FIFO, 3), (11, SCHED_FIFO, 3), (13, SCHED_FIFO, 3)]


def test_a_refusal_names_the_setting_and_what_would_allow_it() -> None:
    def setter(tid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    with pytest.raises(RealtimeUnavailable) as info:
        enter_realtime(2, setter=setter, threads=lambda: [7])
    assert str(info.value) == (
        "realtime_priority: cannot run at SCHED_FIFO priority 2: Operation not permitted; it "
        "needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least 2 (systemd: LimitRTPRIO=2 and "
        "RestrictRealtime=no)"
    )


def test_a_platform_without_sched_fifo_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "SCHED_FIFO", raising=False)
    with pytest.raises(RealtimeUnavailable, match="SCHED_FIFO is not available on this platform"):
        enter_realtime(1, setter=lambda *_: None, threads=lambda: [0])


def test_the_threads_of_this_process_include_the_calling_one() -> None:
    threads = threads_of_this_process()
    assert threads == [0] or threading.get_native_id() in threads


def test_a_daemon_that_may_not_run_realtime_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before anything is bound: the control endpoint never appears."""

    def refuse(priority: int) -> None:
        raise RealtimeUnavailable(f"realtime_priority: cannot run at priority {priority}")

    monkeypatch.setattr(daemon_module, "enter_realtime", refuse)
    control = tmp_path / "control"
    cfg = load_config(
        config_path=None,
        env={},
        flags={
            "control_endpoint": f"ipc://{control}",
            "kv_events_endpoint": f"ipc://{tmp_path}/kv",
            "fpm_endpoint": None,
            "realtime_priority": 1,
            "engine.speedup_ratio": 1,
            "api_port": None,
        },
    )
    code = asyncio.run(asyncio.wait_for(Daemon(cfg, rank_processes=0).serve(), 30))
    assert code == STARTUP_FAILURE
    assert not control.exists()


def may_run_realtime() -> bool:
    """Whether a process here may take SCHED_FIFO priority 1 (asked of a throwaway one)."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def policies(pid: int) -> set[tuple[int, int]]:
    """(policy, priority) of every thread of `pid`."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        found.add((os.sched_getscheduler(int(tid)), os.sched_getparam(int(tid)).sched_priority))
    return found


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


FLAGS = (
    "--realtime-priority",
    "1",
    "--speedup-ratio",
    "1",
    "--data-parallel-size",
    "2",
    "--rank-processes",
    "2",
    "--block-size",
    "16",
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_every_thread_of_the_daemon_and_its_workers_runs_sched_fifo(tmp_path: Path) -> None:
    """Where this machine allows it, the daemon and both workers are SCHED_FIFO 1 in every
    thread (ZeroMQ's included) and serve as usual; where it does not, the daemon refuses to
    start (exit 3) saying why."""
    if not may_run_realtime():
        daemon = DaemonProcess(tmp_path, list(FLAGS), None)
        code = daemon.proc.wait(30)
        assert code == STARTUP_FAILURE
        assert "realtime_priority: cannot run at SCHED_FIFO priority 1" in daemon.log()
        return

    async def generate(control: str) -> list[int]:
        async with await EngineClient.connect(control) as client:
            lengths = []
            for rank in (0, 1):
                gen = await client.generate(list(range(40)), 4, dp_rank=rank, timeout=20)
                lengths.append(len(gen.token_ids))
            return lengths

    with start_daemon(tmp_path, *FLAGS) as daemon:
        pid = daemon.proc.pid
        workers = children(pid)
        assert len(workers) == 2, workers
        for process in (pid, *workers):
            assert policies(process) == {(SCHED_FIFO, 1)}, process
        assert asyncio.run(asyncio.wait_for(generate(daemon.control), 60)) == [4, 4]
