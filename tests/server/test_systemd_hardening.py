"""The units' hardening (issue 21, 2): what each sets, and what systemd-analyze makes of it.

1. Every daemon unit runs as its own transient user (engined@NAME as engined-NAME, shared
   with engined-dynamo-worker@NAME so the worker may connect to the daemon's ipc sockets),
   bounds its memory (MemoryHigh, MemoryMax, no swap), keeps its files to itself
   (UMask=0077), talks IP with loopback only, and keeps the sandbox: exact values.
2. `systemd-analyze security --offline=true` rates the daemon units 1.1 at most (1.2 before
   this issue) and the worker 1.2 at most; the same check fails a unit that drops the IP
   filter, so the threshold is not vacuous.
3. The heap trim (engined/server/ops/heap.py) runs under the units' system call filter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.test_systemd import SANDBOX, UNITS, mdwe_supported, systemd_analyze
from tests.server.unit_sandbox import unit_settings

DAEMON_UNITS = ("engined.service", "engined@.service")
# `systemd-analyze security --threshold` takes the exposure in tenths: 11 is "1.1".
DAEMON_EXPOSURE_MAX = 11
WORKER_EXPOSURE_MAX = 12

SANDBOX_SETTINGS = {
    "DynamicUser": ["yes"],
    "NoNewPrivileges": ["yes"],
    "CapabilityBoundingSet": [""],
    "AmbientCapabilities": [""],
    "ProtectSystem": ["strict"],
    "ProtectHome": ["yes"],
    "PrivateTmp": ["yes"],
    "PrivateDevices": ["yes"],
    "PrivateIPC": ["yes"],
    "PrivateUsers": ["yes"],
    "RestrictAddressFamilies": ["AF_UNIX AF_INET AF_INET6 AF_NETLINK"],
    "RestrictRealtime": ["yes"],
    "SystemCallFilter": ["@system-service", "~@privileged"],
    "MemoryDenyWriteExecute": ["yes"],
    "RemoveIPC": ["yes"],
}
DAEMON_SETTINGS = {
    **SANDBOX_SETTINGS,
    "UMask": ["0077"],
    "MemoryHigh": ["1536M"],
    "MemoryMax": ["2G"],
    "MemorySwapMax": ["0"],
    "IPAddressAllow": ["localhost"],
    "IPAddressDeny": ["any"],
}


@pytest.mark.parametrize(
    ("unit", "user"), [("engined.service", "engined"), ("engined@.service", "engined-%i")]
)
def test_the_daemon_units_run_as_their_own_user_with_bounded_memory(unit: str, user: str) -> None:
    settings = unit_settings(UNITS / unit)
    assert settings["User"] == [user]
    for key, value in DAEMON_SETTINGS.items():
        assert settings.get(key) == value, key


def test_the_worker_runs_as_its_daemons_user() -> None:
    """Same uid, so its connect to the daemon's 0700 ipc sockets is allowed; its own files
    stay readable by a frontend running as another user."""
    worker = unit_settings(UNITS / "engined-dynamo-worker@.service")
    template = unit_settings(UNITS / "engined@.service")
    assert worker["User"] == template["User"] == ["engined-%i"]
    for key, value in SANDBOX_SETTINGS.items():
        assert worker.get(key) == value, key
    assert worker["UMask"] == ["0022"]


def exposure_within(analyze: str, unit: Path, threshold: int) -> tuple[bool, str]:
    result = subprocess.run(
        [analyze, "security", "--offline=true", f"--threshold={threshold}", "--no-pager", unit],
        capture_output=True,
        text=True,
        timeout=60,
    )
    overall = [line for line in result.stdout.splitlines() if "Overall exposure level" in line]
    assert len(overall) == 1, result.stdout + result.stderr
    return result.returncode == 0, overall[0]


@pytest.mark.parametrize(
    ("unit", "threshold", "rated"),
    [
        ("engined.service", DAEMON_EXPOSURE_MAX, "1.1 OK"),
        ("engined@.service", DAEMON_EXPOSURE_MAX, "1.1 OK"),
        ("engined-dynamo-worker@.service", WORKER_EXPOSURE_MAX, "1.2 OK"),
    ],
)
def test_exposure_stays_below_the_threshold(unit: str, threshold: int, rated: str) -> None:
    within, overall = exposure_within(systemd_analyze(), UNITS / unit, threshold)
    assert within, overall
    assert rated in overall


def test_the_threshold_catches_a_weaker_unit(tmp_path: Path) -> None:
    text = (UNITS / "engined@.service").read_text()
    weaker = tmp_path / "engined@.service"
    weaker.write_text(text.replace("IPAddressDeny=any\n", ""))
    within, overall = exposure_within(systemd_analyze(), weaker, DAEMON_EXPOSURE_MAX)
    assert not within, overall
    assert "1.2 OK" in overall


def test_the_heap_trim_passes_the_units_system_call_filter() -> None:
    systemd_analyze()  # expands the syscall groups
    if not mdwe_supported():
        pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3): cannot apply MemoryDenyWriteExecute")
    trim = "from engined.server.ops.heap import trim; trim(); print('trimmed')"
    result = subprocess.run(
        [sys.executable, SANDBOX, UNITS / "engined.service", "--", sys.executable, "-c", trim],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "trimmed\n"
