"""Fixtures of the server tests (shared functions are in tests/server/support.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.daemon_harness import DaemonProcess, start_daemon


@pytest.fixture(scope="module")
def daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    """One `engined serve` per test module, started with the module's `DAEMON_FLAGS` and
    shared by its tests that take `daemon` (they must leave it as they found it)."""
    flags: tuple[str, ...] = request.module.DAEMON_FLAGS
    name = request.module.__name__.rpartition(".")[2]
    with start_daemon(tmp_path_factory.mktemp(name), *flags) as running:
        yield running
