"""A ZMTP 3.0 peer written by hand (NULL mechanism), to present what libzmq's sockets never do.

libzmq's own DEALER sends its READY (with its routing id) as soon as the greeting is done;
an attacker can hold it back until the daemon's READY has come, which is how a peer keeps a
routing id of its choosing past the daemon's ZAP handler (docs/security.md §1). This peer
does either, over tcp or ipc, synchronously, with a timeout on every read.
"""

from __future__ import annotations

import socket
import struct

_MORE = 0x01
_LONG = 0x02
_COMMAND = 0x04


def _greeting() -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


class ZmtpPeer:
    """One connection as a DEALER that presents `identity`, READY sent early or late."""

    def __init__(
        self, endpoint: str, *, identity: bytes, late_ready: bool, timeout: float = 10.0
    ) -> None:
        if endpoint.startswith("ipc://"):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout)
            self._sock.connect(endpoint.removeprefix("ipc://"))
        else:
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._sock.sendall(_greeting())
        self._read_exactly(64)
        ready = _frame(
            b"\x05READY" + _property(b"Socket-Type", b"DEALER") + _property(b"Identity", identity),
            _COMMAND,
        )
        if not late_ready:
            self._sock.sendall(ready)
        flags, body = self._read_frame()
        if not flags & _COMMAND or not body.startswith(b"\x05READY"):
            raise ConnectionRefusedError(f"the daemon answered {body[:32]!r}, not READY")
        if late_ready:
            self._sock.sendall(ready)

    def send(self, *frames: bytes) -> None:
        last = len(frames) - 1
        self._sock.sendall(
            b"".join(_frame(body, 0 if i == last else _MORE) for i, body in enumerate(frames))
        )

    def recv(self) -> list[bytes]:
        """The next message (all its frames); commands (pings) are skipped."""
        frames: list[bytes] = []
        while True:
            flags, body = self._read_frame()
            if flags & _COMMAND:
                continue
            frames.append(body)
            if not flags & _MORE:
                return frames

    def close(self) -> None:
        self._sock.close()

    def _read_frame(self) -> tuple[int, bytes]:
        flags = self._read_exactly(1)[0]
        if flags & _LONG:
            size = struct.unpack(">Q", self._read_exactly(8))[0]
        else:
            size = self._read_exactly(1)[0]
        return flags, self._read_exactly(size)

    def _read_exactly(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = self._sock.recv(count - len(data))
            if not chunk:
                raise ConnectionResetError("the daemon closed the connection")
            data += chunk
        return data
