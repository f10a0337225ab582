"""A second daemon on the same ipc:// paths exits 3 and leaves the first one serving (issue 10,
11), as one on the same tcp ports does.

libzmq unlinks whatever is at an ipc path before binding it, so without a check the second
daemon silently took the sockets over. Now a path is refused when a process accepts
connections there or when it is not a socket at all; a stale socket file (a killed daemon's)
is replaced, and `<path>.lock` stops two daemons that start at the same moment. That lock file
is opened without following a symlink and must be a regular file of the daemon's own uid
(issue 21, 1): planted as anything else by another local user, the daemon exits 3.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.zmq_sockets import IpcClaim, SocketRegistry, check_ipc_path, make_socket
from tests.server.daemon_harness import DaemonProcess, start_daemon

STARTUP_FAILURE = 3


def test_a_second_daemon_on_the_same_ipc_paths_exits_3(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with start_daemon(tmp_path / "a") as first:
        # The first daemon's endpoints (given last, the flags override the harness's own).
        same = [
            *("--control-endpoint", first.control, "--kv-events-endpoint", first.kv),
            *("--kv-replay-endpoint", first.replay, "--fpm-endpoint", first.fpm),
        ]
        second = DaemonProcess(tmp_path / "b", same, None)
        try:
            assert second.proc.wait(30) == STARTUP_FAILURE
        finally:
            second.stop()
        log = second.log()
        assert "startup failed" in log and "in use" in log, log

        async def still_serving() -> None:
            async with await EngineClient.connect(first.control) as client:
                await client.ping(timeout=10)
                gen = await client.generate([1, 2, 3, 4], 2, timeout=10)
                assert gen.finish_reason == "length"

        asyncio.run(still_serving())


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    base = tmp_path / "engined"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(f"{base}-control")  # bound, never listening, then closed: the file stays
    stale.close()
    assert Path(f"{base}-control").exists()
    with start_daemon(tmp_path) as daemon:
        assert daemon.control == f"ipc://{base}-control"


def test_a_path_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    keep = Path(f"{tmp_path / 'engined'}-kv")
    keep.write_text("not a socket")
    daemon = DaemonProcess(tmp_path, [], None)
    try:
        assert daemon.proc.wait(30) == STARTUP_FAILURE
    finally:
        daemon.stop()
    assert keep.read_text() == "not a socket"
    assert "exists and is not a socket" in daemon.log()


def test_check_refuses_a_live_listener_of_any_kind(tmp_path: Path) -> None:
    path = str(tmp_path / "live")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(path)
        live.listen()
        with pytest.raises(OSError) as info:
            check_ipc_path(f"ipc://{path}")
        assert info.value.errno == errno.EADDRINUSE
        ctx = zmq.asyncio.Context()
        try:
            with pytest.raises(OSError):
                make_socket(ctx, zmq.ROUTER, f"ipc://{path}", bind=True)
        finally:
            ctx.term()
    # tcp, abstract names and connects are not checked (the kernel keeps those unique).
    check_ipc_path("tcp://127.0.0.1:1")
    check_ipc_path("ipc://@engined-test-abstract")


def test_a_claimed_path_cannot_be_claimed_twice(tmp_path: Path) -> None:
    path = str(tmp_path / "claimed")
    first = IpcClaim(path)
    with pytest.raises(OSError) as info:
        IpcClaim(path)
    assert info.value.errno == errno.EADDRINUSE
    first.release()
    IpcClaim(path).release()


def test_the_registry_claims_what_it_binds_until_closed(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/bound"
    ctx = zmq.asyncio.Context()
    try:
        registry = SocketRegistry()
        registry.make(ctx, zmq.PUB, endpoint, bind=True)
        with pytest.raises(OSError):
            IpcClaim(f"{tmp_path}/bound")
        registry.close()
        IpcClaim(f"{tmp_path}/bound").release()
    finally:
        ctx.term()


# --- the lock file: never followed, only a regular file of our own uid (issue 21, 1) -------


def test_a_lock_planted_as_a_symlink_stops_the_daemon_and_creates_nothing(tmp_path: Path) -> None:
    """1. Another user plants `<control>.lock` as a symlink to a file that does not exist.
    2. The daemon exits 3 naming the lock file, and the symlink's target is never created.
    """
    target = tmp_path / "elsewhere" / "victim"
    target.parent.mkdir()
    lock = Path(f"{tmp_path / 'engined'}-control.lock")
    lock.symlink_to(target)
    daemon = DaemonProcess(tmp_path, [], None)
    try:
        assert daemon.proc.wait(30) == STARTUP_FAILURE
    finally:
        daemon.stop()
    assert not target.exists()
    assert lock.is_symlink()
    assert f"ipc lock file {lock} is a symbolic link, not a regular file" in daemon.log()


def test_a_symlink_to_an_existing_file_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    os.chmod(target, 0o644)
    Path(f"{tmp_path}/sock.lock").symlink_to(target)
    with pytest.raises(OSError) as info:
        IpcClaim(f"{tmp_path}/sock")
    assert info.value.errno == errno.EEXIST
    assert "is a symbolic link, not a regular file" in str(info.value.strerror)
    assert target.read_text() == "keep"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def _plant_fifo(path: Path) -> None:
    os.mkfifo(path)


def _plant_directory(path: Path) -> None:
    path.mkdir()


def _plant_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


@pytest.mark.parametrize(
    ("plant", "kind"),
    [(_plant_fifo, "a FIFO"), (_plant_directory, "a directory"), (_plant_socket, "a socket")],
)
def test_a_lock_path_of_another_type_is_refused_without_blocking(
    tmp_path: Path, plant: Callable[[Path], None], kind: str
) -> None:
    """A FIFO nobody writes to would block a plain open; it is refused at once, as the rest."""
    plant(tmp_path / "sock.lock")
    with pytest.raises(OSError) as info:
        IpcClaim(f"{tmp_path}/sock")
    assert info.value.errno == errno.EEXIST
    assert info.value.strerror == (
        f"ipc lock file {tmp_path}/sock.lock is {kind}, not a regular file: "
        "refusing it (remove it if stale)"
    )


def test_a_lock_file_of_another_uid_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is ours; the daemon is made to run as another uid (as another user would)."""
    (tmp_path / "sock.lock").write_text("")
    owner = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(OSError) as info:
        IpcClaim(f"{tmp_path}/sock")
    assert info.value.strerror == (
        f"ipc lock file {tmp_path}/sock.lock is owned by uid {owner}, not by this daemon's "
        f"uid {owner + 1}: refusing it (remove it if stale)"
    )
    monkeypatch.undo()
    IpcClaim(f"{tmp_path}/sock").release()


def test_a_fresh_lock_file_is_a_private_regular_file(tmp_path: Path) -> None:
    claim = IpcClaim(f"{tmp_path}/sock")
    try:
        status = os.lstat(claim.path)
        assert stat.S_ISREG(status.st_mode)
        assert status.st_uid == os.geteuid()
        assert stat.S_IMODE(status.st_mode) == 0o600
    finally:
        claim.release()
