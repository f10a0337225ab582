"""`engined bench` when the run ends early: it stops and reports what it measured (issue 10, 11).

1. The daemon is killed mid-run: bench notices within its liveness probe (not after every
   request's --timeout), stops issuing requests, prints the report of the completed ones with
   `aborted: daemon_gone`, and fails (exit 1).
2. Ctrl-C (SIGINT to a real `engined bench`): the partial report is printed, exit 130.

Completion counts and the daemon's own pass counter decide when to kill or interrupt, never
a sleep.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engined.client import EngineClient
from engined.tools import bench as bench_tool
from engined.tools.bench_types import BenchOptions, RequestResult
from engined.tools.common import Mode, Output, ToolError
from engined.tools.distributions import parse_distribution
from tests.server.daemon_harness import PACED_FLAGS, DaemonProcess

PACED = (*PACED_FLAGS, "--block-size", "16")
CONCURRENCY = 4
KILL_AFTER = 8


def test_bench_stops_and_reports_when_the_daemon_goes_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = DaemonProcess(tmp_path, list(PACED), None)
    completed = 0
    real_run_request = bench_tool.run_request

    async def run_request(*args: Any, **kwargs: Any) -> RequestResult:
        nonlocal completed
        result = await real_run_request(*args, **kwargs)
        if result.error is None:
            completed += 1
            if completed == KILL_AFTER:
                daemon.proc.kill()
        return result

    monkeypatch.setattr(bench_tool, "run_request", run_request)
    options = BenchOptions(
        control_endpoint=daemon.control,
        concurrency=CONCURRENCY,
        requests=100_000,
        prompt_len=parse_distribution("fixed:16"),
        output_len=parse_distribution("fixed:3"),
        timeout=2.0,
    )
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        daemon.wait_ready()
        with pytest.raises(ToolError, match="stopped answering") as info:
            asyncio.run(
                asyncio.wait_for(
                    bench_tool.bench(options, Output(Mode.JSON, stdout=stdout, stderr=stderr)), 60
                )
            )
    finally:
        daemon.stop(signal.SIGKILL)
    assert info.value.exit_code == 1
    (report,) = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert report["aborted"] == "daemon_gone"
    assert report["requests"] >= KILL_AFTER
    assert report["ttft_ms"]["p50"] is not None
    # It stopped: what it started after the kill is what was in flight plus, at most, one more
    # per worker before the probe failed (each takes its --timeout to fail, the probe less).
    started = report["requests"] + report["failed"] + report["abandoned"]
    assert started <= completed + 3 * CONCURRENCY, report


def test_ctrl_c_prints_the_partial_report(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, list(PACED), None)
    try:
        daemon.wait_ready()
        runner = subprocess.Popen(
            [
                *(sys.executable, "-m", "engined.cli", "bench", "--json"),
                *("--control-endpoint", daemon.control, "--concurrency", "2"),
                *("--requests", "100000", "--prompt-len", "16", "--output-len", "3"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ},
        )

        async def wait_for_passes(passes: int) -> None:
            async with await EngineClient.connect(daemon.control) as client:
                while (await client.stats(timeout=10)).ranks[0].passes_total < passes:
                    assert runner.poll() is None, runner.communicate()
                    await client.ping(timeout=10)  # one round trip between polls

        # Each request takes 4 passes (prefill + 3 decodes of 10 ms): 40 passes is ~20 done.
        asyncio.run(asyncio.wait_for(wait_for_passes(40), 60))
        runner.send_signal(signal.SIGINT)
        out, err = runner.communicate(timeout=30)
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert runner.returncode == 130, err
    (report,) = [json.loads(line) for line in out.decode().splitlines()]
    assert report["aborted"] == "interrupted"
    assert report["requests"] >= 1
    assert report["preemptions"] is None
