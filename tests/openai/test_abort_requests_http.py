"""vLLM 0.33's `POST /abort_requests` (its RL router, `VLLM_SERVER_DEV_MODE=1`) against a real
`engined serve`, through the official `openai` client.

The rank is paced in real time, so a 400-token request is still running when the test has read
its first chunk: the abort finds it, its stream ends with vLLM's `abort`, and the requests it
does not name run to their end. The counts are vLLM's: the ids given, or, for an abort of
everything, one per unfinished sample and one per prompt with n > 1 (vLLM's parent requests).
The route's answers to malformed bodies are vLLM's own, recorded (test_rl_http.py).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engined.client import EngineClient
from tests.openai.api_harness import ApiDaemon, start_api
from tests.support import run

LONG = 400
ALL_DONE = '{"status":"aborted","aborted":0}'


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    with start_api(
        tmp_path_factory.mktemp("abort"),
        "--speedup-ratio",
        "1",
        env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as daemon:
        yield daemon


def abort(port: int, body: object) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"content-type": "application/json"}
        connection.request("POST", "/abort_requests", body=json.dumps(body), headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


def finish_reasons(chunks: list[Any]) -> dict[int, str]:
    return {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}


def completion_tokens(chunks: list[Any]) -> int:
    (usage,) = [chunk.usage for chunk in chunks if chunk.usage is not None]
    return int(usage.completion_tokens)


def stream(client: openai.OpenAI, model: str, request_id: str, **more: Any) -> Any:
    return client.completions.create(
        model=model,
        prompt=list(range(100, 116)),
        max_tokens=LONG,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
        **more,
    )


def test_an_abort_by_id_ends_only_that_request(api: ApiDaemon) -> None:
    with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        doomed = stream(client, model, "doomed")
        kept = stream(client, model, "kept")
        doomed_chunks, kept_chunks = [next(doomed)], [next(kept)]
        assert doomed_chunks[0].id == "cmpl-doomed"
        # vLLM's external id of a completion's prompt: `cmpl-{X-Request-Id}-{prompt index}`.
        assert abort(api.port, {"request_ids": ["cmpl-doomed-0", "cmpl-unknown-0"]}) == (
            200,
            '{"status":"aborted","aborted":2}',
        )
        doomed_chunks += list(doomed)
        kept_chunks += list(kept)
    assert finish_reasons(doomed_chunks) == {0: "abort"}
    assert completion_tokens(doomed_chunks) < LONG
    assert finish_reasons(kept_chunks) == {0: "length"}
    assert completion_tokens(kept_chunks) == LONG
    assert abort(api.port, {}) == (200, ALL_DONE)


def test_a_request_that_is_not_streamed_answers_with_its_abort(api: ApiDaemon) -> None:
    """The response comes once the abort ends it: `finish_reason` "abort", the tokens so far.
    Nothing marks the moment the API server has the request, so the abort is repeated until
    the rank runs nothing (an abort that came too early found nothing and counted its id)."""

    async def scenario() -> Any:
        async with await EngineClient.connect(api.daemon.control) as daemon:
            with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
                model = client.models.list().data[0].id
                call = asyncio.create_task(
                    asyncio.to_thread(
                        client.completions.create,
                        model=model,
                        prompt=list(range(100, 116)),
                        max_tokens=LONG,
                        extra_headers={"X-Request-Id": "quiet"},
                    )
                )
                for _ in range(2000):
                    if (await daemon.stats()).ranks[0].running:
                        break
                    await asyncio.sleep(0.005)
                # NOTE: bounded polls of the daemon's own state, as tests.support.until does.
                for _ in range(200):
                    answer = await asyncio.to_thread(
                        abort, api.port, {"request_ids": ["cmpl-quiet-0"]}
                    )
                    assert answer == (200, '{"status":"aborted","aborted":1}')
                    if not (await daemon.stats()).ranks[0].running:
                        break
                    await asyncio.sleep(0.01)
                return await call

    reply = run(scenario())
    assert reply.id == "cmpl-quiet"
    assert reply.choices[0].finish_reason == "abort"
    assert reply.usage is not None and reply.usage.completion_tokens < LONG


def test_an_abort_by_id_ends_every_sample_of_the_prompt(api: ApiDaemon) -> None:
    with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        fan = stream(client, model, "fan", n=3)
        chunks = [next(fan)]
        assert abort(api.port, {"request_ids": "cmpl-fan-0"}) == (
            # vLLM counts a string's characters.
            200,
            '{"status":"aborted","aborted":10}',
        )
        chunks += list(fan)
    assert finish_reasons(chunks) == {0: "abort", 1: "abort", 2: "abort"}
    assert abort(api.port, {}) == (200, ALL_DONE)


def test_an_abort_of_everything_counts_samples_and_parents(api: ApiDaemon) -> None:
    with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=LONG,
            n=2,
            stream=True,
        )
        prompts = client.completions.create(
            model=model,
            prompt=[list(range(200, 216)), list(range(300, 316))],
            max_tokens=LONG,
            stream=True,
        )
        chat_chunks, prompt_chunks = [next(chat)], [next(prompts)]
        # The chat's two samples and their parent, the completion's two prompts.
        assert abort(api.port, {"request_ids": []}) == (200, '{"status":"aborted","aborted":5}')
        # vLLM drops an aborted request's state at once: before its stream has ended, a
        # second abort finds nothing.
        assert abort(api.port, {}) == (200, ALL_DONE)
        chat_chunks += list(chat)
        prompt_chunks += list(prompts)
    assert finish_reasons(chat_chunks) == {0: "abort", 1: "abort"}
    assert finish_reasons(prompt_chunks) == {0: "abort", 1: "abort"}
    assert abort(api.port, {}) == (200, ALL_DONE)


def test_a_slow_abort_body_leaves_others_served(api: ApiDaemon) -> None:
    """Half a body, then a whole completion served, then the rest: the answer comes once the
    body is complete, and nothing else waited for it."""
    body = json.dumps({"request_ids": ["cmpl-none-0"]}).encode()
    head = (
        b"POST /abort_requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(head + body[:10])
        with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
            model = client.models.list().data[0].id
            served = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=5)
            assert served.usage is not None and served.usage.completion_tokens == 5
        sock.sendall(body[10:])
        answer = b""
        while not answer.endswith(b'"aborted":1}'):
            data = sock.recv(4096)
            assert data, answer
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 ")
