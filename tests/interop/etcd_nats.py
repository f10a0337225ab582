"""A real etcd and a real NATS server (JetStream on) on free loopback ports, for Dynamo's
production configuration (`--discovery-backend etcd`, the nats request and event planes).

Debian's `etcd-server` (etcd 3.4) and `nats-server` (2.9) packages; a missing binary fails
with the `apt-get install` line, never skips. Both keep their data and logs in the work dir
(`etcd.log`, `nats.log`). Ready means answering: etcd's `/health` says `"health":"true"` and
NATS's monitoring `/healthz` (which includes JetStream) says `"status":"ok"`.

    with EtcdNats(tmp_path) as servers:
        planes = Planes(servers.discovery(), request="nats", event="nats")
        cluster = DynamoCluster(peers_python, tmp_path, planes=planes)

The discovery side (`EtcdDiscovery`) reads etcd's JSON gateway (`/v3/kv/range`) the way
the frontend reads it: endpoint instances under `v1/instances/`, each held by its worker's
lease, so a key outlives a killed worker by the lease's TTL (`ETCD_LEASE_TTL`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tests.interop.dynamo_cluster import DynamoProcess
from tests.support import free_tcp_port

INSTALL_LINE: Final = "apt-get install etcd-server nats-server"
# nats-server installs to /usr/sbin, off an ordinary user's PATH.
_SEARCH_PATH: Final = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"]
)
READY_TIMEOUT_S: Final = 30.0
HTTP_TIMEOUT_S: Final = 5.0
POLL_S: Final = 0.05
# etcd 3.4 re-raises the signal it shut down on; nats-server exits 0.
CLEAN_EXIT: Final = {"nats": 0, "etcd": -signal.SIGTERM}
_OPENER: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MissingServer(AssertionError):
    """etcd or nats-server is not installed."""


def find_binary(name: str) -> str:
    """The path of `name` (PATH, then the sbin directories); fails naming the install."""
    found = shutil.which(name, path=_SEARCH_PATH)
    if found is None:
        raise MissingServer(f"{name} is not installed (looked in {_SEARCH_PATH}): {INSTALL_LINE}")
    return found


def _get_json(url: str, body: object | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    with _OPENER.open(request, timeout=HTTP_TIMEOUT_S) as reply:
        return json.loads(reply.read().decode())


class Server(DynamoProcess):
    """A server process of the cluster's infrastructure; ready once `answers()`."""

    def __init__(self, name: str, workdir: Path) -> None:
        super().__init__(name, workdir, os.environ)

    def answers(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start on fresh ports until one run answers; fails with the log's tail."""
        for _attempt in range(5):
            self._spawn()
            assert self.proc is not None
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    if self.answers():
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(
                        f"{self.name}: no answer within {timeout:g} s\n{self.describe()}"
                    )
                time.sleep(POLL_S)
            if "address already in use" not in self.log_text().lower():
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}\n{self.describe()}"
                )
        raise AssertionError(f"{self.name}: no free ports after 5 attempts\n{self.describe()}")


class Etcd(Server):
    """`etcd` with one member, its client URL on 127.0.0.1."""

    def __init__(self, workdir: Path) -> None:
        super().__init__("etcd", workdir)
        self.binary = find_binary("etcd")
        self.client_port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def command_line(self) -> list[str]:
        self.client_port = free_tcp_port()
        client = self.url
        return [
            self.binary,
            "--name",
            "engined-test",
            "--data-dir",
            str(self.workdir / "etcd-data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            f"http://127.0.0.1:{free_tcp_port()}",
            "--log-outputs",
            "stderr",
        ]

    def answers(self) -> bool:
        return bool(_get_json(f"{self.url}/health").get("health") == "true")

    def range(self, prefix: str) -> dict[str, bytes]:
        """Every key starting with `prefix`, with its value."""
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        reply = _get_json(
            f"{self.url}/v3/kv/range",
            {"key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()},
        )
        return {
            base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
            for kv in reply.get("kvs") or ()
        }


class Nats(Server):
    """`nats-server -js` on 127.0.0.1, its monitoring HTTP port beside it."""

    stop_signal = signal.SIGINT  # nats-server 2.9 exits 1 after SIGTERM, 0 after SIGINT

    def __init__(self, workdir: Path) -> None:
        super().__init__("nats", workdir)
        self.binary = find_binary("nats-server")
        self.port = 0
        self.monitor_port = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command_line(self) -> list[str]:
        self.port, self.monitor_port = free_tcp_port(), free_tcp_port()
        return [
            self.binary,
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
            "-sd",
            str(self.workdir / "nats-data"),
        ]

    def monitor(self, path: str) -> Any:
        """A monitoring endpoint's JSON (`/varz`, `/connz`, `/subsz`, `/jsz`...)."""
        return _get_json(f"http://127.0.0.1:{self.monitor_port}{path}")

    def answers(self) -> bool:
        return bool(self.monitor("/healthz").get("status") == "ok")


@dataclass(frozen=True, slots=True)
class EtcdDiscovery:
    """Dynamo's etcd discovery over `etcd`, with `nats` for the planes that use it (every
    Dynamo process connects to NATS when it is named, whatever its planes)."""

    etcd: Etcd
    nats: Nats

    @property
    def backend(self) -> str:
        return "etcd"

    def env(self) -> dict[str, str]:
        return {"ETCD_ENDPOINTS": self.etcd.url, "NATS_SERVER": self.nats.url}

    def instances(self) -> list[dict[str, Any]]:
        found = []
        for value in self.etcd.range("v1/instances/").values():
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                record = json.loads(value)
                if isinstance(record, dict):
                    found.append(record)
        return found


class EtcdNats:
    """etcd and NATS for one test module; a context manager that stops both."""

    def __init__(self, workdir: Path) -> None:
        self.etcd = Etcd(workdir)
        self.nats = Nats(workdir)

    def __enter__(self) -> EtcdNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self.etcd.start()
            self.nats.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> dict[str, int | None]:
        """Stop both; their exit statuses (`CLEAN_EXIT` after an orderly shutdown)."""
        return {"nats": self.nats.stop(), "etcd": self.etcd.stop()}

    def discovery(self) -> EtcdDiscovery:
        return EtcdDiscovery(self.etcd, self.nats)
