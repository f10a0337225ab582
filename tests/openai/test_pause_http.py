"""Pause and sleep over HTTP, as `vllm serve` answers them, against real daemons.

A completion or chat request while generation is paused (abort, wait) gets vLLM's
`RetryableRequestError`: a 503 `ServiceUnavailableError`, or, streamed, a 200 whose stream
ends with the error event. With `VLLM_SERVER_DEV_MODE=1` the API server has vLLM's
development routes; without it they are 404. The 400 and 405 bodies in
vllm_0_33_dev_routes.json were recorded from vLLM 0.33's own routers (FastAPI TestClient,
vLLM's exception handlers).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engined.client import EngineClient
from engined.core.pausing import RELEASE_BEFORE_PAUSE, RELEASE_WHILE_ASLEEP
from tests.openai.api_harness import ApiDaemon, start_api
from tests.server.daemon_harness import free_tcp_port
from tests.support import run

PAUSED = "Generation is paused. Please retry after it resumes."
RECORDED: dict[str, list[object]] = json.loads(
    (Path(__file__).parent / "vllm_0_33_dev_routes.json").read_text()
)
PROMPT = list(range(100, 116))
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "hello"}
]


def request(port: int, method: str, path: str) -> tuple[int, str]:
    """(status, body text) of one plain HTTP request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path)
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


def answer(port: int, method: str, path: str) -> tuple[int, object]:
    status, body = request(port, method, path)
    return status, json.loads(body)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    """`engined serve` on an ipc control endpoint (its API server connects as operator), no
    development routes."""
    with start_api(tmp_path_factory.mktemp("pause"), "--speedup-ratio", "0") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def dev_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    """Development routes on, the control socket on tcp: the API server's control
    connection is a client's, so the routes go through the daemon's operator endpoint."""
    tmp = tmp_path_factory.mktemp("dev")
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    env = {"VLLM_SERVER_DEV_MODE": "1", "XDG_RUNTIME_DIR": str(runtime)}
    control = f"tcp://127.0.0.1:{free_tcp_port()}"
    with start_api(tmp, "--speedup-ratio", "0", env=env, control=control) as daemon:
        yield daemon


def _refusals(api: ApiDaemon) -> None:
    """What each kind of generation request gets while paused."""
    with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.body == {
            "message": PAUSED,
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.message == f"Error code: 503 - {PAUSED}"
        # Streamed: the 200, then vLLM's error event (chat renders every GenerationError
        # as InternalServerError with its status).
        for stream, kind in (
            (client.completions.create(model=model, prompt=PROMPT, stream=True), "Service"),
            (client.chat.completions.create(model=model, messages=MESSAGES, stream=True), "Int"),
        ):
            with pytest.raises(openai.APIError) as ended:
                list(stream)
            assert ended.value.message == PAUSED
            assert ended.value.body == {
                "message": PAUSED,
                "type": "ServiceUnavailableError" if kind == "Service" else "InternalServerError",
                "param": None,
                "code": 503,
            }


def _generates(api: ApiDaemon) -> None:
    with openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert done.choices[0].finish_reason == "length"


def test_a_request_while_paused_gets_vllms_503(api: ApiDaemon) -> None:
    async def pause(mode: str) -> None:
        async with await EngineClient.connect(api.daemon.control) as operator:
            await (operator.pause("wait") if mode == "wait" else operator.pause())

    async def resume() -> None:
        async with await EngineClient.connect(api.daemon.control) as operator:
            await operator.resume()

    for mode in ("abort", "wait"):
        run(pause(mode))
        _refusals(api)
        run(resume())
        _generates(api)


def test_the_development_routes_are_404_without_the_variable(api: ApiDaemon) -> None:
    for method, path in (("POST", "/pause"), ("GET", "/is_paused"), ("POST", "/sleep")):
        assert answer(api.port, method, path) == (404, {"detail": "Not Found"})
    for path in (
        "/resume",
        "/wake_up",
        "/reset_prefix_cache",
        "/release_kv_cache_memory",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/abort_requests",
    ):
        assert answer(api.port, "POST", path) == (404, {"detail": "Not Found"})
    assert answer(api.port, "GET", "/is_sleeping") == (404, {"detail": "Not Found"})


def test_pause_and_resume_over_http(dev_api: ApiDaemon) -> None:
    port = dev_api.port
    assert answer(port, "GET", "/is_paused") == (200, {"is_paused": False})
    assert answer(port, "POST", "/pause?mode=wait&clear_cache=false") == (
        200,
        {"status": "paused"},
    )
    assert answer(port, "GET", "/is_paused") == (200, {"is_paused": True})
    # vLLM's EngineCore.is_sleeping: paused counts as sleeping.
    assert answer(port, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    _refusals(dev_api)
    assert answer(port, "POST", "/resume") == (200, {"status": "resumed"})
    assert answer(port, "GET", "/is_paused") == (200, {"is_paused": False})
    _generates(dev_api)
    # `keep` queues instead of refusing.
    assert answer(port, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert answer(port, "POST", "/resume") == (200, {"status": "resumed"})


def test_sleep_and_wake_up_over_http(dev_api: ApiDaemon) -> None:
    port = dev_api.port
    assert answer(port, "POST", "/sleep?level=2") == (200, {"status": "sleeping", "level": 2})
    assert answer(port, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert answer(port, "POST", "/wake_up?tags=weights") == (
        200,
        {"status": "sleeping", "tags": ["weights"]},
    )
    assert answer(port, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert answer(port, "POST", "/wake_up?tags=kv_cache") == (
        200,
        {"status": "awake", "tags": ["kv_cache"]},
    )
    assert answer(port, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert answer(port, "POST", "/sleep") == (200, {"status": "sleeping", "level": 1})
    assert answer(port, "POST", "/wake_up") == (200, {"status": "awake", "tags": None})
    _generates(dev_api)
    # vLLM's sleep-mode operation metrics, on the API server's /metrics.
    status, text = request(port, "GET", "/metrics")
    assert status == 200
    for operation in ("sleep", "wake"):
        assert f'vllm:sleep_mode_operations_in_flight{{operation="{operation}"}} 0.0' in text
        assert (
            f'vllm:sleep_mode_operation_duration_seconds_bucket{{le="+Inf",operation="{operation}"}}'
            in text
        )


def test_reset_prefix_cache_over_http(dev_api: ApiDaemon) -> None:
    port = dev_api.port
    assert answer(port, "POST", "/reset_prefix_cache") == (200, {"success": True})
    assert answer(port, "POST", "/reset_prefix_cache?reset_external=yes") == (
        200,
        {"success": True},
    )
    assert answer(port, "POST", "/reset_prefix_cache?reset_running_requests=true") == (
        200,
        {"success": True},
    )
    _generates(dev_api)


def test_multimodal_and_encoder_cache_resets_are_vllms(dev_api: ApiDaemon) -> None:
    """vLLM's `Response(status_code=200)`; nothing to reset here (no multimodal inputs)."""
    for path in ("/reset_mm_cache", "/reset_encoder_cache"):
        connection = http.client.HTTPConnection("127.0.0.1", dev_api.port, timeout=30)
        try:
            connection.request("POST", path)
            reply = connection.getresponse()
            assert (reply.status, reply.read(), reply.getheader("content-type")) == (200, b"", None)
        finally:
            connection.close()
        assert answer(dev_api.port, "GET", path)[0] == 405
    _generates(dev_api)


def _internal_error(message: str) -> dict[str, object]:
    """vLLM's 500 for an exception of an engine call, as its handler renders it."""
    return {
        "error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}
    }


def test_release_kv_cache_memory_over_http(dev_api: ApiDaemon) -> None:
    port = dev_api.port
    assert answer(port, "POST", "/release_kv_cache_memory") == (
        500,
        _internal_error(f"Call to release_kv_cache_memory method failed: {RELEASE_BEFORE_PAUSE}"),
    )
    assert answer(port, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert answer(port, "POST", "/release_kv_cache_memory") == (
        200,
        {"status": "kv_cache_released"},
    )
    assert answer(port, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert answer(port, "POST", "/release_kv_cache_memory") == (
        500,
        _internal_error(f"Call to release_kv_cache_memory method failed: {RELEASE_WHILE_ASLEEP}"),
    )
    assert answer(port, "POST", "/wake_up?tags=kv_cache") == (
        200,
        {"status": "awake", "tags": ["kv_cache"]},
    )
    assert answer(port, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    _generates(dev_api)


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_refused_queries_and_methods_are_vllms(dev_api: ApiDaemon, case: str) -> None:
    method, path = case.split(" ", 1)
    status, body = request(dev_api.port, method, path)
    assert [status, body] == RECORDED[case]
