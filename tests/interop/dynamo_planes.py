"""What every Dynamo process of a test cluster must agree on: its planes.

Dynamo 1.6.1 names three: discovery (where instances and model cards are registered: a
file store or etcd), requests (router to worker: tcp or nats) and events (KV events,
metrics: zmq or nats). A frontend and a worker that disagree break quietly (a worker on
nats/nats behind a tcp/zmq frontend gets HTTP 500 on every request, one on the nats event
plane behind a zmq frontend is routed blind: docs/upstream/dynamo-1.6.1.md), so `Planes` is one
value handed to every process of a cluster, which turns it into both its flags and its
environment.

`FileDiscovery` needs no server (the default of `DynamoCluster`); `EtcdDiscovery` lives in
`tests.interop.etcd_nats` with the servers it needs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

RequestPlane = Literal["tcp", "nats"]
EventPlane = Literal["zmq", "nats"]


class Discovery(Protocol):
    """A discovery backend the test can read as the frontend does."""

    @property
    def backend(self) -> str:
        """`--discovery-backend`'s value."""
        ...

    def env(self) -> dict[str, str]:
        """The variables a process needs to reach the backend."""
        ...

    def instances(self) -> list[dict[str, Any]]:
        """Every registered endpoint instance: records with `namespace`, `component`,
        `endpoint`, `instance_id` and `transport`."""
        ...


@dataclass(frozen=True, slots=True)
class FileDiscovery:
    """Dynamo's file store: one JSON file per instance under `store/v1/instances`."""

    store: Path

    @property
    def backend(self) -> str:
        return "file"

    def env(self) -> dict[str, str]:
        return {"DYN_FILE_KV": str(self.store)}

    def instances(self) -> list[dict[str, Any]]:
        directory = self.store / "v1" / "instances"
        if not directory.is_dir():
            return []
        found = []
        for path in directory.iterdir():
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # being written or removed
            if isinstance(record, dict):
                found.append(record)
        return found


@dataclass(frozen=True, slots=True)
class Planes:
    """Discovery, request and event planes of every process of one cluster."""

    discovery: Discovery
    request: RequestPlane = "tcp"
    event: EventPlane = "zmq"

    @classmethod
    def of(cls, planes: Planes | Path) -> Planes:
        """`planes`, or the default planes over a file store at that path (the harness's
        historical argument)."""
        return planes if isinstance(planes, Planes) else cls(FileDiscovery(planes))

    @property
    def label(self) -> str:
        """E.g. `etcd-tcp-zmq`, for names and test ids."""
        return f"{self.discovery.backend}-{self.request}-{self.event}"

    def args(self) -> list[str]:
        """The flags Dynamo's frontend, its mocker and `engined dynamo-worker` all take."""
        return [
            "--discovery-backend",
            self.discovery.backend,
            "--request-plane",
            self.request,
            "--event-plane",
            self.event,
        ]

    def env(self) -> dict[str, str]:
        """The same as variables (for anything a process starts in turn)."""
        return {
            **self.discovery.env(),
            "DYN_DISCOVERY_BACKEND": self.discovery.backend,
            "DYN_REQUEST_PLANE": self.request,
            "DYN_EVENT_PLANE": self.event,
        }

    def instances_of(self, namespace: str, component: str, endpoint: str) -> set[int]:
        """Ids of the registered instances of one endpoint."""
        return {
            int(record["instance_id"])
            for record in self.discovery.instances()
            if _is_endpoint(record, namespace, component, endpoint)
        }


def _is_endpoint(record: Mapping[str, Any], namespace: str, component: str, endpoint: str) -> bool:
    return (
        record.get("namespace") == namespace
        and record.get("component") == component
        and record.get("endpoint") == endpoint
    )
