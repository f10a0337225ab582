"""Disaggregated prefill/decode the llm-d way: two plain `engined serve` pods and
`kv_transfer_params` as vLLM's NIXL connector exchanges them (engined/openai/disagg.py).

The test plays llm-d's routing sidecar over plain HTTP: the prefill request goes to one
server with `max_tokens: 1`, `stream: false` and `do_remote_decode`; the decode request goes
to the other with the params the prefill returned. Both daemons are aggregated (no
`--worker-type`); the prefill's control endpoint is loopback tcp, so its params name a host
and a port, as a pod's would.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from engined.client import EngineClient
from engined.client.handoff_coordinator import Coordinator, DestinationRequest
from engined.openai.disagg import (
    HANDSHAKE_TIMEOUT_S,
    Advertised,
    DecodeRole,
    Disaggregation,
    PrefillRole,
)
from engined.wire.control import RankStats, TransferTiming
from tests.openai.api_harness import ApiDaemon, start_api
from tests.server.daemon_harness import free_tcp_port
from tests.support import run

BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 131072
KV_BANDWIDTH_GB_S = 25.0
# 40 prompt tokens at 128 KiB a token over 25 GB/s.
TRANSFER_MS = 40 * KV_BYTES_PER_TOKEN / (KV_BANDWIDTH_GB_S * 1e9) * 1e3
FLAGS = (
    "--speedup-ratio",
    "0",
    "--block-size",
    str(BLOCK_SIZE),
    "--num-gpu-blocks",
    "64",
    "--kv-bytes-per-token",
    str(KV_BYTES_PER_TOKEN),
    "--kv-transfer-bandwidth",
    str(KV_BANDWIDTH_GB_S),
    "--enable-prompt-tokens-details",
    "--enable-lora",
    "--lora-modules",
    "pd=/adapters/pd",
)
# The LoRA adapter both pods serve (`--lora-modules`).
ADAPTER = "pd"
# The sidecar's prefill: vLLM's keys, the ones it does not know yet null.
SIDECAR_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
WAIT_S = 20.0


def prompt(first: int) -> list[int]:
    return list(range(first, first + 40))


class Pair:
    def __init__(self, prefill: ApiDaemon, decode: ApiDaemon) -> None:
        self.prefill = prefill
        self.decode = decode

    @property
    def prefill_port(self) -> int:
        return int(self.prefill.daemon.control.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    prefill_dir = tmp_path_factory.mktemp("prefill")
    run_dir = prefill_dir / "run"
    run_dir.mkdir(mode=0o700)
    with (
        start_api(
            prefill_dir,
            *FLAGS,
            env={"XDG_RUNTIME_DIR": str(run_dir)},
            control=f"tcp://127.0.0.1:{free_tcp_port()}",
        ) as prefill,
        start_api(tmp_path_factory.mktemp("decode"), *FLAGS) as decode,
    ):
        yield Pair(prefill, decode)


def post(
    api: ApiDaemon, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """The status and the JSON body, or for a stream the list of its `data:` events."""
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
    try:
        connection.request(
            "POST",
            path,
            json.dumps(body),
            {"content-type": "application/json", **(headers or {})},
        )
        response = connection.getresponse()
        raw = response.read().decode()
    finally:
        connection.close()
    if body.get("stream") and response.status == 200:
        events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line]
        assert events[-1] == "[DONE]", raw
        return 200, [json.loads(event) for event in events[:-1]]
    return response.status, json.loads(raw)


def rank0(control: str) -> RankStats:
    async def idle() -> RankStats:
        async with await EngineClient.connect(control) as client:
            return (await client.wait_idle(timeout=WAIT_S)).ranks[0]

    return run(idle())


def completion(ids: list[int] | list[list[int]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": ids, "max_tokens": max_tokens, "return_token_ids": True, **extra}


def prefill(pair: Pair, ids: list[int], request_id: str) -> dict[str, Any]:
    body = completion(ids, 1, stream=False, kv_transfer_params=SIDECAR_PREFILL)
    status, answer = post(pair.prefill, "/v1/completions", body, {"x-request-id": request_id})
    assert status == 200, answer
    return dict(answer)


def test_the_decode_continues_the_prefill_and_frees_its_source(pair: Pair) -> None:
    ids = prompt(100)
    answer = prefill(pair, ids, "pd-1")
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 1
    assert answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    handoff = params["remote_request_id"]
    assert len(handoff) == 32
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1, 2]],
        "remote_engine_id": f"tcp://127.0.0.1:{pair.prefill_port}",
        "remote_request_id": handoff,
        "remote_host": "127.0.0.1",
        "remote_port": pair.prefill_port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": None,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
        "engined": {
            "request_id": "cmpl-pd-1-0",
            "dp_rank": 0,
            "transfer_timing": {
                "mode": "full_prompt",
                "full_prompt_tokens": 40,
                "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
                "bandwidth_gb_s": KV_BANDWIDTH_GB_S,
            },
            "speedup_ratio": 0.0,
        },
    }
    # The source holds the prompt's blocks (and the one token) until the decode pulls them.
    held = rank0(pair.prefill.daemon.control)
    assert (held.active_blocks, held.running) == (3, 0)

    body = completion(
        ids, 8, stream=True, stream_options={"include_usage": True}, kv_transfer_params=params
    )
    status, events = post(pair.decode, "/v1/completions", body, {"x-request-id": "other"})
    assert status == 200, events
    tokens = [t for event in events for c in event["choices"] for t in c["token_ids"]]
    assert len(tokens) == 8
    assert tokens[0] == choice["token_ids"][0]
    finals = [c for event in events for c in event["choices"] if c["finish_reason"]]
    assert [c["finish_reason"] for c in finals] == ["length"]
    assert all(event["kv_transfer_params"] is None for event in events if event["choices"])
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (40, 8)
    # vLLM reports the prefill side's cache hits for a remote prefill.
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0

    assert rank0(pair.prefill.daemon.control).active_blocks == 0
    decoded = rank0(pair.decode.daemon.control)
    assert (decoded.active_blocks, decoded.running, decoded.waiting) == (0, 0, 0)
    # The transferred blocks are the decode daemon's now: the same request run there plainly
    # finds the prompt's full blocks cached and draws the same tokens.
    body = completion(ids, 8)
    status, plain = post(pair.decode, "/v1/completions", body, {"x-request-id": "pd-1"})
    assert status == 200, plain
    assert plain["choices"][0]["token_ids"] == tokens
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_chat_streams_the_params_on_the_finishing_chunk(pair: Pair) -> None:
    messages = [{"role": "user", "content": "the llm-d way"}]
    body = {
        "messages": messages,
        "max_tokens": 1,
        "stream": True,
        "seed": 7,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    status, events = post(pair.prefill, "/v1/chat/completions", body)
    assert status == 200, events
    finishing = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finishing) == 1
    params = finishing[0]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert all(e.get("kv_transfer_params") is None for e in events if e is not finishing[0])
    first = finishing[0]["choices"][0]["delta"].get("content", "")

    body = {"messages": messages, "max_tokens": 6, "seed": 7, "kv_transfer_params": params}
    status, answer = post(pair.decode, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 6
    assert answer["choices"][0]["message"]["content"].startswith(first)
    assert answer["kv_transfer_params"] is None
    assert rank0(pair.prefill.daemon.control).active_blocks == 0


def decode_params(pair: Pair, **changes: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_request_id": "0" * 32,
        "remote_host": "127.0.0.1",
        "remote_port": pair.prefill_port,
        "engined": {"speedup_ratio": 0.0},
    }
    params.update(changes)
    return {key: value for key, value in params.items() if value is not None}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
        (
            {"do_remote_decode": True, "do_remote_prefill": True},
            "kv_transfer_params.do_remote_prefill",
        ),
        ({"remote_request_id": None}, "kv_transfer_params.remote_request_id"),
        ({"remote_request_id": "x" * 257}, "kv_transfer_params.remote_request_id"),
        ({"remote_host": ""}, "kv_transfer_params.remote_host"),
        ({"remote_host": "h" * 100_000}, "kv_transfer_params.remote_host"),
        ({"remote_port": "5555"}, "kv_transfer_params.remote_port"),
        ({"remote_port": 70000}, "kv_transfer_params.remote_port"),
        ({"engined": None}, "kv_transfer_params.engined"),
        ({"engined": {"speedup_ratio": "fast"}}, "kv_transfer_params.engined.speedup_ratio"),
        (
            {"engined": {"transfer_timing": {"mode": "sideways"}}},
            "kv_transfer_params.engined.transfer_timing",
        ),
        ({"engined": {"request_id": 5}}, "kv_transfer_params.engined.request_id"),
    ],
)
def test_malformed_params_are_400_naming_the_field(
    pair: Pair, params: dict[str, Any], field: str
) -> None:
    if "do_remote_decode" not in params:
        params = decode_params(pair, **params)
    status, answer = post(
        pair.decode, "/v1/completions", completion(prompt(200), 4, kv_transfer_params=params)
    )
    assert status == 400, answer
    assert answer["error"]["param"] == field
    assert field in answer["error"]["message"]


def test_a_handoff_moves_one_sequence(pair: Pair) -> None:
    body = completion(prompt(300), 1, n=2, kv_transfer_params={"do_remote_decode": True})
    status, answer = post(pair.prefill, "/v1/completions", body)
    assert (status, answer["error"]["param"]) == (400, "n")
    body = completion([prompt(300), prompt(400)], 1, kv_transfer_params={"do_remote_decode": True})
    status, answer = post(pair.prefill, "/v1/completions", body)
    assert (status, answer["error"]["param"]) == (400, "prompt")


def test_failed_pulls_are_500_and_both_servers_serve_on(pair: Pair) -> None:
    body = completion(prompt(500), 4, kv_transfer_params=decode_params(pair))
    status, answer = post(pair.decode, "/v1/completions", body)
    assert status == 500, answer
    assert (
        answer["error"]["message"] == f"KV transfer failed: no source of handoff {'0' * 32} is held"
    )

    # A second pull of a handoff already decoded finds no source either.
    params = prefill(pair, prompt(600), "pd-twice")["kv_transfer_params"]
    body = completion(prompt(600), 2, kv_transfer_params=params)
    assert post(pair.decode, "/v1/completions", body)[0] == 200
    status, answer = post(pair.decode, "/v1/completions", body)
    assert status == 500, answer

    nobody = free_tcp_port()
    body = completion(prompt(700), 4, kv_transfer_params=decode_params(pair, remote_port=nobody))
    status, answer = post(pair.decode, "/v1/completions", body)
    assert status == 500, answer
    assert answer["error"]["message"] == (
        f"KV transfer failed: the prefill daemon at tcp://127.0.0.1:{nobody} did not answer "
        f"within {HANDSHAKE_TIMEOUT_S:g} s"
    )

    # Nothing is left reserved or held, and both servers answer ordinary requests.
    for api in (pair.prefill, pair.decode):
        stats = rank0(api.daemon.control)
        assert (stats.active_blocks, stats.running, stats.waiting) == (0, 0, 0)
        status, answer = post(api, "/v1/completions", completion(prompt(800), 3))
        assert (status, answer["usage"]["completion_tokens"]) == (200, 3)


def test_an_adapter_runs_on_both_sides_of_a_handoff(pair: Pair) -> None:
    """llm-d's sidecar sends both pods the same `model`: the prefill's source and the
    decode's destination run with that LoRA adapter, so on each daemon the prompt's blocks
    are the adapter's, found by its requests and not by the base model's."""
    ids = prompt(1000)
    body = completion(ids, 1, stream=False, kv_transfer_params=SIDECAR_PREFILL, model=ADAPTER)
    status, answer = post(pair.prefill, "/v1/completions", body)
    assert (status, answer["model"]) == (200, ADAPTER), answer
    body = completion(ids, 4, kv_transfer_params=answer["kv_transfer_params"], model=ADAPTER)
    status, decoded = post(pair.decode, "/v1/completions", body)
    assert (status, decoded["model"], decoded["usage"]["completion_tokens"]) == (200, ADAPTER, 4)
    for api in (pair.prefill, pair.decode):
        cached = []
        for model in ("engined", ADAPTER):
            status, plain = post(api, "/v1/completions", completion(ids, 1, model=model))
            assert status == 200, plain
            cached.append(plain["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 32]


def test_a_salted_request_is_salted_on_both_sides_of_a_handoff(pair: Pair) -> None:
    """The prefill's source and the decode's destination run with the request's
    `cache_salt`: on each daemon the prompt's blocks are found under that salt only."""
    ids = prompt(3000)
    salted = {"cache_salt": "t"}
    body = completion(ids, 1, stream=False, kv_transfer_params=SIDECAR_PREFILL, **salted)
    status, answer = post(pair.prefill, "/v1/completions", body)
    assert status == 200, answer
    body = completion(ids, 4, kv_transfer_params=answer["kv_transfer_params"], **salted)
    status, decoded = post(pair.decode, "/v1/completions", body)
    assert (status, decoded["usage"]["completion_tokens"]) == (200, 4), decoded
    for api in (pair.prefill, pair.decode):
        cached = []
        for salt in (None, "u", "t"):
            extra = {} if salt is None else {"cache_salt": salt}
            status, plain = post(api, "/v1/completions", completion(ids, 1, **extra))
            assert status == 200, plain
            cached.append(plain["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 0, 32]


def test_the_transfer_wait_is_the_source_timing_at_its_speedup(pair: Pair) -> None:
    """The decode side's coordinator on an injected clock: the wait it asks for is the
    modelled transfer of the prompt, divided by the source daemon's speedup."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def scenario() -> None:
        async with (
            await EngineClient.connect(pair.prefill.daemon.control) as source,
            await EngineClient.connect(pair.decode.daemon.control) as destination,
        ):
            handoffs = Coordinator(destination, EngineClient.connect, sleep=sleep)
            disagg = Disaggregation(
                handoffs, Advertised("127.0.0.1", pair.prefill_port), BLOCK_SIZE, 0.0
            )
            role = PrefillRole("clocked-handoff")
            ids = prompt(900)
            submitted = await disagg.start_prefill(
                source, role, ids, request_id="clocked", seed=None, priority=0
            )
            generated = await source.collect(submitted, timeout=WAIT_S)
            assert generated.finish_reason == "length"
            params = await disagg.finish_prefill(source, role, submitted, len(ids), 0)
            timing = msgspec.convert(params["engined"]["transfer_timing"], TransferTiming)
            decode = DecodeRole(
                handoff_id=role.handoff_id,
                endpoint=f"tcp://127.0.0.1:{pair.prefill_port}",
                request_id="clocked",
                timing=timing,
                handoff_delay_ms=0.0,
                speedup_ratio=4.0,
                cached_tokens=None,
            )
            accepted = await disagg.pull(decode, DestinationRequest(ids, 2, request_id="clocked"))
            decoded = await destination.collect(accepted, timeout=WAIT_S)
            assert decoded.token_ids[0] == generated.token_ids[0]
            await handoffs.close()

    run(asyncio.wait_for(scenario(), WAIT_S))
    assert waits == [pytest.approx(TRANSFER_MS / 1e3 / 4.0)]
    assert rank0(pair.prefill.daemon.control).active_blocks == 0
