"""vLLM 0.33's RL routes for weight versions, and `return_weight_versions`, over HTTP.

With `VLLM_SERVER_DEV_MODE=1`, `POST /update_weight_version` labels the weights (the daemon's
`set_weight_version` on every rank), `GET /weight_info` reads the label, `GET /get_world_size`
counts the GPUs; a choice asked with `return_weight_versions` gets vLLM's spans of its output
tokens by label. `POST /abort_requests`'s answers to every body shape are here too (its
effect on requests: test_abort_requests_http.py). Requests go through the official `openai`
client; the refusals in vllm_0_33_rl_routes.json were recorded from vLLM 0.33's own RL router
(FastAPI TestClient, vLLM's exception handlers) and are compared byte for byte.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.openai.api_harness import ApiDaemon, start_api

RECORDED: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "vllm_0_33_rl_routes.json").read_text()
)
PROMPT = list(range(100, 116))
VERSIONS = {"return_weight_versions": True}


def call(
    port: int, method: str, path: str, body: str | None = None, content_type: str | None = None
) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {} if content_type is None else {"content-type": content_type}
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


def label(port: int, version: str) -> tuple[int, object]:
    status, text = call(
        port,
        "POST",
        "/update_weight_version",
        json.dumps({"new_version": version}),
        "application/json",
    )
    return status, json.loads(text)


def current(port: int) -> object:
    status, text = call(port, "GET", "/weight_info")
    assert status == 200
    return json.loads(text)


def spans(choice: Any) -> object:
    return choice.model_dump().get("weight_versions")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    with start_api(
        tmp_path_factory.mktemp("rl"),
        "--speedup-ratio",
        "1",
        "--data-parallel-size",
        "2",
        env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as daemon:
        yield daemon


@pytest.mark.parametrize(
    "case", RECORDED, ids=lambda c: f"{c['method']} {c['path']} {str(c['body'])[:40]!r}"
)
def test_refusals_are_vllms(api: ApiDaemon, case: dict[str, Any]) -> None:
    answer = call(api.port, case["method"], case["path"], case["body"], case["content_type"])
    assert answer == (case["status"], case["text"])


def test_world_size_counts_the_ranks(api: ApiDaemon) -> None:
    assert call(api.port, "GET", "/get_world_size") == (200, '{"world_size":2}')
    assert call(api.port, "GET", "/get_world_size?include_dp=false") == (200, '{"world_size":1}')


def test_choices_report_the_versions_of_their_tokens(api: ApiDaemon) -> None:
    port = api.port
    with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        assert current(port) == {"weight_version": "default"}
        plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert spans(plain.choices[0]) is None
        first = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, n=2, extra_body=VERSIONS
        )
        assert [spans(c) for c in first.choices] == [
            [{"version": "default", "start": 0, "end": 4}]
        ] * 2
        assert label(port, "step-1") == (200, {"success": True, "new_version": "step-1"})
        assert current(port) == {"weight_version": "step-1"}
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body=VERSIONS,
        )
        assert spans(chat.choices[0]) == [{"version": "step-1", "start": 0, "end": 3}]
        # Over 256 bytes: engined's bound (the control protocol's), a 400.
        status, body = label(port, "x" * 257)
        assert status == 400 and "weight_version" in str(body)
        assert current(port) == {"weight_version": "step-1"}
        assert label(port, "default")[0] == 200


def test_a_stream_across_an_update_has_two_spans(api: ApiDaemon) -> None:
    """pause (keep), label, resume while a completion streams: its last chunk's spans split
    its tokens where the label changed; earlier chunks carry none. Paced at real time, its
    400 tokens take over 2 s, so the pause after its first chunk finds it running."""
    port = api.port
    with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        stream = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=400, stream=True, extra_body=VERSIONS
        )
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                assert call(port, "POST", "/pause?mode=keep")[0] == 200
                assert label(port, "step-2")[0] == 200
                assert call(port, "POST", "/resume")[0] == 200
        assert label(port, "default")[0] == 200
    assert all(spans(c.choices[0]) is None for c in chunks[:-1])
    final = spans(chunks[-1].choices[0])
    assert isinstance(final, list) and len(final) == 2, final
    old, new = final
    assert (old["version"], old["start"], new["version"], new["end"]) == (
        "default",
        0,
        "step-2",
        400,
    )
    assert 1 <= old["end"] == new["start"] < 400
