"""vLLM's `--enable-server-load-tracking` and `GET /load` in a real `engined serve`: the
generation requests an API server process is serving, streams until they end, none left
behind by a refusal; without the flag, 0. Paced daemons keep a long answer in flight until
its stream is closed (tests/openai/test_queue_limits.py)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from engined.openai.api_errors import method_not_allowed
from tests.openai.api_harness import start_api
from tests.openai.test_queue_limits import PACED, WAIT_S, client_of, stream


def server_load(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/load", timeout=10) as reply:
        assert reply.headers["content-type"] == "application/json"
        body = json.loads(reply.read())
    assert list(body) == ["server_load"]
    load: int = body["server_load"]
    return load


def wait_load(port: int, load: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while (now := server_load(port)) != load:
        assert time.monotonic() < deadline, f"/load is {now}, not {load}"
        time.sleep(0.02)


def test_load_counts_the_requests_being_served(tmp_path: Path) -> None:
    with (
        start_api(tmp_path, *PACED, "--enable-server-load-tracking") as api,
        client_of(api) as client,
    ):
        port = api.port
        assert server_load(port) == 0
        streams = [stream(client, list(range(100, 110))), stream(client, [1, 2, 3], n=2)]
        # One per request being served, whatever its samples.
        assert server_load(port) == 2
        chat = client.chat.completions.create(
            model="engined", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="engined", prompt="x", max_tokens=-1)
        # Neither the finished request nor the refused ones stay counted.
        assert server_load(port) == 2
        streams[0].close()
        wait_load(port, 1)
        streams[1].close()
        wait_load(port, 0)


def test_without_the_flag_load_is_zero(tmp_path: Path) -> None:
    with start_api(tmp_path, *PACED) as api, client_of(api) as client:
        held = stream(client, [4, 5, 6])
        assert server_load(api.port) == 0
        held.close()
        # Only GET, as vLLM's route; a body sent with it is read and ignored.
        connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
        try:
            connection.request("POST", "/load", body=b"{" * 1000)
            refused = connection.getresponse()
            assert (refused.status, refused.read()) == (405, method_not_allowed().body())
            assert refused.getheader("allow") == "GET"
            connection.request("GET", "/load", body=b"x" * 100_000)
            reply = connection.getresponse()
            assert (reply.status, json.loads(reply.read())) == (200, {"server_load": 0})
        finally:
            connection.close()
