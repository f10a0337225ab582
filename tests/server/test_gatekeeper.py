"""The gate's rules (pure), its key files, and both at work in real daemons: the connection
cap, CURVE with roles by key, refusals a client can tell apart."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from engined.client import ConnectionRefused, EngineClient, EngineError
from engined.client.liveness import Liveness
from engined.server.security.access import AccessError, read_authorized_keys, read_secret_key
from engined.server.security.gatekeeper import (
    DENIED,
    REFUSED,
    Domain,
    GatePolicy,
    Role,
    Verdict,
    decide,
)
from engined.wire.control import Applied
from engined.zmq_sockets import CurveClientKeys
from tests.server.daemon_harness import ENGINED, DaemonProcess, free_tcp_port, start_daemon

OWN = os.getuid()
KEY_A = b"a" * 32
KEY_B = b"b" * 32
OPEN = GatePolicy(max_connections=10, operator_uids=frozenset({OWN}))
CURVE = GatePolicy(
    max_connections=10,
    operator_uids=frozenset({OWN}),
    curve_secret_key=b"x" * 40,
    authorized_keys={KEY_A: Role.OPERATOR, KEY_B: Role.CLIENT},
    curve_publishers=False,
)
OK_CLIENT = Verdict(b"200", "OK", Role.CLIENT)
OK_OPERATOR = Verdict(b"200", "OK", Role.OPERATOR)
LIMIT = Verdict(REFUSED, "connection limit (10) reached")
UNKNOWN = Verdict(DENIED, "unknown client key")
PLAIN = Verdict(DENIED, "mechanism PLAIN is not accepted")


@pytest.mark.parametrize(
    ("policy", "connections", "domain", "address", "mechanism", "credentials", "verdict"),
    [
        (OPEN, 1, Domain.CONTROL, f"localhost:{OWN}:0:42", "NULL", [], OK_OPERATOR),
        (OPEN, 1, Domain.CONTROL, f"localhost:{OWN + 1}:0:42", "NULL", [], OK_CLIENT),
        (OPEN, 1, Domain.CONTROL, "127.0.0.1", "NULL", [], OK_CLIENT),
        (OPEN, 1, Domain.CONTROL, f"localhost:x{OWN}:0:42", "NULL", [], OK_CLIENT),
        (OPEN, 1, Domain.REPLAY, f"localhost:{OWN}:0:42", "NULL", [], OK_CLIENT),
        (OPEN, 10, Domain.CONTROL, "127.0.0.1", "NULL", [], OK_CLIENT),
        (OPEN, 11, Domain.CONTROL, "127.0.0.1", "NULL", [], LIMIT),
        (OPEN, 1, Domain.CONTROL, "::1", "PLAIN", [], PLAIN),
        (CURVE, 1, Domain.CONTROL, "127.0.0.1", "CURVE", [KEY_A], OK_OPERATOR),
        (CURVE, 1, Domain.CONTROL, "127.0.0.1", "CURVE", [KEY_B], OK_CLIENT),
        (CURVE, 1, Domain.CONTROL, f"localhost:{OWN}:0:42", "CURVE", [KEY_B], OK_CLIENT),
        (CURVE, 1, Domain.CONTROL, "127.0.0.1", "CURVE", [b"c" * 32], UNKNOWN),
        (CURVE, 1, Domain.CONTROL, "127.0.0.1", "CURVE", [], UNKNOWN),
        (CURVE, 1, Domain.CONTROL, "127.0.0.1", "NULL", [], Verdict(DENIED, "CURVE required")),
        (CURVE, 1, Domain.PUBLISH, "127.0.0.1", "NULL", [], OK_CLIENT),
        (CURVE, 11, Domain.CONTROL, "127.0.0.1", "CURVE", [KEY_A], LIMIT),
    ],
)  # fmt: skip
def test_the_gate_decides(
    policy: GatePolicy,
    connections: int,
    domain: Domain,
    address: str,
    mechanism: str,
    credentials: list[bytes],
    verdict: Verdict,
) -> None:
    assert decide(policy, connections, domain, address, mechanism, credentials) == verdict


def test_authorized_keys_are_read_with_their_roles(tmp_path: Path) -> None:
    operator_public, _ = zmq.curve_keypair()
    client_public, _ = zmq.curve_keypair()
    keys = tmp_path / "keys"
    keys.write_text(
        f"# engined's clients\n  {operator_public.decode()} operator  # ops\n\n"
        f"{client_public.decode()} client\n"
    )
    assert read_authorized_keys(keys) == {
        zmq.utils.z85.decode(operator_public): Role.OPERATOR,
        zmq.utils.z85.decode(client_public): Role.CLIENT,
    }


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("abc operator", "'abc' is not a 40-character Z85 key"),
        ("x" * 40, "expected '<Z85 public key> client|operator'"),
        ("x" * 40 + " root", "expected '<Z85 public key> client|operator'"),
        ("~" * 40 + " client", f"{'~' * 40!r} is not a 40-character Z85 key"),
    ],
)
def test_a_bad_authorized_key_names_its_line(tmp_path: Path, line: str, problem: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# comment\n{line}\n")
    with pytest.raises(AccessError) as refused:
        read_authorized_keys(keys)
    assert str(refused.value) == f"curve_authorized_keys_file {keys} line 2: {problem}"


def test_the_secret_key_file_is_a_private_zmq_certificate(tmp_path: Path) -> None:
    public_file, secret_file = zmq.auth.create_certificates(tmp_path, "server")
    _, secret = zmq.auth.load_certificate(secret_file)
    os.chmod(secret_file, 0o644)
    with pytest.raises(AccessError) as refused:
        read_secret_key(Path(secret_file))
    assert str(refused.value) == (
        f"curve_secret_key_file {secret_file} can be read by every user (mode 0644); "
        "make it 0600 or 0640"
    )
    os.chmod(secret_file, 0o600)
    assert read_secret_key(Path(secret_file)) == secret
    os.chmod(public_file, 0o600)
    with pytest.raises(AccessError) as refused:
        read_secret_key(Path(public_file))
    assert str(refused.value) == (
        f'curve_secret_key_file {public_file}: no secret-key = "<40 Z85 characters>"'
    )


async def admitted(control: str, attempts: int = 100) -> EngineClient:
    """A client the daemon admitted. A refused client is done (libzmq does not retry a
    refused handshake), and the gate may still count a connection just closed (its
    DISCONNECTED event is on its way), so each refusal is followed by a new client."""
    for _ in range(attempts):
        client = await EngineClient.connect(control)
        try:
            await client.hello(timeout=10)
            return client
        except ConnectionRefused as refused:
            assert refused.status == 500
            await client.close()
    raise AssertionError(f"not admitted in {attempts} attempts")


def test_past_the_connection_cap_a_client_is_refused_and_told(tmp_path: Path) -> None:
    async def scenario(control: str) -> None:
        clients = [await admitted(control) for _ in range(3)]
        extra = await EngineClient.connect(control)
        with pytest.raises(ConnectionRefused) as refused:
            await extra.hello(timeout=10)
        assert refused.value.status == 500
        assert str(refused.value) == (
            "the daemon refused the connection (ZAP 500): it is at its connection limit "
            "(max_connections)"
        )
        # The refusal is final for that client, at once.
        with pytest.raises(ConnectionRefused):
            await extra.ping(timeout=10)
        await extra.close()
        for client in clients:
            await client.ping()
        await clients.pop().close()
        clients.append(await admitted(control))
        for client in clients:
            await client.ping()
            await client.close()

    with start_daemon(tmp_path, "--max-connections", "3") as daemon:
        asyncio.run(scenario(daemon.control))


def test_a_refusal_is_seen_however_late_the_client_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's monitor is attached before its socket connects: on a loaded machine the
    daemon may refuse the handshake before the client's thread runs again (CI saw a call
    wait its whole timeout). A slow attach stands in for that scheduler."""
    attach = Liveness.__init__

    def slow_attach(self: Liveness, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.5)  # not a synchronisation: the scheduler that delays this thread
        attach(self, *args, **kwargs)

    async def scenario(control: str) -> None:
        client = await admitted(control)
        monkeypatch.setattr(Liveness, "__init__", slow_attach)
        extra = await EngineClient.connect(control)
        with pytest.raises(ConnectionRefused) as refused:
            await extra.hello(timeout=10)
        assert refused.value.status == 500
        await extra.close()
        await client.close()

    with start_daemon(tmp_path, "--max-connections", "1") as daemon:
        asyncio.run(scenario(daemon.control))


class Keys:
    def __init__(self, directory: Path) -> None:
        directory.mkdir()
        _, secret_file = zmq.auth.create_certificates(directory, "server")
        os.chmod(secret_file, 0o600)
        self.secret_file = Path(secret_file)
        self.server_public, _ = zmq.auth.load_certificate(secret_file)
        self.operator = zmq.curve_keypair()
        self.client = zmq.curve_keypair()
        self.stranger = zmq.curve_keypair()
        self.authorized = directory / "authorized"
        self.authorized.write_text(
            f"{self.operator[0].decode()} operator\n{self.client[0].decode()} client\n"
        )

    def of(self, pair: tuple[bytes, bytes]) -> CurveClientKeys:
        return {"public_key": pair[0], "secret_key": pair[1], "server_key": self.server_public}


@pytest.fixture
def curve_daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Keys]]:
    keys = Keys(tmp_path / "keys")
    with start_daemon(
        tmp_path,
        "--curve-secret-key-file",
        str(keys.secret_file),
        "--curve-authorized-keys-file",
        str(keys.authorized),
        "--curve-publishers",
        env={"XDG_RUNTIME_DIR": str(tmp_path)},
        control=f"tcp://127.0.0.1:{free_tcp_port()}",
        ready_keys=keys.of(keys.operator),
    ) as daemon:
        yield daemon, keys


def test_under_curve_roles_are_the_keys(curve_daemon: tuple[DaemonProcess, Keys]) -> None:
    daemon, keys = curve_daemon

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control, curve=keys.of(keys.client)) as c:
            await c.hello()
            with pytest.raises(EngineError) as forbidden:
                await c.set_vocabulary(1000, [])
            assert forbidden.value.code == "forbidden"
        async with await EngineClient.connect(daemon.control, curve=keys.of(keys.operator)) as o:
            assert isinstance(await o.set_vocabulary(1000, []), Applied)
        async with await EngineClient.connect(daemon.control, curve=keys.of(keys.stranger)) as s:
            with pytest.raises(ConnectionRefused) as refused:
                await s.hello(timeout=10)
            assert refused.value.status == 400
        # A peer without CURVE fails the greeting: it is never answered.
        async with await EngineClient.connect(daemon.control) as plain:
            with pytest.raises(TimeoutError):
                await plain.hello(timeout=1)

    asyncio.run(scenario())


def test_under_curve_kv_subscribers_need_a_key(curve_daemon: tuple[DaemonProcess, Keys]) -> None:
    daemon, keys = curve_daemon

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        client_keys = keys.of(keys.client)
        sub.curve_serverkey = client_keys["server_key"]
        sub.curve_publickey, sub.curve_secretkey = keys.client
        sub.subscribe(b"")
        sub.connect(daemon.kv_endpoint())
        try:
            async with await EngineClient.connect(daemon.control, curve=client_keys) as c:
                # Until the subscription is through, each request's events may be missed.
                for attempt in range(100):
                    await c.generate(list(range(attempt * 64, attempt * 64 + 64)), max_tokens=1)
                    if await sub.poll(100):
                        break
                frames = await sub.recv_multipart()
            assert len(frames) == 3
        finally:
            sub.close(linger=0)
            ctx.term()

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", [0o644, 0o600])
def test_a_daemon_with_unusable_keys_does_not_start(tmp_path: Path, mode: int) -> None:
    keys = Keys(tmp_path / "keys")
    os.chmod(keys.secret_file, mode)
    keys.authorized.write_text("not-a-key operator\n")
    daemon = DaemonProcess(
        tmp_path,
        [
            "--curve-secret-key-file",
            str(keys.secret_file),
            "--curve-authorized-keys-file",
            str(keys.authorized),
        ],
        None,
    )
    daemon.proc.wait(timeout=60)
    assert daemon.stop() == 3
    expected = (
        f"{keys.secret_file} can be read by every user (mode 0644)"
        if mode == 0o644
        else f"{keys.authorized} line 1: 'not-a-key' is not a 40-character Z85 key"
    )
    assert expected in daemon.log()


def test_the_tools_take_curve_keys_from_the_environment(
    tmp_path: Path, curve_daemon: tuple[DaemonProcess, Keys]
) -> None:
    daemon, keys = curve_daemon
    client_public, client_secret = keys.client
    client_file = tmp_path / "client.key_secret"
    client_file.write_text(
        f'curve\n    public-key = "{client_public.decode()}"\n'
        f'    secret-key = "{client_secret.decode()}"\n'
    )
    client_file.chmod(0o600)
    server_file = keys.secret_file.with_suffix(".key")
    env = {
        **os.environ,
        "ENGINED_CURVE_CLIENT_KEY_FILE": str(client_file),
        "ENGINED_CURVE_SERVER_KEY_FILE": str(server_file),
    }
    command = [*ENGINED, "stats", "--control-endpoint", daemon.control, "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["dp_rank"] == 0
    del env["ENGINED_CURVE_SERVER_KEY_FILE"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert (
        "CURVE needs both ENGINED_CURVE_CLIENT_KEY_FILE and ENGINED_CURVE_SERVER_KEY_FILE"
        in done.stderr
    )
