"""Whether this process may bind an `ipc://` path: a live socket there or a planted file says no.

A neutral module beside `engined.zmq_sockets`, which checks and claims every path it binds
here: this part is about files, locks and the peers that own them, not about sockets, and
imports no `engined` module (tests/test_architecture.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from typing import Final


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an `ipc://` endpoint; None for tcp, abstract (`@`) or wildcard
    names, which the kernel or libzmq already keep unique."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    if not path or path.startswith("@") or "*" in path:
        return None
    return path


def check_ipc_path(endpoint: str) -> None:
    """Refuse to bind an `ipc://` path that a live socket owns, or that is not a socket.

    libzmq unlinks whatever is at the path before binding there, so a second daemon given
    the same endpoints would silently take them over from a running one (tcp refuses with
    EADDRINUSE instead). A socket file nobody accepts on is stale (a killed daemon's) and
    libzmq may replace it.

    Raises:
        OSError: EADDRINUSE when a process accepts connections there, EEXIST when the path
            is not a socket (a file libzmq would delete).
    """
    path = ipc_path(endpoint)
    if path is None:
        return
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{endpoint}: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: nobody listens there
    except OSError as exc:
        # A full backlog (EAGAIN) or a timeout still means someone listens there.
        raise OSError(errno.EADDRINUSE, f"{endpoint} is in use: {exc}") from None
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"{endpoint} is in use by another process")


class IpcClaim:
    """An exclusive lock on `<path>.lock` held while this process binds `path`.

    `check_ipc_path` sees only a socket that is already listening; two daemons starting at
    the same moment could both find the path free. The flock makes the check and the bind
    one step per path. The lock file stays after exit (an unlocked one means nothing).

    The lock lives beside the socket, often in a directory other local users can write
    (`/tmp`): one of them could plant `<path>.lock` as a symlink to make the daemon create
    and lock a file elsewhere, or as a FIFO or device whose open has effects. So the last
    component is never followed and the file must be a regular file of the daemon's own
    uid, or the bind is refused (OSError, a start-up failure like a live socket).
    """

    def __init__(self, path: str) -> None:
        self.path = path + ".lock"
        self._fd: int | None = _open_lock(self.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise OSError(
                errno.EADDRINUSE,
                f"ipc://{path} is in use by another process (it holds {self.path})",
            ) from None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# NOFOLLOW: a planted symlink fails (ELOOP) instead of being followed; NONBLOCK and NOCTTY:
# opening a FIFO or a terminal planted there neither waits for a writer nor adopts a tty.
_LOCK_FLAGS: Final = (
    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
)
_FILE_KINDS: Final = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a device",
}


def _open_lock(path: str) -> int:
    """A descriptor of the lock file at `path`, a regular file owned by our effective uid.

    Raises:
        OSError: EEXIST when the path is a symlink, anything but a regular file, or owned
            by another uid; the message names the path and what is wrong with it.
    """
    try:
        fd = os.open(path, _LOCK_FLAGS, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        status = os.lstat(path)
    else:
        status = os.fstat(fd)
        if stat.S_ISREG(status.st_mode) and status.st_uid == os.geteuid():
            return fd
        os.close(fd)
    kind = stat.S_IFMT(status.st_mode)
    if kind == stat.S_IFREG:
        problem = f"is owned by uid {status.st_uid}, not by this daemon's uid {os.geteuid()}"
    else:
        problem = f"is {_FILE_KINDS.get(kind, f'of file type {kind:o}')}, not a regular file"
    raise OSError(errno.EEXIST, f"ipc lock file {path} {problem}: refusing it (remove it if stale)")
