"""Engine-wide commands need the operator role; a client acts on its own requests only.

Without CURVE the operator is an ipc peer running as the daemon's user (the kernel's word,
through libzmq's ZAP address); a tcp peer never is. The daemon here has a tcp control socket,
so it also binds the private ipc operator endpoint that its `welcome` names.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from engined.client import EngineClient, EngineError
from engined.wire.control import Applied, Noop
from tests.server.daemon_harness import DaemonProcess, start_tcp_daemon


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with start_tcp_daemon(tmp_path, "--speedup-ratio", "100") as process:
        yield process


def test_the_welcome_names_a_private_operator_endpoint(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            welcome = await client.hello()
        port = daemon.control.rsplit(":", 1)[1]
        assert welcome.operator_endpoint is not None
        path = Path(welcome.operator_endpoint.removeprefix("ipc://"))
        assert path.name == f"engined-127.0.0.1-{port}.operator"
        info = path.parent.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("command", "what"),
    [
        ("set_vocabulary", "set_vocabulary"),
        ("reset_prefix_cache", "reset_prefix_cache"),
        ("set_fpm_worker_id", "set_fpm_worker_id"),
    ],
)
def test_engine_wide_commands_are_for_operators_only(
    daemon: DaemonProcess, command: str, what: str
) -> None:
    async def call(client: EngineClient) -> object:
        if command == "set_vocabulary":
            return await client.set_vocabulary(1000, [0])
        if command == "reset_prefix_cache":
            return await client.reset_prefix_cache()
        return await client.set_fpm_worker_id("spoofed")

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            welcome = await client.hello()
            with pytest.raises(EngineError) as refused:
                await call(client)
            assert refused.value.code == "forbidden"
            assert refused.value.message == (
                f"{what} needs the operator role: connect to the welcome's operator_endpoint "
                "as the daemon's user, or with an operator CURVE key"
            )
            # Nothing changed: the welcome still says what it said.
            again = await client.hello()
            assert msgspec.structs.replace(again, id=welcome.id) == welcome
        assert welcome.operator_endpoint is not None
        async with await EngineClient.connect(welcome.operator_endpoint) as operator:
            assert isinstance(await call(operator), Applied)
            after = await operator.hello()
        if command == "set_vocabulary":
            assert (after.vocab_size, after.excluded_token_ids) == (1000, [0])
        if command == "set_fpm_worker_id":
            assert after.fpm_worker_id == "spoofed"

    asyncio.run(scenario())


def test_a_client_cancels_only_its_own_requests(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with (
            await EngineClient.connect(daemon.control) as owner,
            await EngineClient.connect(daemon.control) as other,
        ):
            welcome = await owner.hello()
            submitted = await owner.submit(list(range(32)), 100_000, request_id="owned")
            assert submitted.request_id == "owned"
            # Another client's cancel is answered as one of an unknown request.
            assert isinstance(await other.cancel("owned"), Noop)
            # The request still runs: its owner reads on.
            stream = owner.outputs("owned")
            first = await anext(stream)
            assert first.request_id == "owned" and first.finish_reason is None
            assert welcome.operator_endpoint is not None
            async with await EngineClient.connect(welcome.operator_endpoint) as operator:
                assert isinstance(await operator.cancel("owned"), Applied)
            finish = [entry.finish_reason async for entry in stream][-1]
            assert finish == "cancelled"

    asyncio.run(scenario())
