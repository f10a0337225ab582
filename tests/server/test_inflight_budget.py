"""Each control client's requests in flight are charged in bytes (issue 21, 2).

A real daemon with `--control-inflight-bytes 40000`, paced at 1 ms a decode pass so a request
with a large `max_tokens` stays in flight. A request is charged 1,024 bytes, 10 a prompt
token, 40 a planned output id, 64 a stop id and a cache salt's bytes
(`engined.server.control.budgets`): a 1,000-token prompt costs 11,024, with 500 planned ids 31,024,
with 256 stop ids and a 1,024-byte salt 28,432. A `submit` that would take its client past
the budget is answered `overloaded` naming the budget and the figures, changes nothing, and
costs no other client anything; a cancel or a finish gives the bytes back.

Waits are on replies and streamed outputs, never sleeps standing in for an event.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engined.client import EngineClient, EngineError
from engined.server.control.budgets import LORA_BYTES, request_bytes, text_bytes
from engined.wire.control import WireLoraRequest, WireRequest
from tests.server.daemon_harness import start_daemon
from tests.support import run

TIMEOUT_S = 20.0
BUDGET = 40_000
FLAGS = (
    "--control-inflight-bytes",
    str(BUDGET),
    "--speedup-ratio",
    "1",
    "--perf-model",
    "fixed",
    "--fixed-decode-ms-per-pass",
    "1",
    "--fixed-pass-overhead-ms",
    "0",
    "--fixed-prefill-ms-per-token",
    "0",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "1024",
)
PROMPT = list(range(1, 1001))
PLANNED = [7] * 500
LONG = 11_024  # PROMPT alone
PLANNED_COST = 31_024  # PROMPT with PLANNED
STOPS = list(range(256))
SALT = "s" * 1024
STOPS_COST = 28_432  # PROMPT with STOPS and SALT


def refusal(held: int, cost: int) -> str:
    return (
        f"request: this client's requests in flight hold {held} bytes and this one needs "
        f"{cost}, over the client's budget of {BUDGET} bytes (control_inflight_bytes)"
    )


def test_the_costs_are_what_the_budget_charges() -> None:
    assert request_bytes(len(PROMPT), 0) == LONG
    assert request_bytes(len(PROMPT), len(PLANNED)) == PLANNED_COST
    assert request_bytes(len(PROMPT), 0, len(STOPS), len(SALT)) == STOPS_COST
    assert LONG + PLANNED_COST > BUDGET >= PLANNED_COST
    assert LONG + STOPS_COST + request_bytes(1, 0) > BUDGET >= LONG + STOPS_COST


def test_a_salt_and_an_adapter_are_charged_their_bytes() -> None:
    lora = WireLoraRequest(lora_name="é-lora", lora_int_id=1, lora_path="/adapters/é")
    assert LORA_BYTES == 256
    assert text_bytes(WireRequest(token_ids=[1], max_tokens=1)) == 0
    assert text_bytes(WireRequest(token_ids=[1], max_tokens=1, cache_salt="é")) == 2
    assert text_bytes(WireRequest(token_ids=[1], max_tokens=1, lora_request=lora)) == 256 + 7 + 12
    both = WireRequest(token_ids=[1], max_tokens=1, cache_salt=SALT, lora_request=lora)
    assert text_bytes(both) == 1024 + 256 + 7 + 12


def test_stop_ids_and_a_salt_are_charged(tmp_path: Path) -> None:
    """The daemon charges what the core keeps of them: after a long request and one with
    256 stop ids and a 1 KiB salt, a 1-token request no longer fits."""
    with start_daemon(tmp_path, *FLAGS) as daemon:

        async def scenario() -> None:
            async with await EngineClient.connect(daemon.control) as client:
                await client.submit(PROMPT, 1_000_000, timeout=TIMEOUT_S)
                await client.submit(
                    PROMPT, 1_000_000, stop_token_ids=STOPS, cache_salt=SALT, timeout=TIMEOUT_S
                )
                with pytest.raises(EngineError) as refused:
                    await client.submit([1], 1, timeout=TIMEOUT_S)
                assert refused.value.code == "overloaded"
                assert refused.value.message == refusal(LONG + STOPS_COST, request_bytes(1, 0))

        run(scenario())


def test_a_client_past_its_budget_is_refused_alone_until_it_frees_some(tmp_path: Path) -> None:
    with start_daemon(tmp_path, *FLAGS) as daemon:

        async def scenario() -> None:
            async with (
                await EngineClient.connect(daemon.control) as client,
                await EngineClient.connect(daemon.control) as other,
            ):
                long = await client.submit(PROMPT, 1_000_000, timeout=TIMEOUT_S)
                with pytest.raises(EngineError) as refused:
                    await client.submit(PROMPT, 1, output_token_ids=PLANNED, timeout=TIMEOUT_S)
                assert refused.value.code == "overloaded"
                assert refused.value.message == refusal(LONG, PLANNED_COST)
                # Another client's budget is its own.
                theirs = await other.generate(
                    PROMPT, 1, output_token_ids=PLANNED, timeout=TIMEOUT_S
                )
                assert theirs.token_ids == PLANNED and theirs.finish_reason == "length"
                # A cancel gives the bytes back.
                await client.cancel(long.request_id, timeout=TIMEOUT_S)
                planned = await client.submit(
                    PROMPT, 1, output_token_ids=PLANNED, timeout=TIMEOUT_S
                )
                with pytest.raises(EngineError) as refused:
                    await client.submit(PROMPT, 2, timeout=TIMEOUT_S)
                assert refused.value.message == refusal(PLANNED_COST, LONG)
                # And so does a finish.
                done = await client.collect(planned, timeout=TIMEOUT_S)
                assert done.token_ids == PLANNED and done.finish_reason == "length"
                last = await client.generate(PROMPT, 2, timeout=TIMEOUT_S)
                assert last.finish_reason == "length"

        run(scenario())


def test_a_request_larger_than_the_whole_budget_is_refused(tmp_path: Path) -> None:
    huge = [3] * 1_000
    cost = request_bytes(1, len(huge))
    assert cost == 41_034 > BUDGET
    with start_daemon(tmp_path, *FLAGS) as daemon:

        async def scenario() -> None:
            async with await EngineClient.connect(daemon.control) as client:
                with pytest.raises(EngineError) as refused:
                    await client.submit([1], 1, output_token_ids=huge, timeout=TIMEOUT_S)
                assert refused.value.code == "overloaded"
                assert refused.value.message == refusal(0, cost)
                stats = await client.stats(timeout=TIMEOUT_S)
                assert (stats.ranks[0].running, stats.ranks[0].waiting) == (0, 0)
                assert (await client.generate([1], 1, timeout=TIMEOUT_S)).token_ids != []

        run(scenario())
