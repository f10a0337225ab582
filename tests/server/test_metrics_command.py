"""The `metrics` control command and the exposition it shares with `/metrics`.

Three layers: the renderer (`VllmMetrics.render` through `Exposition`) against
prometheus_client's own encoders, byte for byte, for every `Accept` they tell apart; the
bounds of `MetricsRequests` with a refresh held open; and an in-process daemon answering
`metrics` with exactly `/metrics`' body, and answering malformed, huge and flooding `metrics`
messages with errors naming the field while it keeps serving.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from prometheus_client.exposition import choose_encoder

from engined.client import EngineClient, EngineError
from engined.config import DaemonConfig
from engined.core.args import EngineArgs, WorkerType
from engined.core.core_build import CoreBuild
from engined.core.engine import Engine
from engined.model_clock import ModelClock
from engined.server.ops import exposition as exposition_module
from engined.server.ops.build_info import BuildInfo
from engined.server.ops.exposition import (
    METRICS_CLIENT_LIMIT,
    METRICS_LIMIT,
    Exposition,
    MetricsRequests,
)
from engined.server.ops.prometheus_metrics import VllmMetrics
from engined.server.ranks.engine_loop import EngineLoop
from engined.wire import control as wire
from engined.wire.control import ErrorReply, MetricsReply
from tests.server.test_metrics import _Sinks, http_get, run_core
from tests.server.test_rank_processes import config, run, serving
from tests.support import free_tcp_port

# Every Accept that picks a different encoder, version or escaping in prometheus_client
# 0.26's `choose_encoder`; the first is what Prometheus 2.x and 3.x send.
ACCEPTS = [
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "",
    "text/plain",
    "text/plain;version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=underscores",
    "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=values",
    "application/openmetrics-text",
    "application/openmetrics-text;version=0.0.1",
    "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/json",
]


def populated(model_name: str) -> VllmMetrics:
    """Two ranks of a decode worker with MTP, offload tiers and residency off: every
    optional family but the residency histograms (the mocker pool has none) is exposed."""
    engine = EngineArgs(
        block_size=16,
        num_gpu_blocks=40,
        dp_size=2,
        worker_type=WorkerType.DECODE,
        aic_nextn=2,
        num_g2_blocks=8,
        kv_bytes_per_token=1000,
    ).normalized()
    metrics = VllmMetrics.from_config(DaemonConfig(model_name=model_name, engine=engine))
    metrics.register(BuildInfo(model_name, "0.1.0", CoreBuild(True)))
    sinks = _Sinks()
    for rank in range(2):
        core = Engine(engine, dp_rank=rank)
        loop = EngineLoop(core, kv=sinks, fpm=sinks, delivery=sinks, model_clock=ModelClock(0.0))
        run_core(core, metrics.attach(loop), count=12, seed=rank)
    return metrics


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_exposition_is_prometheus_clients_byte_for_byte(accept: str) -> None:
    """The precomputed rendering gives the library encoder's bytes, for a model name that
    needs every escape (quote, backslash, newline, non-ASCII)."""
    metrics = populated('qwen "3"\\0.6b\nß')
    fast = Exposition(metrics.registry, rendered=metrics)
    content_type, body = fast.render(accept)
    encoder, expected_type = choose_encoder(accept)
    assert content_type == expected_type
    assert body == encoder(metrics.registry)


def test_the_compared_exposition_has_every_optional_family() -> None:
    body = Exposition(populated("m").registry).render("")[1].decode()
    for family in (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "vllm:num_requests_kv_fetch_by_stage",
        "engined:kv_tier_blocks",
        "engined:build_info",
    ):
        assert f"# TYPE {family}" in body


def test_rendering_twice_gives_the_same_text_as_the_tallies_move() -> None:
    """The text kept per series is only what precedes the value: a second scrape after more
    work shows the new values, and still equals the library's encoding."""
    metrics = populated("m")
    fast = Exposition(metrics.registry, rendered=metrics)
    first = fast.render("")[1]
    metrics.ranks[0].generation_tokens += 5
    second = fast.render("")[1]
    assert first != second
    assert second == choose_encoder("")[0](metrics.registry)


# --- MetricsRequests' bounds --------------------------------------------------------------


class _HeldRefresh:
    """A `before_scrape` that returns once released; `waiting` is set once `expected` calls
    wait on it."""

    def __init__(self, expected: int = 1) -> None:
        self.calls = 0
        self.expected = expected
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.expected:
            self.waiting.set()
        await self.release.wait()


def test_requests_are_bounded_per_client_and_in_all() -> None:
    async def scenario() -> None:
        held = _HeldRefresh(METRICS_LIMIT)
        metrics = populated("m")
        requests = MetricsRequests(Exposition(metrics.registry, held, rendered=metrics))
        clients = [f"c{n}".encode() for n in range(5)]
        admitted: list[asyncio.Task[MetricsReply]] = []
        for n in range(METRICS_CLIENT_LIMIT):
            assert requests.admit(clients[0]) is None
            msg = wire.Metrics(id=n)
            admitted.append(asyncio.create_task(requests.answer(msg, clients[0])))
        assert requests.admit(clients[0]) == (
            "this client has 4 metrics requests in progress already"
        )
        for client in clients[1:4]:
            for _ in range(METRICS_CLIENT_LIMIT):
                assert requests.admit(client) is None
                admitted.append(asyncio.create_task(requests.answer(wire.Metrics(), client)))
        assert len(admitted) == METRICS_LIMIT
        assert requests.admit(clients[4]) == "16 metrics requests are in progress already"
        await asyncio.wait_for(held.waiting.wait(), 10)
        assert held.calls == METRICS_LIMIT and requests.clients == 4
        held.release.set()
        replies = await asyncio.gather(*admitted)
        expected = Exposition(metrics.registry).render("")
        assert {(r.content_type, r.text.encode()) for r in replies} == {expected}
        assert [r.id for r in replies[:4]] == [0, 1, 2, 3]
        assert requests.clients == 0
        assert requests.admit(clients[4]) is None  # room again

    run(scenario())


def test_a_refresh_that_never_ends_delays_the_reply_by_the_bound_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that does not answer (the refresh hangs): the reply comes once the bound
    passes, with the figures the daemon has, and the request's room is given back."""
    monkeypatch.setattr(exposition_module, "SCRAPE_REFRESH_S", 0.05)

    async def scenario() -> None:
        held = _HeldRefresh()
        metrics = populated("m")
        requests = MetricsRequests(Exposition(metrics.registry, held, rendered=metrics))
        assert requests.admit(b"slow") is None
        accept = "application/openmetrics-text; version=1.0.0"
        reply = await requests.answer(wire.Metrics(id="x", accept=accept), b"slow")
        assert (reply.id, held.calls, requests.clients) == ("x", 1, 0)
        assert reply.content_type.startswith("application/openmetrics-text; version=1.0.0")
        assert reply.text.endswith("# EOF\n")

    run(scenario())


# --- a live daemon --------------------------------------------------------------------------


def test_the_metrics_command_answers_what_metrics_serves(tmp_path: Path) -> None:
    """After a workload, on an idle in-process daemon: the reply's content type and text are
    `/metrics`' header and body, for the default and for Prometheus' Accept."""
    port = free_tcp_port()
    cfg = config(tmp_path, 2, http_port=port, **{"engine.perf_model": "fixed"})

    async def scenario() -> None:
        async with serving(cfg, 0) as running, await EngineClient.connect(running.endpoint) as c:
            for n in range(4):
                await c.generate([n * 100 + i for i in range(40)], 6, dp_rank=n % 2, timeout=20)
            await c.wait_idle(timeout=20)
            for accept in (None, ACCEPTS[0], "text/plain;version=1.0.0;escaping=dots"):
                reply = await c.metrics(accept)
                response = await http_get(port, "/metrics", accept=accept or "")
                assert response.status == 200
                assert reply.content_type == response.headers["content-type"]
                assert reply.text.encode() == response.body
            text = (await c.metrics()).text
            assert 'vllm:request_success_total{engine="1",finished_reason="length"' in text
            assert (
                'vllm:request_prefill_time_seconds_count{engine="0",model_name="engined"} 2.0'
                in text
            )

    run(scenario())


def raw(client: EngineClient, body: dict[str, object] | bytes) -> object:
    encoded = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
    return client.send_raw(encoded, timeout=20)


def test_malformed_huge_and_flooding_metrics_messages(tmp_path: Path) -> None:
    """Each malformed `metrics` gets an error naming the field; a flood of them from one
    client gets one reply each (the exposition, or `overloaded` past the bound) and the daemon
    keeps answering everyone."""
    cfg = config(tmp_path, 1, http_port=free_tcp_port())
    cases: list[tuple[dict[str, object], str, str]] = [
        ({"type": "metrics", "accept": 5}, "bad_message", "Expected `str | null`, got `int`"),
        ({"type": "metrics", "accept": ["text/plain"]}, "bad_message", "at `$.accept`"),
        ({"type": "metrics", "format": "text"}, "bad_message", "unknown field `format`"),
        (
            {"type": "metrics", "accept": "a" * 4097},
            "invalid_request",
            "Expected `str` of length <= 4096 - at `$.accept`",
        ),
        (
            {"type": "metrics", "accept": "\u00e9" * (1 << 20), "id": 7},
            "invalid_request",
            "Expected `str` of length <= 4096 - at `$.accept`",
        ),
    ]

    async def scenario() -> None:
        async with serving(cfg, 0) as running, await EngineClient.connect(running.endpoint) as c:
            for body, code, text in cases:
                reply = await raw(c, body)  # type: ignore[misc]
                assert isinstance(reply, ErrorReply), reply
                assert (reply.code, text in reply.message) == (code, True), reply.message
                assert len(reply.message.encode()) <= 512
                assert reply.id == body.get("id")
            flood = 200
            bodies = [msgspec.msgpack.encode({"type": "metrics", "id": n}) for n in range(flood)]
            replies = await asyncio.gather(*(c.send_raw(b, timeout=30) for b in bodies))
            answered = [r for r in replies if isinstance(r, MetricsReply)]
            refused = [r for r in replies if isinstance(r, ErrorReply)]
            assert len(answered) + len(refused) == flood and answered
            assert {r.code for r in refused} <= {"overloaded"}
            assert sorted(r.id for r in replies) == list(range(flood))  # type: ignore[type-var]
            assert (await c.ping()).id is not None
            assert running.daemon.control is not None
            assert (await c.metrics()).text.startswith("# HELP vllm:num_requests_running ")

    run(scenario())


def test_a_daemon_without_metrics_says_so(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            serving(config(tmp_path, 1), 0) as running,
            await EngineClient.connect(running.endpoint) as client,
        ):
            with pytest.raises(EngineError) as refused:
                await client.metrics()
            assert refused.value.code == "unsupported"
            assert refused.value.message == (
                "this daemon keeps no metrics: they are collected with http_port or api_port set"
            )

    run(scenario())
