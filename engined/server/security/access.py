"""The daemon's access settings made usable: key files read, the operator endpoint resolved.

Read at start-up, where a key file that is missing, unreadable, readable by others or
malformed ends the daemon with a message naming the file and the line.
"""

from __future__ import annotations

import os
import re
import resource
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.utils.z85

from engined.config import DaemonConfig
from engined.config.certificates import read_key_pair
from engined.config.endpoints import parse_endpoint
from engined.server.security.gatekeeper import GatePolicy, Role, operator_uids

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
# File descriptors kept for everything but connections: sockets bound, files, pipes to rank
# workers, libzmq's own (two per context and per I/O thread).
FD_RESERVE = 256


class AccessError(Exception):
    """A key file or the operator endpoint cannot be used; the message says which and why."""


def gate_policy(cfg: DaemonConfig) -> GatePolicy:
    curve_secret: bytes | None = None
    authorized: dict[bytes, Role] = {}
    if cfg.curve_secret_key_file:
        curve_secret = read_secret_key(Path(cfg.curve_secret_key_file))
        authorized = read_authorized_keys(Path(cfg.curve_authorized_keys_file))
    return GatePolicy(
        max_connections=fitting_connection_cap(cfg.max_connections),
        operator_uids=operator_uids(),
        curve_secret_key=curve_secret,
        authorized_keys=authorized,
        curve_publishers=cfg.curve_publishers,
    )


def read_secret_key(path: Path) -> bytes:
    """The Z85 secret key of the daemon's certificate (engined.config.certificates)."""
    try:
        _public, secret = read_key_pair(path)
    except ValueError as exc:
        raise AccessError(f"curve_secret_key_file {exc}") from None
    return secret


def read_authorized_keys(path: Path) -> dict[bytes, Role]:
    """Client keys and roles: one `<Z85 public key> <client|operator> [comment]` per line.

    Returned by raw key (32 bytes), as ZAP presents a client's key.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AccessError(f"curve_authorized_keys_file {path}: {exc}") from None
    keys: dict[bytes, Role] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        # Z85 has '#' among its characters: only a line that starts with one is a comment.
        if not words or words[0].startswith("#"):
            continue
        where = f"curve_authorized_keys_file {path} line {number}"
        if len(words) < 2 or words[1] not in Role.__members__.values():
            raise AccessError(f"{where}: expected '<Z85 public key> client|operator'")
        try:
            raw = zmq.utils.z85.decode(words[0])
        except (ValueError, KeyError):
            raw = b""
        if len(words[0]) != 40 or len(raw) != 32:
            raise AccessError(f"{where}: {words[0][:48]!r} is not a 40-character Z85 key")
        keys[raw] = Role(words[1])
    return keys


class OperatorEndpoint(NamedTuple):
    """Where operators connect without CURVE: `bind`, an ipc endpoint the control ROUTER
    binds besides `control_endpoint` (None: none), and `advertised`, what the `welcome`
    names (None: no ipc way in at all)."""

    bind: str | None
    advertised: str | None


def operator_endpoint(cfg: DaemonConfig) -> OperatorEndpoint:
    """`operator_endpoint` resolved.

    "auto" gives a tcp control socket an extra one in a directory only the daemon's user
    can enter (the kernel checks the uid again at every connection); an ipc control socket
    already admits them, so it needs none and is itself the way in.
    """
    control = parse_endpoint(cfg.control_endpoint)
    bind: str | None = cfg.operator_endpoint or None
    if bind == "auto":
        bind = None
        if control.scheme == "tcp":
            name = _NAME_UNSAFE.sub("_", f"engined-{control.where}-{control.port}.operator")
            bind = f"ipc://{private_directory() / name}"
    if bind is not None:
        return OperatorEndpoint(bind, bind)
    return OperatorEndpoint(None, cfg.control_endpoint if control.scheme == "ipc" else None)


def private_directory() -> Path:
    """$RUNTIME_DIRECTORY (systemd), $XDG_RUNTIME_DIR, or /tmp/engined-<uid>, made 0700.

    A directory that exists must be ours, a real directory (not a link) and closed to
    others, or it is refused: someone else could otherwise replace the socket in it.
    """
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    base = runtime or os.environ.get("XDG_RUNTIME_DIR", "")
    directory = Path(base) if base else Path(tempfile.gettempdir()) / f"engined-{os.getuid()}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = directory.lstat()
    except OSError as exc:
        raise AccessError(f"operator_endpoint auto: {directory}: {exc.strerror}") from None
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        raise AccessError(
            f"operator_endpoint auto: {directory} is not a directory of this user closed to "
            "others; set operator_endpoint to an ipc path in one"
        )
    return directory


def fitting_connection_cap(max_connections: int) -> int:
    """Raise the soft descriptor limit to the hard one; return the cap to use.

    libzmq spins on a listening socket whose accept fails for want of descriptors; a cap
    below the limit leaves it room. A configured cap that does not fit is lowered (0, no cap,
    is left as asked).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if max_connections == 0 or soft == resource.RLIM_INFINITY:
        return max_connections
    return min(max_connections, max(soft - FD_RESERVE, 1))
