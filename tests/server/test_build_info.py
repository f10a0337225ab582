"""Which core a daemon runs, where an operator reads it: `engined:build_info` on /metrics and
the "engined started" log line (tests/server/test_startup.py has the line's other fields).

The daemons are real processes, started with the environment of this one or with
`ENGINED_PURE=1`; they decide their core as this process did (engined/core/core_build.py), so
the expected labels are computed here, over the same install.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import engined
from engined.core import COMPILED_MODULES, core_build, running
from engined.core.core_build import CoreBuild
from tests.server.daemon_harness import start_daemon
from tests.server.test_metrics import http_get, parse
from tests.support import free_tcp_port

ROOT = Path(engined.__file__).resolve().parents[1]


def build_info(tmp_path: Path, env: dict[str, str]) -> list[tuple[dict[str, str], float]]:
    port = free_tcp_port()
    args = ["--http-port", str(port), "--model-name", "build-test"]

    async def scrape() -> list[tuple[dict[str, str], float]]:
        response = await http_get(port, "/metrics")
        assert response.status == 200
        return [(s.labels, s.value) for s in parse(response.body.decode())["engined:build_info"]]

    with start_daemon(tmp_path, *args, env=env):
        return asyncio.run(asyncio.wait_for(scrape(), 30))


def labels(build: CoreBuild) -> dict[str, str]:
    return {
        "model_name": "build-test",
        "version": engined.__version__,
        "core": build.core,
        "reason": build.reason,
    }


def test_metrics_name_the_core_the_daemon_runs(tmp_path: Path) -> None:
    assert build_info(tmp_path, {}) == [(labels(running()), 1.0)]


def test_metrics_name_the_pure_core_and_why(tmp_path: Path) -> None:
    pure = core_build.inspect(ROOT, COMPILED_MODULES, {"ENGINED_PURE": "1"})
    assert pure.core == "pure" and pure.reason.endswith("ENGINED_PURE=1")
    assert build_info(tmp_path, {"ENGINED_PURE": "1"}) == [(labels(pure), 1.0)]
