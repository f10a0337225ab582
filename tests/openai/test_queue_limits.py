"""`--max-num-queued-reqs` and `--max-num-queued-tokens` in a real `engined serve`, through
the official `openai` client: vLLM 0.33's 503s, their exact bodies, what counts and when it
stops counting, the count shared by several API server processes, and
`vllm:admission_rejections_total`.

The daemons are paced (10 ms a pass), so a request with a long answer stays in flight for
minutes unless it is cancelled, and one long prompt prefilled 16 tokens a pass keeps every
prompt behind it without output as long: what is counted is then known exactly while a test
looks. A request leaves the count when its stream is closed, which the test sees as the
daemon's own request gauges falling (the API server cancels after it stops counting).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types import Completion
from prometheus_client.parser import text_string_to_metric_families

from engined.openai.api_errors import engine_overloaded, prefill_backlog_full
from tests.openai.api_harness import ApiDaemon, start_api
from tests.openai.test_api_processes import api_pids
from tests.server.daemon_harness import PACED_FLAGS

PACED = (*PACED_FLAGS, "--block-size", "16", "--fixed-prefill-ms-per-token", "0")
# Five minutes of decoding at a token a pass: in flight until cancelled.
LONG = 30_000
WAIT_S = 30.0

OVERLOADED = json.loads(engine_overloaded().body())
BACKLOG = json.loads(prefill_backlog_full().body())


def scrape(port: int) -> dict[str, float]:
    """The daemon's request gauges and admission rejections, by sample name and label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
            elif sample.name == "vllm:admission_rejections_total":
                found[sample.labels["reason"]] = sample.value
    return found


def in_engine(port: int) -> float:
    now = scrape(port)
    return now["vllm:num_requests_running"] + now["vllm:num_requests_waiting"]


def wait_in_engine(port: int, count: float) -> None:
    """Until the daemon holds `count` requests (bounded; what it waits for is the daemon's
    own state, read as a load balancer reads it)."""
    deadline = time.monotonic() + WAIT_S
    while (held := in_engine(port)) != count:
        assert time.monotonic() < deadline, f"the engine holds {held}, not {count}"
        time.sleep(0.02)


def refused(call: object) -> dict[str, object]:
    """The error body of a call that must be refused with 503."""
    assert callable(call)
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    assert caught.value.status_code == 503
    body: dict[str, object] = caught.value.response.json()["error"]
    return {"error": body}


def stream(client: openai.OpenAI, prompt: list[int], n: int = 1) -> openai.Stream[Completion]:
    """A streamed completion, admitted once its head arrived."""
    return client.completions.create(
        model="engined", prompt=prompt, max_tokens=LONG, n=n, stream=True
    )


@pytest.fixture(scope="module")
def reqs_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    tmp: Path = tmp_path_factory.mktemp("queued-reqs")
    with start_api(tmp, *PACED, "--max-num-queued-reqs", "3") as api:
        yield api


def client_of(api: ApiDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0)


def test_a_request_of_more_samples_than_the_limit_is_refused(reqs_api: ApiDaemon) -> None:
    before = scrape(reqs_api.port)
    with client_of(reqs_api) as client:
        body = refused(
            lambda: client.completions.create(model="engined", prompt="hi", max_tokens=2, n=4)
        )
        assert body == OVERLOADED
        chat = refused(
            lambda: client.chat.completions.create(
                model="engined",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                n=4,
                stream=True,
            )
        )
        assert chat == OVERLOADED
        # Within the limit, nothing is held back.
        reply = client.completions.create(model="engined", prompt="hi", max_tokens=2, n=3)
        assert [c.finish_reason for c in reply.choices] == ["length"] * 3
    after = scrape(reqs_api.port)
    assert after["max_num_queued_reqs"] - before["max_num_queued_reqs"] == 2
    assert after["max_num_queued_tokens"] == before["max_num_queued_tokens"] == 0


def test_requests_in_flight_count_until_they_end(reqs_api: ApiDaemon) -> None:
    port = reqs_api.port
    before = scrape(port)["max_num_queued_reqs"]
    with client_of(reqs_api) as client:
        two = stream(client, list(range(100, 120)), n=2)
        one = stream(client, list(range(200, 220)))
        wait_in_engine(port, 3)
        assert refused(lambda: stream(client, [1, 2, 3])) == OVERLOADED
        assert (
            refused(
                lambda: client.chat.completions.create(
                    model="engined", messages=[{"role": "user", "content": "x"}], max_tokens=1
                )
            )
            == OVERLOADED
        )
        one.close()
        wait_in_engine(port, 2)
        three = stream(client, list(range(300, 320)))
        assert refused(lambda: stream(client, [1, 2, 3])) == OVERLOADED
        two.close()
        three.close()
        wait_in_engine(port, 0)
        # Everything left the count: the whole limit is free again.
        again = stream(client, list(range(400, 420)), n=3)
        again.close()
        wait_in_engine(port, 0)
    assert scrape(port)["max_num_queued_reqs"] - before == 3


def test_a_client_that_leaves_before_its_answer_leaves_the_count(reqs_api: ApiDaemon) -> None:
    """A streamed request whose client is gone before the response starts: its engine
    request is cancelled and no longer counts (a body that never started still closes)."""
    port = reqs_api.port
    body = json.dumps(
        {"model": "engined", "prompt": [7, 8, 9], "max_tokens": LONG, "n": 3, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head + body)
    with client_of(reqs_api) as client:
        # Whenever each of those was dropped, none holds a place for long: three samples
        # are admitted once they all are (each try refused meanwhile is a 503).
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                held = stream(client, list(range(500, 520)), n=3)
                break
            except openai.APIStatusError as error:
                assert error.status_code == 503 and time.monotonic() < deadline
                time.sleep(0.02)
        wait_in_engine(port, 3)
        held.close()
    wait_in_engine(port, 0)


def test_prompt_tokens_count_until_their_first_output(tmp_path: Path) -> None:
    """`--max-num-queued-tokens 30`, prompts prefilled 16 tokens a pass (26 ms): a 40-token
    prompt no longer counts once it has output (though it runs on); an 8,000-token one (500
    passes, thirteen seconds, without output) keeps the backlog full; and a
    completion whose prompts reach the limit one by one is refused whole."""
    flags = ["--max-num-batched-tokens", "16", "--max-model-len", "70000"]
    flags += ["--fixed-prefill-ms-per-token", "1"]
    with (
        start_api(tmp_path, *PACED, *flags, "--max-num-queued-tokens", "30") as api,
        client_of(api) as client,
    ):
        port = api.port
        decoding = stream(client, list(range(1000, 1040)))
        next(iter(decoding))  # its first output: its prompt no longer waits
        short = stream(client, list(range(10, 20)))
        long_prompt = stream(client, [5] * 8000)
        assert refused(lambda: stream(client, [1])) == BACKLOG
        for response in (decoding, short, long_prompt):
            response.close()
        wait_in_engine(port, 0)
        prompts = [[1] * 20, [2] * 20, [3]]  # 0, then 20, then 40 >= 30: the third
        assert (
            refused(
                lambda: client.completions.create(
                    model="engined", prompt=prompts, max_tokens=1, stream=True
                )
            )
            == BACKLOG
        )
        # None of it stayed counted or reached the engine.
        assert in_engine(port) == 0
        reply = client.completions.create(model="engined", prompt=prompts[:2], max_tokens=1)
        assert [c.finish_reason for c in reply.choices] == ["length"] * 2
        rejections = scrape(port)
        assert (rejections["max_num_queued_reqs"], rejections["max_num_queued_tokens"]) == (0, 2)


def test_api_server_processes_share_the_request_count(tmp_path: Path) -> None:
    """Two API server processes and a limit of 2: two requests held by one process, then the
    other (the first stopped, so that it alone accepts) refuses a third, as vLLM's shared
    counters do; each process's refusals are in every scrape."""
    with (
        start_api(tmp_path, *PACED, "--max-num-queued-reqs", "2", servers=2) as api,
        client_of(api) as holder,
    ):
        first, second = api_pids(api.daemon)
        os.kill(second, signal.SIGSTOP)
        try:
            held = [stream(holder, list(range(100, 110))), stream(holder, [1, 2])]
            refusals = [refused(lambda: stream(holder, [3]))]
        finally:
            os.kill(second, signal.SIGCONT)
        os.kill(first, signal.SIGSTOP)
        try:
            # A client of its own: the holder's idle connection leads to the stopped one.
            with client_of(api) as client:
                refusals.append(refused(lambda: stream(client, [4])))
            rejections = scrape(api.port)["max_num_queued_reqs"]
        finally:
            os.kill(first, signal.SIGCONT)
        assert refusals == [OVERLOADED, OVERLOADED]
        assert rejections == 2
        for response in held:
            response.close()
        wait_in_engine(api.port, 0)
