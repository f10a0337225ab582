"""The worker's start-up checks that need no Dynamo: what it refuses before Dynamo's runtime
starts, how long it lets the runtime wait for etcd and NATS, and how the runtime's refusals
read (tests/interop/test_dynamo_startup.py runs them against the real runtime)."""

from __future__ import annotations

import pytest

from engined.dynamo.model import SetupError
from engined.dynamo.startup import (
    bound_connection_waits,
    check_system_port,
    dynamo_step,
    nats_users,
    runtime_failure,
)
from engined.dynamo.worker_args import parse_args

SYSTEM_PORT_HINT = (
    ": Dynamo 1.6.1 reads it as a 16-bit signed integer, so the system server's port must be "
    "a number up to 32767 (unset it for no system server)"
)


@pytest.mark.parametrize("value", ["32768", "40000", "-32769", "abc", "8081.0"])
def test_a_system_port_dynamo_cannot_parse_is_refused(value: str) -> None:
    with pytest.raises(SetupError) as info:
        check_system_port({"DYN_SYSTEM_PORT": value})
    assert str(info.value) == f"DYN_SYSTEM_PORT={value}{SYSTEM_PORT_HINT}"


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"DYN_SYSTEM_PORT": ""},
        {"DYN_SYSTEM_PORT": "32767"},
        {"DYN_SYSTEM_PORT": "-1"},
        {"DYN_SYSTEM_PORT": " 9090 "},
    ],
)
def test_a_system_port_dynamo_takes_passes(env: dict[str, str]) -> None:
    check_system_port(env)


def test_the_connect_timeout_bounds_dynamo_s_waits_unless_the_environment_says() -> None:
    env = {"NATS_STARTUP_CONNECT_TIMEOUT_SECONDS": "30"}
    bound_connection_waits(env, 2.5)
    assert env == {
        "ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS": "3",
        "NATS_STARTUP_CONNECT_TIMEOUT_SECONDS": "30",
    }
    short: dict[str, str] = {}
    bound_connection_waits(short, 0.2)
    assert short["ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS"] == "1"


def test_what_needs_nats() -> None:
    base = ["--model-path", "m"]
    assert nats_users(parse_args([*base, "--discovery-backend", "file"])) == []
    assert nats_users(
        parse_args([*base, "--discovery-backend", "etcd", "--event-plane", "nats"])
    ) == ["--discovery-backend etcd", "--event-plane nats"]


def test_runtime_refusals_read_as_one_line() -> None:
    args = parse_args(["--model-path", "m", "--discovery-backend", "etcd"])
    env = {"ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS": "5"}
    etcd = runtime_failure(
        Exception("etcd startup connection timed out after 5 seconds"), args, env
    )
    assert str(etcd) == (
        "no etcd answered at http://localhost:2379 (ETCD_ENDPOINTS) within 5 s "
        "(ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS, default --connect-timeout): start etcd there, "
        "point ETCD_ENDPOINTS at it, or run without etcd (--discovery-backend file)"
    )
    env = {"NATS_SERVER": "nats://n:4222", "NATS_STARTUP_CONNECT_TIMEOUT_SECONDS": "5"}
    nats = runtime_failure(
        Exception("NATS startup connection timed out after 5 seconds (3 attempts)"), args, env
    )
    assert str(nats) == (
        "no NATS server answered at nats://n:4222 (NATS_SERVER) within 5 s "
        "(NATS_STARTUP_CONNECT_TIMEOUT_SECONDS, default --connect-timeout), which "
        "--discovery-backend etcd needs: start nats-server there or point NATS_SERVER at it"
    )
    other = runtime_failure(Exception("bad\n  thing"), args, {})
    assert str(other) == "Dynamo's runtime did not start: bad thing"


def test_a_dynamo_step_names_itself_and_keeps_setup_errors() -> None:
    with pytest.raises(SetupError) as info, dynamo_step("Dynamo refused to register the model"):
        raise RuntimeError("no\nway")
    assert str(info.value) == "Dynamo refused to register the model: no way"
    with pytest.raises(SetupError) as kept, dynamo_step("step"):
        raise SetupError("as it was")
    assert str(kept.value) == "as it was"
