"""Why the worker could not join Dynamo, in one line.

Dynamo 1.6.1's runtime retries an unreachable etcd or NATS for 120 s and then raises a bare
`Exception`; a `DYN_SYSTEM_PORT` it cannot parse fails the same way. Users of a worker want
the cause and the fix at once, so the worker checks what it can before the runtime starts,
gives the runtime's connection retries its own `--connect-timeout`, and turns whatever Dynamo
still raises while the worker starts into a `SetupError` (one line, exit 1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Final

from engined.dynamo.model import SetupError
from engined.dynamo.worker_args import WorkerArgs

# Dynamo's own defaults when the variables are unset.
ETCD_DEFAULT: Final = "http://localhost:2379"
NATS_DEFAULT: Final = "nats://localhost:4222"
ETCD_TIMEOUT_VAR: Final = "ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS"
NATS_TIMEOUT_VAR: Final = "NATS_STARTUP_CONNECT_TIMEOUT_SECONDS"
# Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16.
SYSTEM_PORT_RANGE: Final = range(-(2**15), 2**15)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def check_system_port(env: Mapping[str, str]) -> None:
    """Refuse a `DYN_SYSTEM_PORT` Dynamo's runtime would refuse with a traceback."""
    text = env.get("DYN_SYSTEM_PORT", "").strip()
    if not text:
        return
    try:
        port: int | None = int(text)
    except ValueError:
        port = None
    if port is None or port not in SYSTEM_PORT_RANGE:
        raise SetupError(
            f"DYN_SYSTEM_PORT={text}: Dynamo 1.6.1 reads it as a 16-bit signed integer, so the "
            "system server's port must be a number up to 32767 (unset it for no system server)"
        )


def bound_connection_waits(env: MutableMapping[str, str], timeout: float) -> None:
    """Let Dynamo retry etcd and NATS for `timeout` s (whole, at least 1) instead of 120 s,
    unless the environment already says how long."""
    seconds = str(max(1, math.ceil(timeout)))
    env.setdefault(ETCD_TIMEOUT_VAR, seconds)
    env.setdefault(NATS_TIMEOUT_VAR, seconds)


def nats_users(args: WorkerArgs) -> list[str]:
    """The worker's flags that make Dynamo's runtime connect to NATS (etcd discovery does
    even with the TCP request plane and the ZMQ event plane)."""
    users = []
    if args.discovery_backend == "etcd":
        users.append("--discovery-backend etcd")
    if args.request_plane == "nats":
        users.append("--request-plane nats")
    if args.event_plane == "nats":
        users.append("--event-plane nats")
    return users


def runtime_failure(error: Exception, args: WorkerArgs, env: Mapping[str, str]) -> SetupError:
    """What `DistributedRuntime(...)` raised, as the line a user acts on."""
    text = one_line(error)
    if text.startswith("etcd startup connection timed out"):
        where = env.get("ETCD_ENDPOINTS") or ETCD_DEFAULT
        return SetupError(
            f"no etcd answered at {where} (ETCD_ENDPOINTS) within {env.get(ETCD_TIMEOUT_VAR)} s "
            f"({ETCD_TIMEOUT_VAR}, default --connect-timeout): start etcd there, point "
            "ETCD_ENDPOINTS at it, or run without etcd (--discovery-backend file)"
        )
    if text.startswith("NATS startup connection timed out"):
        where = env.get("NATS_SERVER") or NATS_DEFAULT
        needs = " and ".join(nats_users(args)) or "this configuration"
        return SetupError(
            f"no NATS server answered at {where} (NATS_SERVER) within "
            f"{env.get(NATS_TIMEOUT_VAR)} s ({NATS_TIMEOUT_VAR}, default --connect-timeout), "
            f"which {needs} needs: start nats-server there or point NATS_SERVER at it"
        )
    return SetupError(f"Dynamo's runtime did not start: {text}")


@contextlib.contextmanager
def dynamo_step(what: str) -> Iterator[None]:
    """Any exception a Dynamo call raises inside as a SetupError naming the step."""
    try:
        yield
    except SetupError:
        raise
    except Exception as error:
        raise SetupError(f"{what}: {one_line(error)}") from None
