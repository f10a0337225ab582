"""`engined dynamo-worker` start-up failures against Dynamo 1.6.1's real runtime: each is
one line naming the cause on stderr and exit status 1, never a traceback, and the wait for
etcd or NATS is the worker's `--connect-timeout`, not Dynamo's 120 s.

Every worker here has a real daemon to attach to, so what fails is Dynamo's part. etcd and
NATS are "unreachable" at a loopback port nothing listens on. Dynamo logs its own retries
on stderr as well (JSON lines); the worker's line is the last one, and the only one it
writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import pytest

from tests.interop.dynamo_cluster import DynamoCluster, EnginedDaemon, dynamo_cluster
from tests.interop.dynamo_worker_support import FAST_ARGS, WorkerExit, run_failing_worker
from tests.interop.peers import require_peers
from tests.support import free_tcp_port

CONNECT_TIMEOUT_S: Final = 2
# A cold import of Dynamo on a busy 2-core machine, on top of the connect timeout.
EXIT_MARGIN_S: Final = 45.0
PREFIX: Final = "engined dynamo-worker: "


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[DynamoCluster, EnginedDaemon]]:
    with dynamo_cluster(require_peers(), tmp_path_factory.mktemp("dynamo-startup")) as cluster:
        daemon = cluster.engined_daemon(*FAST_ARGS, name="startup-engined")
        yield cluster, daemon


def _run(
    setup: tuple[DynamoCluster, EnginedDaemon],
    name: str,
    env: dict[str, str],
    *args: str,
) -> WorkerExit:
    cluster, daemon = setup
    return run_failing_worker(
        cluster,
        daemon.control,
        name=name,
        namespace=name,
        timeout=CONNECT_TIMEOUT_S + EXIT_MARGIN_S,
        extra_args=["--connect-timeout", str(CONNECT_TIMEOUT_S), *args],
        env=env,
    )


def assert_one_line(result: WorkerExit, expected: str) -> None:
    assert result.returncode == 1, result
    assert result.last_stderr_line == PREFIX + expected, result
    ours = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    assert ours == [PREFIX + expected], result
    assert "Traceback" not in result.stdout + result.stderr, result


def closed_port_url(scheme: str) -> str:
    return f"{scheme}://127.0.0.1:{free_tcp_port()}"


def test_unreachable_etcd_is_one_line_after_the_connect_timeout(
    setup: tuple[DynamoCluster, EnginedDaemon],
) -> None:
    etcd = closed_port_url("http")
    result = _run(setup, "no-etcd", {"ETCD_ENDPOINTS": etcd}, "--discovery-backend", "etcd")
    assert_one_line(
        result,
        f"no etcd answered at {etcd} (ETCD_ENDPOINTS) within 2 s "
        "(ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS, default --connect-timeout): start etcd there, "
        "point ETCD_ENDPOINTS at it, or run without etcd (--discovery-backend file)",
    )


@pytest.mark.parametrize("plane", ["--request-plane", "--event-plane"])
def test_unreachable_nats_of_a_nats_plane_is_one_line(
    setup: tuple[DynamoCluster, EnginedDaemon], plane: str
) -> None:
    nats = closed_port_url("nats")
    name = f"no-nats-{plane.removeprefix('--')}"
    result = _run(setup, name, {"NATS_SERVER": nats}, plane, "nats")
    assert_one_line(
        result,
        f"no NATS server answered at {nats} (NATS_SERVER) within 2 s "
        "(NATS_STARTUP_CONNECT_TIMEOUT_SECONDS, default --connect-timeout), which "
        f"{plane} nats needs: start nats-server there or point NATS_SERVER at it",
    )


@pytest.mark.parametrize("value", ["40000", "abc"])
def test_a_system_port_dynamo_cannot_parse_is_one_line(
    setup: tuple[DynamoCluster, EnginedDaemon], value: str
) -> None:
    result = _run(setup, f"bad-system-port-{value}", {"DYN_SYSTEM_PORT": value})
    assert_one_line(
        result,
        f"DYN_SYSTEM_PORT={value}: Dynamo 1.6.1 reads it as a 16-bit signed integer, so the "
        "system server's port must be a number up to 32767 (unset it for no system server)",
    )
