"""A daemon with `kv_events_endpoint = ""` (vLLM's `enable_kv_cache_events: false`).

Each test starts a real `engined serve` on ipc:// endpoints under tmp_path, its ranks in the
daemon's own loop and in worker processes: it serves requests as usual, binds no KV PUB and
no replay ROUTER (their ipc paths never appear, while the FPM PUB's does), lists none in
`welcome` or in its start-up line, and `engined events` says there is nothing to read.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engined.cli import app
from engined.client import EngineClient, Generation
from engined.wire.control import Welcome
from tests.server.daemon_harness import DaemonProcess, start_daemon

DP_SIZE = 2
EVENTS_OFF = ("--kv-events-endpoint", "", "--kv-replay-endpoint", "")


async def hello_and_generate(control: str) -> tuple[Welcome, list[Generation]]:
    async with await EngineClient.connect(control) as client:
        welcome = await client.hello()
        gens = [
            await client.generate([1000 * rank + i for i in range(40)], 6, dp_rank=rank, timeout=20)
            for rank in range(DP_SIZE)
        ]
        return welcome, gens


def started_line(daemon: DaemonProcess) -> dict[str, object]:
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == "engined started":
                return dict(record)
    raise AssertionError(f"no start-up line:\n{daemon.log()}")


@pytest.mark.parametrize("processes", [0, 2])
def test_a_daemon_without_kv_events_serves_and_binds_nothing_for_them(
    tmp_path: Path, processes: int
) -> None:
    with start_daemon(
        tmp_path,
        *EVENTS_OFF,
        "--data-parallel-size",
        str(DP_SIZE),
        "--rank-processes",
        str(processes),
    ) as daemon:
        welcome, gens = asyncio.run(hello_and_generate(daemon.control))
        assert welcome.kv_events_endpoints == []
        assert welcome.kv_replay_endpoints == []
        assert welcome.fpm_endpoints == [daemon.fpm_endpoint(r) for r in range(DP_SIZE)]
        assert [(g.dp_rank, len(g.token_ids), g.finish_reason) for g in gens] == [
            (0, 6, "length"),
            (1, 6, "length"),
        ]
        ipc_paths = sorted(path.name for path in tmp_path.glob("engined-*"))
        bound = ["engined-control", "engined-fpm", "engined-fpm-1"]
        assert ipc_paths == sorted([*bound, *(f"{name}.lock" for name in bound)])
        started = started_line(daemon)
        assert started["kv_events_endpoints"] == []
        assert started["kv_replay_endpoints"] == []
        limits = started["limits"]
        assert isinstance(limits, dict)
        assert (limits["kv_events_hwm"], limits["kv_replay_hwm"]) == (0, 0)
        pids = started["rank_processes"]
        assert isinstance(pids, list) and len(pids) == processes


def test_engined_events_says_there_is_nothing_to_subscribe_to(tmp_path: Path) -> None:
    with start_daemon(tmp_path, *EVENTS_OFF, "--rank-processes", "0") as daemon:
        result = CliRunner().invoke(app, ["events", "--control-endpoint", daemon.control])
    assert result.exit_code == 1, result.output
    assert result.output == (
        "error: the daemon publishes no KV events (its kv_events_endpoint is off); "
        "there is nothing to subscribe to\n"
    )
