"""Run a command under the kernel-level rules of a systemd unit file, without systemd.

    python tests/server/unit_sandbox.py systemd/engined.service -- engined serve ...

Applies `MemoryDenyWriteExecute=` (prctl PR_SET_MDWE, which systemd itself uses where the
kernel has it), `SystemCallFilter=` (a seccomp allow list, the groups expanded by
`systemd-analyze syscall-filter`, `~` lines subtracted; any other call kills the process, as
under systemd) and `RestrictAddressFamilies=` (a second filter, as systemd builds it:
socket() for an unlisted family fails with EAFNOSUPPORT), then execs the command. A daemon
that serves under this wrapper does not trip the unit's sandbox, and since the unit file
itself is read, the test follows every edit to it.

Linux only; needs libseccomp (a dependency of Debian's systemd) and systemd-analyze.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

PR_SET_MDWE = 65
MDWE_REFUSE_EXEC_GAIN = 1
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000  # | errno
SCMP_CMP_EQ = 4
SCMP_CMP_GT = 6
AF_MAX = 46  # past the last address family Linux defines
NR_SCMP_ERROR = -1


class ScmpArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


def unit_settings(unit: Path) -> dict[str, list[str]]:
    """Every `Key=value` of the unit's [Service] section, values in order of appearance."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def expand(group: str, seen: set[str] | None = None) -> set[str]:
    """The system calls of a filter word: a name, or an @group (recursively)."""
    if not group.startswith("@"):
        return {group}
    seen = set() if seen is None else seen
    if group in seen:
        return set()
    seen.add(group)
    listing = subprocess.run(
        ["systemd-analyze", "syscall-filter", group], check=True, capture_output=True, text=True
    ).stdout
    names: set[str] = set()
    for line in listing.splitlines()[1:]:
        word = line.strip()
        if word and not word.startswith("#"):
            names |= expand(word, seen)
    return names


def allowed_syscalls(filters: list[str]) -> set[str]:
    allowed: set[str] = set()
    denied: set[str] = set()
    for value in filters:
        target = denied if value.startswith("~") else allowed
        for word in value.removeprefix("~").split():
            target |= expand(word)
    return allowed - denied


def apply(unit: Path) -> None:
    settings = unit_settings(unit)
    libc = ctypes.CDLL(None, use_errno=True)
    mdwe = settings.get("MemoryDenyWriteExecute", ["no"])[-1] == "yes"
    if mdwe and libc.prctl(PR_SET_MDWE, MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_MDWE)")
    seccomp = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = (ctypes.c_uint32,)
    seccomp.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    seccomp.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ScmpArgCmp),
    )
    seccomp.seccomp_load.argtypes = (ctypes.c_void_p,)
    families = {
        int(getattr(socket, name))
        for value in settings.get("RestrictAddressFamilies", [])
        for name in value.split()
    }
    if families:
        # NOTE: a filter of its own (the kernel applies the strictest answer of all filters),
        # refusing every family but the listed ones, the way systemd's seccomp-util does.
        ctx = seccomp.seccomp_init(SCMP_ACT_ALLOW)
        nr = seccomp.seccomp_syscall_resolve_name(b"socket")
        refuse = SCMP_ACT_ERRNO | errno.EAFNOSUPPORT
        for family in range(AF_MAX):
            if family not in families:
                cmp = ScmpArgCmp(0, SCMP_CMP_EQ, family, 0)
                _check(seccomp.seccomp_rule_add_array(ctx, refuse, nr, 1, cmp), "socket")
        cmp = ScmpArgCmp(0, SCMP_CMP_GT, AF_MAX - 1, 0)
        _check(seccomp.seccomp_rule_add_array(ctx, refuse, nr, 1, cmp), "socket")
        _check(seccomp.seccomp_load(ctx), "seccomp_load")
    filters = settings.get("SystemCallFilter", [])
    if filters:
        # NOTE: the allow list goes last: it does not allow seccomp() itself.
        ctx = seccomp.seccomp_init(SCMP_ACT_KILL_PROCESS)
        for name in sorted(allowed_syscalls(filters)):
            nr = seccomp.seccomp_syscall_resolve_name(name.encode())
            if nr != NR_SCMP_ERROR:  # else not a system call of this architecture
                _check(seccomp.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 0, None), name)
        _check(seccomp.seccomp_load(ctx), "seccomp_load")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(-rc, f"seccomp: {what}")


def main(argv: list[str]) -> None:
    unit, sep, *command = argv
    assert sep == "--" and command, "usage: unit_sandbox.py UNIT -- COMMAND..."
    apply(Path(unit))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
