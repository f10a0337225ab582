"""Endpoint grammar: `tcp://HOST:PORT` or `ipc://PATH`, and the per-rank derivation.

Parsed here rather than left to ZeroMQ so that a bad endpoint is refused with the key that
holds it, before any socket is bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from engined.config.schema import ConfigError

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]"})
_PORT_TEXT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: Literal["tcp", "ipc"]
    where: str  # tcp: host, IPv6 in brackets; ipc: path
    port: int  # 0 for ipc

    def for_rank(self, rank: int) -> Endpoint:
        if self.scheme == "ipc":
            return self if rank == 0 else Endpoint("ipc", f"{self.where}-{rank}", 0)
        return Endpoint("tcp", self.where, self.port + rank)

    def __str__(self) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.where}"
        return f"tcp://{self.where}:{self.port}"


def parse_endpoint(endpoint: str) -> Endpoint:
    """Split an endpoint; ValueError names what is wrong with it."""
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if not path:
            raise ValueError(f"{endpoint!r} has no path, expected ipc://PATH")
        return Endpoint("ipc", path, 0)
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r} must start with tcp:// or ipc://")
    host, colon, port_text = endpoint.removeprefix("tcp://").rpartition(":")
    if not colon or not host:
        raise ValueError(f"{endpoint!r} must be tcp://HOST:PORT")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{endpoint!r} has an unterminated IPv6 address")
    elif ":" in host:
        raise ValueError(f"{endpoint!r}: write IPv6 hosts in brackets, e.g. tcp://[::1]:5557")
    if _PORT_TEXT.fullmatch(port_text) is None or not 1 <= int(port_text) <= 65535:
        # NOTE: this also refuses `*` (ephemeral port): per-rank ports are offsets of a known one.
        raise ValueError(f"{endpoint!r} port must be a number in 1..65535, got {port_text!r}")
    return Endpoint("tcp", host, int(port_text))


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank `rank` uses for a per-rank socket (KV events, replay, FPM).

    `tcp://host:port` -> port + rank (IPv6 `tcp://[::1]:5557` too); `ipc://path` -> the path
    itself for rank 0 and `path-{rank}` otherwise, so a dp_size 1 daemon uses the endpoint as given.

    Raises:
        ConfigError: not a tcp:// or ipc:// endpoint, or the port of `rank` exceeds 65535.
        ValueError: `rank` is negative.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    try:
        base = parse_endpoint(endpoint)
    except ValueError as error:
        raise ConfigError(f"invalid endpoint {error}") from None
    ranked = base.for_rank(rank)
    if ranked.port > 65535:
        raise ConfigError(f"invalid endpoint {endpoint!r}: port of rank {rank} exceeds 65535")
    return str(ranked)
