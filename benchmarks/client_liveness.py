"""How soon `engined.client` sees its daemon gone (issue 26: "noticed in <= 2 s").

Per run: one fresh `engined serve` (speedup 0, ipc endpoints in a temporary directory), one
client connected with `liveness_s` (default 2 s), a `hello`; then the daemon is SIGKILLed (its
connection drops at once) or SIGSTOPped (it stops answering ZMTP heartbeats, as a hung or
cut-off host does), and the time from the signal to the client's `ConnectionLost` is
printed. A stopped daemon is continued and must come back as the same start.

    .venv/bin/python benchmarks/client_liveness.py [--runs 5] [--liveness 2.0]

Name the machine and its load with the figures: the detection of a stopped daemon is the
heartbeat's timing (3/4 of the bound), that of a killed one the kernel's and the event loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import engined.core
from benchmarks.abuse_harness import Daemon, wait_ready
from engined.client import ConnectionBack, ConnectionLost, EngineClient


async def detect(daemon: Daemon, sig: signal.Signals, liveness: float) -> float:
    assert daemon.proc is not None
    async with await EngineClient.connect(daemon.control, liveness_s=liveness) as client:
        welcome = await client.hello()
        start = time.monotonic()
        daemon.proc.send_signal(sig)
        event = await client.next_connection_event(timeout=10 * liveness)
        elapsed = time.monotonic() - start
        assert isinstance(event, ConnectionLost), event
        if sig is signal.SIGSTOP:
            daemon.proc.send_signal(signal.SIGCONT)
            back = await client.next_connection_event(timeout=60)
            assert isinstance(back, ConnectionBack) and not back.restarted, back
            assert back.welcome.instance_id == welcome.instance_id
        return elapsed


def run(sig: signal.Signals, liveness: float) -> float:
    with tempfile.TemporaryDirectory(prefix="engined-liveness-") as root:
        daemon = Daemon(Path(root), ["--speedup-ratio", "0"], None)
        daemon.start()
        try:
            asyncio.run(wait_ready(daemon.control))
            return asyncio.run(detect(daemon, sig, liveness))
        finally:
            assert daemon.proc is not None
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGCONT)
            daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--liveness", type=float, default=2.0)
    args = parser.parse_args()
    print(f"liveness_s {args.liveness:g}, {args.runs} runs each, core: {engined.core.build()}")
    print(f"load average before: {os.getloadavg()}")
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        times = sorted(run(sig, args.liveness) for _ in range(args.runs))
        shown = ", ".join(f"{t * 1000:.0f}" for t in times)
        print(f"{sig.name}: loss seen after [{shown}] ms (max {times[-1]:.3f} s)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
