"""systemd: the notify protocol, the watchdog, and the unit files.

1. `Notifier` against a real AF_UNIX datagram socket, at a path and in the abstract
   namespace; `watchdog_interval` from the environment; `keepalive`'s cadence.
2. A real `engined serve` with NOTIFY_SOCKET and WATCHDOG_USEC=200000 (a ping every 0.1 s):
   READY=1 once its control socket answers, WATCHDOG=1 pings, STOPPING=1 on SIGTERM, exit 0.
3. The same daemon frozen with SIGSTOP: the pings stop (the event loop sends them, so a stuck
   loop gets restarted by systemd), and resume after SIGCONT.
4. The unit files: `systemd-analyze verify`, and the daemon serving under the kernel rules
   they declare (MemoryDenyWriteExecute, SystemCallFilter, RestrictAddressFamilies; see
   tests/server/unit_sandbox.py). With CI=true a missing `systemd-analyze` fails these
   tests (.ci/run installs it); elsewhere they are skipped with the reason.

Every wait is bounded by a deadline (select on the notify socket, reply timeouts); the only
timed window is the freeze test's "no ping for several intervals", which is what it checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog.testing
import zmq.asyncio

from engined.client import EngineClient
from engined.config import FLAGS, load_config
from engined.server.ops.systemd import Notifier, NullNotifier, keepalive, watchdog_interval
from tests.server import daemon_harness
from tests.server.daemon_harness import DaemonProcess, read_fpm, start_daemon
from tests.support import free_tcp_port

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
SANDBOX = Path(__file__).with_name("unit_sandbox.py")
WATCHDOG_USEC = 200_000  # a ping every 0.1 s
PING_S = WATCHDOG_USEC / 2 / 1e6
WAIT_S = 20.0

Message = dict[str, str]


def parse(datagram: bytes) -> Message:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n"))


class NotifyListener:
    """systemd's side: the datagram socket that NOTIFY_SOCKET names."""

    def __init__(self, tmp_path: Path, *, abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            self.address = f"@engined-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + self.address[1:])
        else:
            self.address = str(tmp_path / "notify")
            self.sock.bind(self.address)

    def close(self) -> None:
        self.sock.close()

    def next(self, timeout: float = WAIT_S, proc: subprocess.Popen[bytes] | None = None) -> Message:
        """The next message; fails at the deadline, or early if `proc` exits."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self.sock], [], [], min(remaining, 0.5))
            if readable:
                return parse(self.sock.recv(4096))
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"engined exited with {proc.returncode} before notifying")
        raise AssertionError(f"no notify message within {timeout} s")

    def until(
        self, done: Callable[[Message], bool], proc: subprocess.Popen[bytes] | None = None
    ) -> list[Message]:
        """Messages up to and including the first one `done` accepts."""
        seen = [self.next(proc=proc)]
        while not done(seen[-1]):
            seen.append(self.next(proc=proc))
        return seen

    def pending(self) -> list[Message]:
        """What is already queued, without waiting."""
        out = []
        while select.select([self.sock], [], [], 0)[0]:
            out.append(parse(self.sock.recv(4096)))
        return out

    def during(self, seconds: float) -> list[Message]:
        """Everything that arrives within the next `seconds`."""
        out = []
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if select.select([self.sock], [], [], remaining)[0]:
                out.append(parse(self.sock.recv(4096)))
        return out


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NotifyListener]:
    listen = NotifyListener(tmp_path, abstract=request.param == "abstract")
    yield listen
    listen.close()


@contextlib.contextmanager
def notifier_for(listener: NotifyListener) -> Iterator[Notifier]:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": listener.address})
    assert isinstance(notifier, Notifier)
    try:
        yield notifier
    finally:
        notifier.close()


# --- 1. Notifier, watchdog_interval, keepalive ----------------------------------------------


def test_messages_arrive_as_key_value_lines(listener: NotifyListener) -> None:
    with notifier_for(listener) as notifier:
        assert notifier.ready(status="1 ranks, 0 running")
        assert notifier.watchdog()
        assert notifier.status("two\nlines")
        assert notifier.stopping()
        assert notifier.notify(READY=1, STATUS="x=y")
    assert [listener.next(1.0) for _ in range(5)] == [
        {"READY": "1", "STATUS": "1 ranks, 0 running"},
        {"WATCHDOG": "1"},
        {"STATUS": "two lines"},
        {"STOPPING": "1"},
        {"READY": "1", "STATUS": "x=y"},
    ]


@pytest.mark.parametrize("value", [None, "", "vsock:2:1234", "relative/path", "@"])
def test_no_usable_notify_socket_gives_a_null_notifier(value: str | None) -> None:
    env = {} if value is None else {"NOTIFY_SOCKET": value}
    notifier = Notifier.from_env(env)
    assert isinstance(notifier, NullNotifier)
    assert not notifier.enabled
    assert not notifier.ready(status="x")
    assert not notifier.watchdog()
    assert not notifier.stopping()
    notifier.close()


def test_a_vanished_socket_is_logged_once_and_never_raises(listener: NotifyListener) -> None:
    with notifier_for(listener) as notifier, structlog.testing.capture_logs() as logs:
        listener.close()
        if not listener.address.startswith("@"):
            os.unlink(listener.address)
        assert not notifier.watchdog()
        assert not notifier.watchdog()
        assert not notifier.ready()
    assert notifier.failures == 3
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1, logs
    assert warnings[0]["address"] == listener.address


def test_a_full_receiver_queue_drops_instead_of_blocking(listener: NotifyListener) -> None:
    """The event loop sends: a receiver that never reads must not block it."""
    with notifier_for(listener) as notifier, structlog.testing.capture_logs():
        deadline = time.monotonic() + WAIT_S
        while notifier.watchdog():
            assert time.monotonic() < deadline, "the receive queue never filled"
        assert notifier.failures == 1
        listener.pending()
        assert notifier.watchdog()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "200000"}, 0.1),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "ten"}, None),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_for_our_pid(
    env: dict[str, str], expected: float | None
) -> None:
    with structlog.testing.capture_logs():
        assert watchdog_interval(env) == expected


class Recorder(NullNotifier):
    """Records what `keepalive` sends; sets `enough` once it has `statuses` STATUS lines."""

    def __init__(self, statuses: int) -> None:
        self.messages: list[dict[str, object]] = []
        self.enough = asyncio.Event()
        self._statuses = statuses

    def notify(self, **fields: object) -> bool:
        self.messages.append(fields)
        if sum("STATUS" in m for m in self.messages) >= self._statuses:
            self.enough.set()
        return True


@pytest.mark.parametrize("watchdog_s", [0.01, None])
def test_keepalive_pings_first_then_on_both_cadences(watchdog_s: float | None) -> None:
    async def scenario() -> list[dict[str, object]]:
        recorder = Recorder(statuses=3)
        lines = iter(range(100))
        task = asyncio.create_task(
            keepalive(recorder, lambda: f"line {next(lines)}", watchdog_s=watchdog_s, status_s=0.05)
        )
        try:
            await asyncio.wait_for(recorder.enough.wait(), WAIT_S)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return recorder.messages

    messages = asyncio.run(scenario())
    statuses = [m["STATUS"] for m in messages if "STATUS" in m]
    pings = [m for m in messages if m == {"WATCHDOG": 1}]
    assert statuses[:3] == ["line 0", "line 1", "line 2"]
    if watchdog_s is None:
        assert not pings
    else:
        assert messages[0] == {"WATCHDOG": 1}
        # 0.1 s of statuses at a 0.01 s cadence: pings outnumber statuses.
        assert len(pings) > len(statuses)


# --- 2 and 3. A real daemon under a notify socket --------------------------------------------


def start_notified(tmp_path: Path, listener: NotifyListener, *args: str) -> DaemonProcess:
    env = {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    return DaemonProcess(tmp_path, list(args), env)


async def ping_once(endpoint: str) -> None:
    async with await EngineClient.connect(endpoint) as client:
        await client.ping(timeout=5.0)


def is_ping(message: Message) -> bool:
    return message.get("WATCHDOG") == "1"


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_daemon_notifies_ready_then_pings_then_stopping(tmp_path: Path, abstract: bool) -> None:
    """1. Start `engined serve` with NOTIFY_SOCKET and WATCHDOG_USEC=200000.
    2. The first message is READY=1 with a STATUS line; the control socket answers at once.
    3. WATCHDOG=1 pings follow.
    4. SIGTERM: STOPPING=1 arrives and the daemon exits 0.
    """
    listener = NotifyListener(tmp_path, abstract=abstract)
    daemon = start_notified(tmp_path, listener)
    try:
        ready = listener.next(proc=daemon.proc)
        assert ready == {"READY": "1", "STATUS": "1 ranks, 0 running, 0 waiting, 0 tokens/s"}
        asyncio.run(ping_once(daemon.control))
        pings = 0
        while pings < 3:
            message = listener.next(proc=daemon.proc)
            assert is_ping(message) or "STATUS" in message, message
            pings += is_ping(message)
        daemon.proc.send_signal(signal.SIGTERM)
        stopping = listener.until(lambda m: "STOPPING" in m, proc=None)[-1]
        assert stopping["STOPPING"] == "1"
        assert stopping["STATUS"].startswith("stopping: 1 ranks")
    finally:
        code = daemon.stop()
        listener.close()
    assert code == 0, daemon.log()


def test_a_frozen_loop_stops_the_pings(tmp_path: Path) -> None:
    """1. A daemon pinging every 0.1 s is stopped with SIGSTOP (its loop freezes).
    2. Once the kernel reports it stopped and what it sent before is read, no ping arrives
       for 3 watchdog timeouts (systemd would have killed it by then).
    3. SIGCONT: the pings resume; SIGTERM still ends it with 0.
    """
    listener = NotifyListener(tmp_path, abstract=True)
    daemon = start_notified(tmp_path, listener)
    pid = daemon.proc.pid
    try:
        listener.until(is_ping, proc=daemon.proc)
        os.kill(pid, signal.SIGSTOP)
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        listener.pending()
        assert listener.during(3 * WATCHDOG_USEC / 1e6) == []
        os.kill(pid, signal.SIGCONT)
        listener.until(is_ping, proc=daemon.proc)
        daemon.proc.send_signal(signal.SIGTERM)
        listener.until(lambda m: "STOPPING" in m)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        code = daemon.stop()
        listener.close()
    assert code == 0, daemon.log()


def test_without_notify_socket_nothing_changes(tmp_path: Path) -> None:
    """No NOTIFY_SOCKET (a shell, a container): the daemon serves and exits 0 as before."""
    env = {"NOTIFY_SOCKET": "", "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    with start_daemon(tmp_path, env=env) as daemon:
        asyncio.run(ping_once(daemon.control))


# --- 4. The unit files ---------------------------------------------------------------------


def systemd_analyze() -> str:
    """The systemd-analyze binary; CI must have it, elsewhere its absence skips the test."""
    found = shutil.which("systemd-analyze")
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("systemd-analyze is missing: .ci/run installs Debian's systemd package")
    pytest.skip("systemd-analyze not installed (Debian: apt-get install systemd)")


def installed_units(tmp_path: Path, *names: str) -> list[Path]:
    """The unit files with ExecStart pointing at this venv's `engined` (verify checks it)."""
    engined = Path(sys.executable).with_name("engined")
    assert engined.exists(), f"{engined} missing: pip install -e . installs it"
    out = []
    for name in names:
        text = (UNITS / name).read_text()
        assert "ExecStart=/usr/local/bin/engined " in text
        target = tmp_path / name
        target.write_text(text.replace("/usr/local/bin/engined", str(engined)))
        out.append(target)
    return out


def verify(analyze: str, *units: Path | str, cwd: Path) -> str:
    result = subprocess.run(
        [analyze, "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )
    complaints = "\n".join(
        line for line in (result.stdout + result.stderr).splitlines() if "engined" in line
    )
    assert result.returncode == 0 or complaints, result.stdout + result.stderr
    return complaints


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    single, template, worker = installed_units(
        tmp_path, "engined.service", "engined@.service", "engined-dynamo-worker@.service"
    )
    instances = (
        template.with_name("engined@prefill.service"),
        worker.with_name("engined-dynamo-worker@prefill.service"),
    )
    assert verify(analyze, single, *instances, cwd=tmp_path) == ""


def test_the_dynamo_worker_unit_is_bound_to_its_daemon_with_the_same_sandbox() -> None:
    def sandbox(name: str) -> list[str]:
        text = (UNITS / name).read_text()
        section = text[text.index("# --- sandbox") : text.index("[Install]")]
        return [line for line in section.splitlines() if line and not line.startswith("#")]

    assert sandbox("engined-dynamo-worker@.service") == sandbox("engined@.service")
    worker = (UNITS / "engined-dynamo-worker@.service").read_text().splitlines()
    assert "BindsTo=engined@%i.service" in worker
    assert "WantedBy=engined@%i.service" in worker
    assert any(
        line.startswith("ExecStart=/usr/local/bin/engined dynamo-worker ") for line in worker
    )


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above is only worth something if a mistake makes it speak."""
    analyze = systemd_analyze()
    (unit,) = installed_units(tmp_path, "engined.service")
    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in verify(analyze, unit, cwd=tmp_path)


def test_template_and_single_unit_differ_only_in_naming() -> None:
    """engined.service is engined@.service for one engine; the two must not drift apart."""

    def settings(name: str) -> list[str]:
        lines = (UNITS / name).read_text().splitlines()
        return [line for line in lines if line and not line.startswith("#")]

    single, template = settings("engined.service"), settings("engined@.service")
    assert len(single) == len(template)
    differ = {(a, b) for a, b in zip(single, template, strict=True) if a != b}
    assert differ == {
        (
            "Description=engined, a GPU-free stand-in for a vLLM engine",
            "Description=engined, a GPU-free stand-in for a vLLM engine (%i)",
        ),
        (
            "ExecStart=/usr/local/bin/engined serve --config /etc/engined/engined.toml",
            "ExecStart=/usr/local/bin/engined serve --config /etc/engined/%i.toml",
        ),
        ("RuntimeDirectory=engined", "RuntimeDirectory=engined/%i"),
        ("User=engined", "User=engined-%i"),
    }


def mdwe_supported() -> bool:
    # PR_GET_MDWE (66) fails with EINVAL on kernels before 6.3.
    return int(ctypes.CDLL(None).prctl(66, 0, 0, 0, 0)) >= 0


def test_daemon_serves_inside_the_units_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1. Start `engined serve` under engined.service's MemoryDenyWriteExecute,
       SystemCallFilter and RestrictAddressFamilies (a violation kills it), FPM on tcp.
    2. A request completes over the ipc control socket; an FPM message arrives over tcp.
    3. SIGTERM: exit 0.
    """
    systemd_analyze()  # expands the syscall groups
    if not mdwe_supported():
        pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3): cannot apply MemoryDenyWriteExecute")
    unit = UNITS / "engined.service"
    monkeypatch.setattr(
        daemon_harness,
        "ENGINED",
        [sys.executable, str(SANDBOX), str(unit), "--", *daemon_harness.ENGINED],
    )
    fpm = f"tcp://127.0.0.1:{free_tcp_port()}"

    async def scenario(control: str) -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with await EngineClient.connect(control) as client:
                generation = await client.generate(list(range(64)), max_tokens=4, timeout=10)
                assert len(generation.token_ids) == 4
            assert len(await read_fpm(ctx, fpm, 1)) == 1
        finally:
            ctx.term()

    with start_daemon(tmp_path, "--fpm-endpoint", fpm, "--block-size", "16") as daemon:
        asyncio.run(scenario(daemon.control))


def test_example_config_sets_every_key_to_its_default() -> None:
    example = UNITS / "engined.example.toml"
    loaded = load_config(config_path=example, env={}, flags={})
    assert loaded == load_config(config_path=None, env={}, flags={})
    data = tomllib.loads(example.read_text())
    keys = {k for k in data if k != "engine"} | {f"engine.{k}" for k in data["engine"]}
    assert keys == {flag.key for flag in FLAGS}
