"""LoRA adapters in `engined serve` as vLLM 0.33 serves them (engined/openai/served_models.py),
through the official `openai` client and plain HTTP against real daemons.

One daemon for the static adapters (`--lora-modules`, two API server processes, which number
the adapters alike); the daemon's KV events show which adapter each request ran with. The
runtime routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING) have a daemon of their own, and the
scenarios whose adapter numbers are asserted one each. Expected bodies are vLLM's own,
recorded from its OpenAIServingModels, LoRA router and exception handlers in a FastAPI app
with an engine stand-in (no GPU); the few that are engined's own say so.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.openai.api_harness import ApiDaemon, start_api
from tests.openai.http_support import connect, exchange, get, read_response
from tests.server.daemon_harness import DaemonProcess, published_stores
from tests.support import run

BLOCK = 16
FLAGS = ("--speedup-ratio", "0", "--block-size", str(BLOCK), "--enable-prompt-tokens-details")
LORA = ("--enable-lora", "--max-loras", "2")
MODULES = (
    "sql=/adapters/sql",
    '{"name": "chat", "path": "/adapters/chat", "base_model_name": "alias"}',
    '{"name": "other", "path": "/adapters/other", "base_model_name": "elsewhere"}',
)
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
# The embedded model's context (its max_position_embeddings).
MAX_MODEL_LEN = 32768
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
NOT_FOUND = b'{"detail":"Not Found"}'


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    tmp = tmp_path_factory.mktemp("lora")
    names = ("--served-model-name", "base", "alias")
    with start_api(tmp, *FLAGS, *LORA, *names, "--lora-modules", *MODULES, servers=2) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(api: ApiDaemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=api.base_url, api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    tmp = tmp_path_factory.mktemp("runtime")
    with start_api(tmp, *FLAGS, *LORA, "--lora-modules", "s1=/adapters/s1", env=RUNTIME) as d:
        yield d


def ids(first: int, count: int = 2 * BLOCK) -> list[int]:
    """A token-id prompt no other test uses: two whole blocks by default."""
    return list(range(first, first + count))


def call(
    api: ApiDaemon, path: str, body: object = None, *, method: str = "POST", raw: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body bytes) of one request with a JSON body (or `raw` bytes)."""
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
    try:
        payload = json.dumps(body).encode() if body is not None else raw
        headers = {"Content-Type": "application/json"} if method == "POST" else {}
        connection.request(method, path, payload if method == "POST" else None, headers)
        answer = connection.getresponse()
        headers = {name.lower(): value for name, value in answer.getheaders()}
        return answer.status, headers, answer.read()
    finally:
        connection.close()


def error(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """vLLM's error body, compact as its JSONResponse writes it."""
    info = {"message": message, "type": kind, "param": param, "code": status}
    return json.dumps({"error": info}, separators=(",", ":")).encode()


def completion(api: ApiDaemon, model: str, prompt: list[int], max_tokens: int = 1) -> Any:
    status, _, body = call(
        api, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    )
    return status, json.loads(body)


def stored(daemon: DaemonProcess, prompts: list[list[int]]) -> list[tuple[Any, ...]]:
    """The daemon's BlockStored events whose blocks begin one of `prompts`, in order:
    (prompt index, lora_id, lora_name, extra_keys)."""

    firsts = [prompt[:BLOCK] for prompt in prompts]
    return [
        (firsts.index(e.token_ids[:BLOCK]), e.lora_id, e.lora_name, e.extra_keys)
        for e in run(published_stores(daemon))
        if e.token_ids[:BLOCK] in firsts
    ]


# --- static adapters (--lora-modules) ---------------------------------------------------------


def test_models_lists_the_adapters_as_vllm(client: openai.OpenAI) -> None:
    """A card per served name, then one per adapter: its path as `root`, the served name it
    was loaded for as `parent` (the first one for a base_model_name not served), no
    `max_model_len`, vLLM's one permission."""
    cards = client.models.list().data
    assert [(c.id, c.object, c.owned_by) for c in cards] == [
        (name, "model", "vllm") for name in ("base", "alias", "sql", "chat", "other")
    ]
    assert [
        {key: (c.model_extra or {})[key] for key in ("root", "parent", "max_model_len")}
        for c in cards
    ] == [
        {"root": "builtin", "parent": None, "max_model_len": MAX_MODEL_LEN},
        {"root": "builtin", "parent": None, "max_model_len": MAX_MODEL_LEN},
        {"root": "/adapters/sql", "parent": "base", "max_model_len": None},
        {"root": "/adapters/chat", "parent": "alias", "max_model_len": None},
        {"root": "/adapters/other", "parent": "base", "max_model_len": None},
    ]
    for card in cards:
        (permission,) = (card.model_extra or {})["permission"]
        assert permission.pop("id").startswith("modelperm-")
        assert permission.pop("created") == card.created
        assert permission == {
            "object": "model_permission",
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }


def test_requests_for_an_adapter_carry_its_name(client: openai.OpenAI) -> None:
    """vLLM answers with the adapter's name (`models.model_name(lora_request)`), and with the
    first served name for any base name."""
    done = client.completions.create(model="sql", prompt=ids(1000), max_tokens=4)
    assert (done.model, done.choices[0].finish_reason) == ("sql", "length")
    assert done.usage is not None and done.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "ask the chat adapter"}],
        max_completion_tokens=3,
    )
    assert (chat.model, chat.choices[0].finish_reason) == ("chat", "length")
    stream = client.completions.create(model="other", prompt=ids(1100), max_tokens=3, stream=True)
    assert {chunk.model for chunk in stream} == {"other"}
    chunks = client.chat.completions.create(
        model="sql",
        messages=[{"role": "user", "content": "stream the sql adapter"}],
        max_completion_tokens=2,
        stream=True,
    )
    assert {chunk.model for chunk in chunks} == {"sql"}
    assert client.completions.create(model="alias", prompt=ids(1200), max_tokens=1).model == "base"


def test_kv_events_carry_the_adapter_a_request_ran_with(
    api: ApiDaemon, client: openai.OpenAI
) -> None:
    """Each API server process numbers the static adapters from 1 in their order, as vLLM's:
    the daemon publishes that `lora_id`, the name, and the name in every block's extra keys;
    the base model's blocks carry none."""
    prompts = [ids(2000), ids(2100), ids(2200), ids(2300)]
    for model, prompt in zip(("sql", "chat", "base", "other"), prompts, strict=True):
        assert client.completions.create(model=model, prompt=prompt, max_tokens=1).model == model
    assert stored(api.daemon, prompts) == [
        (0, 1, "sql", [("sql",), ("sql",)]),
        (1, 2, "chat", [("chat",), ("chat",)]),
        (2, None, None, [None, None]),
        (3, 3, "other", [("other",), ("other",)]),
    ]


def test_an_adapter_shares_cached_blocks_only_with_itself(api: ApiDaemon) -> None:
    """Its blocks hash apart from the base model's and other adapters' (vLLM's extra key):
    a repeat finds the prompt's whole blocks only under the same model."""
    prompt = ids(3000, 40)
    cached = []
    for model in ("sql", "sql", "base", "chat", "base", "chat"):
        status, body = completion(api, model, prompt)
        assert status == 200, body
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 32, 0, 0, 32, 32]


def test_an_unknown_model_is_vllms_404(api: ApiDaemon, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="ghost", prompt=[1, 2], max_tokens=1)
    assert info.value.body == {
        "message": "The model `ghost` does not exist. Valid aliases: base, alias.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    # /tokenize takes an adapter's name as vLLM's does (same tokenizer), and refuses the rest.
    assert call(api, "/tokenize", {"model": "sql", "prompt": "a b"})[0] == 200
    assert call(api, "/tokenize", {"model": "ghost", "prompt": "a b"})[2] == error(
        404,
        "The model `ghost` does not exist. Valid aliases: base, alias.",
        "NotFoundError",
        "model",
    )


def test_runtime_routes_are_absent_without_the_variable(api: ApiDaemon) -> None:
    """vLLM attaches them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING: FastAPI's 404."""
    body = {"lora_name": "late", "lora_path": "/adapters/late"}
    for path in (LOAD, UNLOAD):
        assert call(api, path, body)[::2] == (404, NOT_FOUND)
        assert call(api, path, method="GET")[::2] == (404, NOT_FOUND)


# --- runtime loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) ---------------------------------------


def test_load_use_reload_and_unload_number_adapters_as_vllm(tmp_path: Path) -> None:
    """The counter goes on from the static adapters; a reload in place keeps the number and
    takes the new path; a request for an unknown model takes a number (vLLM's resolve_lora);
    an unloaded adapter's number is never reused. Success is plain text, no content type."""
    with start_api(tmp_path, *FLAGS, *LORA, "--lora-modules", "s1=/adapters/s1", env=RUNTIME) as d:
        body = {"lora_name": "r1", "lora_path": "/adapters/r1"}
        status, headers, text = call(d, LOAD, body)
        assert (status, text) == (200, b"Success: LoRA adapter 'r1' added successfully.")
        assert "content-type" not in headers
        assert call(d, LOAD, body)[::2] == (
            400,
            error(
                400,
                "The lora adapter 'r1' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            ),
        )
        prompts = [ids(100 * k) for k in range(1, 7)]
        assert completion(d, "r1", prompts[0])[1]["model"] == "r1"
        assert completion(d, "ghost", prompts[1])[0] == 404
        assert call(d, LOAD, {"lora_name": "r2", "lora_path": "/adapters/r2"})[0] == 200
        assert completion(d, "r2", prompts[1])[0] == 200
        moved = {"lora_name": "r1", "lora_path": "/adapters/r1b", "load_inplace": True}
        assert call(d, LOAD, moved)[::2] == (200, b"Success: LoRA adapter 'r1' added successfully.")
        assert completion(d, "r1", prompts[2])[0] == 200
        listed = json.loads(call(d, "/v1/models", method="GET")[2])["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in listed] == [
            ("engined", "builtin", None),
            ("s1", "/adapters/s1", "engined"),
            ("r1", "/adapters/r1b", "engined"),
            ("r2", "/adapters/r2", "engined"),
        ]
        status, headers, text = call(d, UNLOAD, {"lora_name": "r1"})
        assert (status, text) == (200, b"Success: LoRA adapter 'r1' removed successfully.")
        assert "content-type" not in headers
        assert call(d, UNLOAD, {"lora_name": "r1"})[::2] == (
            404,
            error(404, "The lora adapter 'r1' cannot be found.", "NotFoundError"),
        )
        assert completion(d, "r1", prompts[3])[0] == 404
        assert call(d, LOAD, body)[0] == 200
        assert completion(d, "r1", prompts[4])[0] == 200
        assert completion(d, "s1", prompts[5])[0] == 200
        events = stored(d.daemon, prompts)
    assert [event[:3] for event in events] == [
        (0, 2, "r1"),
        (1, 4, "r2"),
        (2, 2, "r1"),
        (4, 6, "r1"),
        (5, 1, "s1"),
    ]


LOAD_REFUSALS = [
    (
        {"lora_name": "engined", "lora_path": "/x"},
        error(
            400,
            "The lora adapter 'engined' conflicts with a served base model.",
            "InvalidUserInput",
        ),
    ),
    (
        {"lora_name": "s1", "lora_path": "/adapters/s1"},
        error(
            400,
            "The lora adapter 's1' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
            "InvalidUserInput",
        ),
    ),
    (
        {"lora_name": "", "lora_path": "/x"},
        error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"),
    ),
    (
        {"lora_name": "x", "lora_path": ""},
        error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"),
    ),
    (
        {"lora_name": "x"},
        error(
            400,
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', 'msg': 'Field "
            "required', 'input': '<dict of 1 items>'}",
            "Bad Request",
            "body.lora_path",
        ),
    ),
    (
        {},
        error(
            400,
            "2 validation errors:\n  {'type': 'missing', 'loc': 'body.lora_name', 'msg': 'Field "
            "required', 'input': '<dict of 0 items>'}\n  {'type': 'missing', 'loc': "
            "'body.lora_path', 'msg': 'Field required', 'input': '<dict of 0 items>'}",
            "Bad Request",
            "body.lora_name",
        ),
    ),
    (
        {"lora_name": 1, "lora_path": None},
        error(
            400,
            "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.lora_name', 'msg': "
            "'Input should be a valid string', 'input': '1'}\n  {'type': 'string_type', 'loc': "
            "'body.lora_path', 'msg': 'Input should be a valid string', 'input': 'None'}",
            "Bad Request",
            "body.lora_name",
        ),
    ),
    (
        {"lora_name": "x", "lora_path": "/p", "load_inplace": "maybe"},
        error(
            400,
            "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.load_inplace', 'msg': "
            "'Input should be a valid boolean, unable to interpret input', 'input': 'maybe'}",
            "Bad Request",
            "body.load_inplace",
        ),
    ),
    (
        [1],
        error(
            400,
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': "
            "'Input should be a valid dictionary or object to extract fields from', 'input': "
            "'<list of 1 items>'}",
            "Bad Request",
            "body",
        ),
    ),
    (
        "s",
        error(
            400,
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': "
            "'Input should be a valid dictionary or object to extract fields from', 'input': 's'}",
            "Bad Request",
            "body",
        ),
    ),
    # engined's own: the control protocol carries a name of at most 256 bytes.
    (
        {"lora_name": "é" * 129, "lora_path": "/x"},
        error(
            400,
            "'lora_name' is 258 bytes of UTF-8: engined serves adapters whose lora_name is at "
            "most 256 bytes.",
            "InvalidUserInput",
        ),
    ),
]
UNLOAD_REFUSALS = [
    (
        {"lora_name": ""},
        error(
            400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
        ),
    ),
    (
        {"lora_name": "zzz", "lora_int_id": 5},
        error(404, "The lora adapter 'zzz' cannot be found.", "NotFoundError"),
    ),
    (
        {},
        error(
            400,
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_name', 'msg': 'Field "
            "required', 'input': '<dict of 0 items>'}",
            "Bad Request",
            "body.lora_name",
        ),
    ),
    (
        {"lora_name": "a", "lora_int_id": "x"},
        error(
            400,
            "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.lora_int_id', 'msg': "
            "'Input should be a valid integer, unable to parse string as an integer', 'input': "
            "'x'}",
            "Bad Request",
            "body.lora_int_id",
        ),
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [(LOAD, body, expected) for body, expected in LOAD_REFUSALS]
    + [(UNLOAD, body, expected) for body, expected in UNLOAD_REFUSALS],
)
def test_bodies_vllm_refuses(runtime: ApiDaemon, path: str, body: object, expected: bytes) -> None:
    status, headers, answer = call(runtime, path, body)
    assert (status, answer) == (json.loads(expected)["error"]["code"], expected)
    assert headers["content-type"] == "application/json"


def test_malformed_json_an_empty_body_and_other_media_types(runtime: ApiDaemon) -> None:
    async def scenario() -> list[tuple[int, bytes]]:
        answers = []
        for body, ctype in (
            (b'{"lora_name": "x",', "application/json"),
            (b"", "application/json"),
            (b'{"lora_name":"q","lora_path":"/q"}', "text/plain"),
        ):
            for path in (LOAD, UNLOAD):
                head = get(
                    path,
                    f"Content-Length: {len(body)}",
                    f"Content-Type: {ctype}",
                    "Connection: close",
                    method="POST",
                )
                answer, _ = await exchange(runtime.port, head + body)
                answers.append((answer.status, answer.body))
        return answers

    invalid = error(
        400,
        "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.18', 'msg': 'JSON decode "
        "error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name "
        "enclosed in double quotes'}}",
        "Bad Request",
        "body.18",
    )
    empty = error(
        400,
        "1 validation error:\n  {'type': 'missing', 'loc': 'body', 'msg': 'Field required', "
        "'input': 'None'}",
        "Bad Request",
        "body",
    )
    media = error(
        400,
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
        "Bad Request",
    )
    assert run(scenario()) == [(400, invalid)] * 2 + [(400, empty)] * 2 + [(400, media)] * 2
    status, headers, body = call(runtime, LOAD, method="GET")
    assert (status, headers["allow"], body) == (405, "POST", b'{"detail":"Method Not Allowed"}')


def test_a_huge_body(runtime: ApiDaemon) -> None:
    """Past the HTTP layer's bound, 413 before the body is read (as on every route); within
    it, a path the control protocol cannot carry is engined's 400."""

    async def declared() -> tuple[int, bytes, bytes]:
        head = get(
            LOAD, "Content-Length: 33554433", "Content-Type: application/json", method="POST"
        )
        answer, rest = await exchange(runtime.port, head)
        return answer.status, answer.body, rest

    assert run(declared()) == (
        413,
        error(
            413,
            "Request body too large (limit 33554432 bytes)",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE.phrase,
        ),
        b"",
    )
    body = {"lora_name": "huge", "lora_path": "/" + "p" * (1 << 20)}
    assert call(runtime, LOAD, body)[::2] == (
        400,
        error(
            400,
            "'lora_path' is 1048577 bytes of UTF-8: engined serves adapters whose lora_path is "
            "at most 4096 bytes.",
            "InvalidUserInput",
        ),
    )
    assert call(runtime, UNLOAD, {"lora_name": "huge"})[0] == 404


def test_a_slow_client_loads_only_once_its_body_is_whole(runtime: ApiDaemon) -> None:
    """Half a body is nothing yet: other clients are served meanwhile and do not see the
    adapter; the rest of the body loads it."""
    body = json.dumps({"lora_name": "slow", "lora_path": "/adapters/slow"}).encode()
    half = len(body) // 2

    async def scenario() -> tuple[int, bytes]:
        reader, writer = await connect(runtime.port)
        length = f"Content-Length: {len(body)}"
        head = get(LOAD, length, "Content-Type: application/json", method="POST")
        writer.write(head + body[:half])
        await writer.drain()
        listed = await exchange(runtime.port, get("/v1/models", "Connection: close"))
        assert b'"slow"' not in listed[0].body
        writer.write(body[half:])
        answer = await read_response(reader)
        writer.close()
        return answer.status, answer.body

    assert run(scenario()) == (200, b"Success: LoRA adapter 'slow' added successfully.")
    assert completion(runtime, "slow", ids(4000))[1]["model"] == "slow"
    assert call(runtime, UNLOAD, {"lora_name": "slow"})[0] == 200


def test_loading_without_enable_lora_is_vllms_500(tmp_path: Path) -> None:
    """vLLM's engine refuses `add_lora` without --enable-lora; nothing is added."""
    with start_api(tmp_path, *FLAGS, env=RUNTIME) as d:
        assert call(d, LOAD, {"lora_name": "x", "lora_path": "/adapters/x"})[::2] == (
            500,
            error(
                500,
                "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to "
                "enable LoRA.",
                "InternalServerError",
            ),
        )
        assert call(d, UNLOAD, {"lora_name": "x"})[0] == 404
        assert [c["id"] for c in json.loads(call(d, "/v1/models", method="GET")[2])["data"]] == [
            "engined"
        ]
