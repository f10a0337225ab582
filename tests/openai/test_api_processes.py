"""The API server processes of `engined serve`: shared port, start-up failure, death, drain."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import openai

from tests.openai.api_harness import start_api
from tests.server.daemon_harness import DaemonProcess
from tests.support import free_tcp_port, run

UNPACED = ("--speedup-ratio", "0", "--block-size", "16", "--num-gpu-blocks", "1024")


def api_pids(daemon: DaemonProcess) -> list[int]:
    """The daemon's API server children (Linux: /proc's children list, by command line)."""
    pid = daemon.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(child)
        for child in children
        if b"engined.openai" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


async def completions(base_url: str, count: int) -> list[tuple[str | None, int]]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        replies = await asyncio.gather(
            *(
                client.completions.create(
                    model="engined", prompt=[100 + i, 200, 300], max_tokens=4, seed=i
                )
                for i in range(count)
            )
        )
    return [
        (reply.choices[0].finish_reason, reply.usage.completion_tokens if reply.usage else -1)
        for reply in replies
    ]


def test_two_api_servers_share_one_port(tmp_path: Path) -> None:
    with start_api(tmp_path, *UNPACED, servers=2) as api:
        pids = api_pids(api.daemon)
        assert len(pids) == 2 and len(set(pids)) == 2
        assert run(completions(api.base_url, 32)) == [("length", 4)] * 32


def test_a_port_in_use_is_a_startup_failure(tmp_path: Path) -> None:
    port = free_tcp_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        daemon = DaemonProcess(tmp_path, ["--port", str(port), "--host", "127.0.0.1"], None)
        try:
            assert daemon.proc.wait(60) == 3
        finally:
            daemon.stop()
    assert "Address already in use" in daemon.log()


def test_an_api_server_that_dies_ends_the_daemon(tmp_path: Path) -> None:
    with start_api(tmp_path, *UNPACED, expect_exit=None) as api:
        (pid,) = api_pids(api.daemon)
        os.kill(pid, signal.SIGKILL)
        assert api.daemon.proc.wait(60) == 1
    assert f"api server process {pid} exited with -9" in api.log()


def test_sigterm_lets_a_stream_finish(tmp_path: Path) -> None:
    """A stream in flight at SIGTERM gets every token and `[DONE]`; the daemon exits 0."""
    paced = ("--speedup-ratio", "1", "--perf-model", "fixed", "--fixed-decode-ms-per-pass", "5")

    async def scenario(base_url: str, daemon: DaemonProcess) -> list[str]:
        texts: list[str] = []
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
            stream = await client.completions.create(
                model="engined", prompt=[5, 6, 7], max_tokens=60, stream=True
            )
            async for chunk in stream:
                if not texts:
                    daemon.proc.send_signal(signal.SIGTERM)
                texts.extend(choice.finish_reason or "" for choice in chunk.choices)
        return texts

    with start_api(tmp_path, *paced) as api:
        reasons = run(scenario(api.base_url, api.daemon))
        assert api.daemon.proc.wait(60) == 0
    assert [reason for reason in reasons if reason] == ["length"]


def test_several_served_model_names(tmp_path: Path) -> None:
    """vLLM's `--served-model-name main other`: both are listed and may be asked for; answers
    carry the first; an unknown name's 404 lists them."""

    async def scenario(base_url: str) -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as c:
            listed = [model.id async for model in c.models.list()]
            assert listed == ["main", "other"]
            reply = await c.completions.create(model="other", prompt=[1, 2], max_tokens=2)
            assert reply.model == "main"
            try:
                await c.completions.create(model="third", prompt=[1, 2], max_tokens=2)
            except openai.NotFoundError as error:
                assert error.body == {
                    "message": "The model `third` does not exist. Valid aliases: main, other.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            else:
                raise AssertionError("an unknown model was served")

    with start_api(tmp_path, *UNPACED, "--served-model-name", "main", "other") as api:
        run(scenario(api.base_url))
