"""The engine-wide operator commands (`engined pause|resume|sleep|wake-up|release-kv-cache|
reset-prefix-cache|set-weight-version`) and `engined cancel` against a live daemon, through
typer's CliRunner.

The test runs as the daemon's user on its ipc endpoint, so it is an operator; a tcp client is
not, and is refused with the protocol's `forbidden`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from engined.client import EngineClient
from engined.core.pausing import RELEASE_BEFORE_PAUSE
from tests.server.daemon_harness import DaemonProcess, start_daemon, start_tcp_daemon
from tests.support import run
from tests.test_cli_tools import clean_environment, invoke, records

__all__ = ["clean_environment"]

FLAGS = ("--speedup-ratio", "0", "--data-parallel-size", "2")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with start_daemon(tmp_path_factory.mktemp("cli-engine"), *FLAGS) as running:
        yield running


def states(daemon: DaemonProcess, *args: str) -> list[dict[str, object]]:
    result = invoke(*args, "--json", "--control-endpoint", daemon.control)
    assert result.exit_code == 0, result.output
    rows = records(result.stdout)
    assert [row["dp_rank"] for row in rows] == [0, 1]
    return rows


def one_state(daemon: DaemonProcess, *args: str) -> dict[str, object]:
    first, *rest = states(daemon, *args)
    assert all(row == {**first, "dp_rank": row["dp_rank"]} for row in rest), rest
    return {key: value for key, value in first.items() if key != "dp_rank"}


AWAKE = {
    "pause_state": 0,
    "pause_pending": False,
    "rejecting": False,
    "sleeping_tags": [],
    "asleep": False,
    "sleep_level": 0,
    "weight_version": "default",
}


def test_an_rl_loop_from_the_shell(daemon: DaemonProcess) -> None:
    assert one_state(daemon, "pause", "--mode", "keep", "--keep-cache") == {
        **AWAKE,
        "pause_state": 2,
    }
    assert one_state(daemon, "set-weight-version", "step-9")["weight_version"] == "step-9"
    released = invoke("release-kv-cache", "--control-endpoint", daemon.control)
    assert released.exit_code == 0, released.output
    assert released.stdout.splitlines() == [
        f"rank {r}: paused (all held); asleep at level 0 (kv_cache); weights 'step-9'"
        for r in (0, 1)
    ]
    assert one_state(daemon, "wake-up", "--tag", "kv_cache") == {
        **AWAKE,
        "weight_version": "step-9",
    }
    assert one_state(daemon, "sleep", "--level", "2") == {
        **AWAKE,
        "pause_state": 1,
        "sleeping_tags": ["kv_cache", "weights"],
        "asleep": True,
        "sleep_level": 2,
        "weight_version": "step-9",
    }
    assert one_state(daemon, "wake-up")["asleep"] is False
    assert one_state(daemon, "pause", "--mode", "wait")["rejecting"] is True
    assert one_state(daemon, "resume")["rejecting"] is False
    assert one_state(daemon, "reset-prefix-cache", "--reset-running-requests")["pause_state"] == 0
    assert one_state(daemon, "set-weight-version", "default") == AWAKE


def test_refusals_are_the_daemons(daemon: DaemonProcess, tmp_path: Path) -> None:
    early = invoke("release-kv-cache", "--json", "--control-endpoint", daemon.control)
    assert early.exit_code == 1
    (error,) = records(early.stdout)
    assert error["error"]["code"] == "invalid_request"
    assert error["error"]["message"] == RELEASE_BEFORE_PAUSE
    bad = invoke("sleep", "--level", "3", "--control-endpoint", daemon.control)
    assert bad.exit_code == 2
    with start_tcp_daemon(tmp_path, *FLAGS) as tcp:
        refused = invoke("pause", "--json", "--control-endpoint", tcp.control)
        assert refused.exit_code == 1
        (error,) = records(refused.stdout)
        assert error["error"]["code"] == "forbidden"


def test_cancel_ends_another_clients_request(daemon: DaemonProcess) -> None:
    """Held by a `keep` pause, the owner's request is still running when the command, on a
    connection of its own, cancels it: the owner's stream ends `cancelled`; an id nobody runs
    is `not running`, and exits 1."""

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as owner:
            await owner.submit([5] * 32, 8, request_id="victim", timeout=10)
            result = await asyncio.to_thread(
                invoke, "cancel", "victim", "ghost", "--control-endpoint", daemon.control
            )
            assert (result.exit_code, result.stdout.splitlines()) == (
                1,
                ["victim: cancelled", "ghost: not running"],
            ), result.output
            entries = [entry async for entry in owner.outputs("victim", timeout=10)]
            assert [(e.finished, e.finish_reason) for e in entries] == [(True, "cancelled")]

    assert one_state(daemon, "pause", "--mode", "keep")["pause_state"] == 2
    try:
        run(scenario())
    finally:
        assert one_state(daemon, "resume")["pause_state"] == 0
    again = invoke("cancel", "victim", "--json", "--control-endpoint", daemon.control)
    assert (again.exit_code, records(again.stdout)) == (
        1,
        [{"request_id": "victim", "cancelled": False}],
    )
