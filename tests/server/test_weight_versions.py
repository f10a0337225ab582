"""`set_weight_version` against a running daemon (PROTOCOL.md §1.1): vLLM's
`update_weight_version`, whose label every later step's outputs carry.

An RL loop pauses (`keep`), loads weights, labels them and resumes: a request in flight
across the update has entries without a label (vLLM's "default") before, and with the new
one after. Both rank layouts: the label must follow a worker process's outputs in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from engined.client import EngineClient, EngineError
from tests.server.daemon_harness import (
    DaemonProcess,
    expect_refusals,
    start_daemon,
    start_tcp_daemon,
)
from tests.support import run

FLAGS = ("--speedup-ratio", "1", "--data-parallel-size", "2")
PROMPT = list(range(1, 33))


@pytest.fixture(params=["0", "2"], ids=["in-process-ranks", "rank-processes"])
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    with start_daemon(tmp_path, *FLAGS, "--rank-processes", request.param) as process:
        yield process


def test_outputs_after_the_update_carry_the_new_version(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            assert {r.weight_version for r in (await client.stats()).ranks} == {"default"}
            running = await client.submit(PROMPT, 1000, dp_rank=1)
            async with contextlib.aclosing(client.outputs(running.request_id)) as outputs:
                first = await anext(outputs)
                assert first.weight_version is None
                await client.pause("keep", clear_cache=False)
                await client.set_weight_version("step-7")
                stats = await client.stats()
                assert {r.weight_version for r in stats.ranks} == {"step-7"}
                await client.resume()
                # Entries already on their way when the label changed keep "default"; once
                # one carries it, every later one does.
                labels = [(await anext(outputs)).weight_version for _ in range(40)]
                assert labels[-1] == "step-7"
                assert labels == sorted(labels, key=lambda label: label is not None)
                await client.set_weight_version("default")
                assert {r.weight_version for r in (await client.stats()).ranks} == {"default"}
                later = [(await anext(outputs)).weight_version for _ in range(40)]
                assert later[-1] is None
            await client.cancel(running.request_id)

    run(scenario())


def test_labels_are_bounded_and_malformed_ones_refused(daemon: DaemonProcess) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"type": "set_weight_version", "weight_version": "x" * 257}, "invalid_request"),
        ({"type": "set_weight_version", "weight_version": "x" * 10_000_000}, "invalid_request"),
        ({"type": "set_weight_version", "weight_version": 7}, "bad_message"),
        ({"type": "set_weight_version"}, "bad_message"),
    ]

    async def scenario() -> None:
        await expect_refusals(daemon.control, cases)
        async with await EngineClient.connect(daemon.control) as client:
            assert {r.weight_version for r in (await client.stats()).ranks} == {"default"}
            await client.set_weight_version("ü" * 64)  # 256 bytes: the limit
            assert {r.weight_version for r in (await client.stats()).ranks} == {"ü" * 64}

    run(scenario())


def test_only_operators_label(tmp_path: Path) -> None:
    async def scenario(daemon: DaemonProcess) -> None:
        async with await EngineClient.connect(daemon.control) as client:
            with pytest.raises(EngineError) as refused:
                await client.set_weight_version("v1")
            assert refused.value.code == "forbidden"
            assert refused.value.message.startswith("set_weight_version needs the operator role")

    with start_tcp_daemon(tmp_path, *FLAGS) as daemon:
        run(scenario(daemon))
