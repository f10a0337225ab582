"""Prometheus `/metrics` and `/health` (engined.server.ops.prometheus_metrics,
engined.server.ops.http_endpoint).

Three layers: `RankMetrics` fed with hand-made PassReports (each rule on its own) and with a
real core's passes checked against a brute-force, per-token reference; the HTTP server in
process (routes, status codes, garbage); and a live daemon scraped under load, whose counters
must equal the client's own tallies. No sleep is used to synchronise: waits are bounded reads
and polls with deadlines.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from engined.client import EngineClient, Generation
from engined.config import DaemonConfig
from engined.core.args import EngineArgs
from engined.core.command_report import CommandReport
from engined.core.engine import Engine
from engined.core.pass_report import PassReport
from engined.core.types import (
    ActivateDestination,
    Admission,
    Cancel,
    CancelDestination,
    Command,
    Decodes,
    EndedRequest,
    FinishReason,
    LifecycleEvent,
    Request,
    RequestOutput,
    ReserveDestination,
    Submit,
    SubmitHandoffPrefill,
)
from engined.model_clock import ModelClock
from engined.server.daemon import Daemon
from engined.server.ops import http_endpoint as http_module
from engined.server.ops.http_endpoint import HealthState, HttpServer
from engined.server.ops.prometheus_metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    LatencyHistogram,
    RankMetrics,
    VllmMetrics,
)
from engined.server.ranks.engine_loop import EngineLoop
from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.support import free_tcp_port

VLLM_NAMES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:cache_config_info",
    # vLLM 0.33's families beyond the first fourteen (test_metrics_families.py).
    "vllm:num_requests_waiting_by_reason",
    "vllm:engine_sleep_state",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:admission_rejections",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_num_preemptions",
    "vllm:request_prefill_kv_computed_tokens",
}


# --- helpers ------------------------------------------------------------------------------


def make_core(**args: object) -> Engine:
    defaults: dict[str, object] = {"block_size": 16, "num_gpu_blocks": 1024, "speedup_ratio": 0.0}
    return Engine(EngineArgs(**{**defaults, **args}))  # type: ignore[arg-type]


def tally(core: Engine, clock: Callable[[], float] = lambda: 0.0) -> RankMetrics:
    return RankMetrics(0, gauges=core.metrics, now_ms=clock)


def submit(
    core: Engine, metrics: RankMetrics, request_id: str, prompt: int, max_tokens: int, at: float
) -> None:
    """What EngineLoop does for a Submit: apply it, then tell the command observer."""
    command = Submit(
        Request(token_ids=list(range(prompt)), max_tokens=max_tokens, request_id=request_id)
    )
    metrics.on_command(0, at, command, CommandReport.of(core.apply(command, now_ms=at)))


def hand_pass(
    core: Engine,
    end_ms: float,
    outputs: list[RequestOutput],
    admissions: tuple[str, ...] = (),
) -> PassReport:
    """A PassReport with only what the metrics read filled in."""
    return PassReport(
        end_ms=end_ms,
        outputs=outputs,
        decodes=Decodes([], [], [0] * len(outputs)),
        ended=[
            EndedRequest(out.request_id, out.finish_reason)
            for out in outputs
            if out.finish_reason is not None
        ],
        admissions=[Admission(request_id, 0) for request_id in admissions],
        metrics=core.metrics(),
        accept_length_output_tokens=sum(len(out.new_token_ids) for out in outputs),
    )


def token(request_id: str, completed: bool = False, count: int = 1) -> RequestOutput:
    """`count` tokens of one request in one pass; the last one ends it if `completed`."""
    return RequestOutput(request_id, [7] * count, FinishReason.LENGTH if completed else None)


def reference(samples_ms: list[float], bounds: tuple[float, ...]) -> LatencyHistogram:
    histogram = LatencyHistogram(bounds)
    for value in samples_ms:
        histogram.add(value / 1000.0)
    return histogram


def assert_same(histogram: LatencyHistogram, expected: LatencyHistogram) -> None:
    assert histogram.counts == expected.counts
    assert histogram.count == expected.count
    assert histogram.sum == pytest.approx(expected.sum, rel=1e-9, abs=1e-12)


class _Sinks:
    """KV, FPM and delivery sinks that drop everything (an EngineLoop without sockets)."""

    def publish(self, *_: object) -> None:
        pass

    overflows = 0  # a KV sink's count of batches it could not publish

    def maybe_heartbeat(self, now: float) -> None:
        pass

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        pass

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        pass


def parse(text: str) -> dict[str, list[Sample]]:
    """Samples by family name, through prometheus-client's own parser."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels`."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@dataclass
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


async def http_raw(port: int, raw: bytes, *, half_close: bool = False) -> Response | None:
    """Send raw bytes, read the whole response (the server closes); None if it sent nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        if half_close:
            writer.write_eof()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    if not data:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, text = line.partition(":")
        headers[name.strip().lower()] = text.strip()
    return Response(int(status_line.split(" ")[1]), headers, body)


async def http_get(port: int, path: str, *, method: str = "GET", accept: str = "") -> Response:
    extra = f"Accept: {accept}\r\n" if accept else ""
    raw = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode()
    response = await http_raw(port, raw)
    assert response is not None
    return response


# --- histograms and clock -------------------------------------------------------------------


def test_histogram_buckets_are_le_and_grouped_adds_equal_single_ones() -> None:
    grouped = LatencyHistogram((0.1, 0.5, 1.0))
    single = LatencyHistogram((0.1, 0.5, 1.0))
    for sample, count in ((0.1, 3), (0.3, 2), (1.0, 1), (7.0, 4)):
        grouped.add(sample, count)
        for _ in range(count):
            single.add(sample)
    assert grouped.counts == single.counts == [3, 2, 1, 4]
    assert grouped.sum == pytest.approx(single.sum)
    assert grouped.cumulative() == [("0.1", 3.0), ("0.5", 5.0), ("1.0", 6.0), ("+Inf", 10.0)]


def test_buckets_are_vllms() -> None:
    # vllm/v1/metrics/loggers.py: 22 TTFT, 19 per-token, 21 request-latency boundaries.
    assert (len(TTFT_BUCKETS), len(ITL_BUCKETS), len(REQUEST_LATENCY_BUCKETS)) == (22, 19, 21)
    assert (TTFT_BUCKETS[0], TTFT_BUCKETS[-1]) == (0.001, 2560.0)
    assert (ITL_BUCKETS[0], ITL_BUCKETS[-1]) == (0.01, 80.0)
    assert (REQUEST_LATENCY_BUCKETS[0], REQUEST_LATENCY_BUCKETS[-1]) == (0.3, 7680.0)
    for bounds in (TTFT_BUCKETS, ITL_BUCKETS, REQUEST_LATENCY_BUCKETS):
        assert list(bounds) == sorted(set(bounds))


# --- RankMetrics with hand-made passes ----------------------------------------------------------


def test_cohort_itl_mtp_bursts_pauses_and_completion() -> None:
    core = make_core()
    metrics = tally(core)
    submit(core, metrics, "a", 100, 10, at=0.0)
    submit(core, metrics, "b", 50, 10, at=4.0)
    # Pass 1 [0, 10]: a is admitted and emits its first token.
    metrics.on_pass(0, 0.0, hand_pass(core, 10.0, [token("a")], ("a",)))
    # Pass 2 [10, 30]: b is admitted and emits its first token; a emits an MTP burst of three
    # tokens, which is one step and so one inter-token sample.
    burst = [token("a", count=3), token("b")]
    metrics.on_pass(0, 10.0, hand_pass(core, 30.0, burst, ("b",)))
    # Pass 3 [30, 35]: b pauses (preempted); pass 4 [35, 50]: a pauses, b is re-admitted.
    metrics.on_pass(0, 30.0, hand_pass(core, 35.0, [token("a")]))
    metrics.on_pass(0, 35.0, hand_pass(core, 50.0, [token("b")], ("b",)))
    # A pass without tokens (a prefill chunk) changes nothing; pass 6 [52, 60] ends both.
    metrics.on_pass(0, 50.0, hand_pass(core, 52.0, []))
    metrics.on_pass(0, 52.0, hand_pass(core, 60.0, [token("a", True), token("b", True)]))

    assert_same(metrics.ttft, reference([10.0, 26.0], TTFT_BUCKETS))
    # a: 20 (the burst), 5, 25 (since 35); b: 20 (since 30, across its pause), 10.
    assert_same(metrics.itl, reference([20.0, 5.0, 25.0, 20.0, 10.0], ITL_BUCKETS))
    assert_same(metrics.e2e, reference([60.0, 56.0], REQUEST_LATENCY_BUCKETS))
    # Queue time runs to the first admission; b's re-admission in pass 4 does not count.
    assert_same(metrics.queue, reference([0.0, 6.0], REQUEST_LATENCY_BUCKETS))
    assert metrics.generation_tokens == 9
    assert metrics.prompt_tokens == 150
    assert metrics.finished == {"stop": 0, "length": 2, "abort": 0}
    assert metrics.requests == {}


def test_a_reused_request_id_starts_afresh() -> None:
    """An id may be submitted again once its request ended; its first token is a TTFT."""
    core = make_core()
    metrics = tally(core)
    submit(core, metrics, "a", 10, 1, at=0.0)
    submit(core, metrics, "b", 10, 5, at=0.0)
    metrics.on_pass(0, 0.0, hand_pass(core, 10.0, [token("a", True), token("b")], ("a", "b")))
    core.apply(Cancel("a"), now_ms=10.0)  # the hand-made pass ended it; the engine did not
    submit(core, metrics, "a", 10, 5, at=10.0)
    metrics.on_pass(0, 10.0, hand_pass(core, 20.0, [token("a"), token("b")], ("a",)))
    cancel = Cancel("b")
    metrics.on_command(0, 20.0, cancel, CommandReport.of(core.apply(cancel, now_ms=20.0)))
    submit(core, metrics, "b", 10, 5, at=20.0)
    metrics.on_pass(0, 20.0, hand_pass(core, 30.0, [token("a"), token("b")], ("b",)))
    assert_same(metrics.ttft, reference([10.0, 10.0, 10.0, 10.0], TTFT_BUCKETS))
    assert_same(metrics.itl, reference([10.0, 10.0], ITL_BUCKETS))


def test_rejected_and_tokenless_requests() -> None:
    core = make_core()
    metrics = tally(core)
    submit(core, metrics, "big", 64, 4, at=0.0)
    submit(core, metrics, "zero", 32, 0, at=0.0)
    rejected = RequestOutput("big", [], FinishReason.REJECTED)
    tokenless = RequestOutput("zero", [], FinishReason.LENGTH)
    metrics.on_pass(0, 0.0, hand_pass(core, 8.0, [rejected, tokenless], ("zero",)))
    # Neither emitted a token: no TTFT, no ITL; the prefilled one counts its prompt.
    assert metrics.ttft.count == metrics.itl.count == 0
    assert metrics.prompt_tokens == 32
    assert metrics.finished == {"stop": 0, "length": 1, "abort": 1}
    assert metrics.e2e.count == 2
    assert metrics.queue.count == 1  # the rejected one was never scheduled


def test_a_stop_is_counted_as_vllms_stop() -> None:
    core = make_core()
    metrics = tally(core)
    submit(core, metrics, "s", 10, 5, at=0.0)
    stopped = RequestOutput("s", [7], FinishReason.STOP, None, None, 7)
    metrics.on_pass(0, 0.0, hand_pass(core, 8.0, [stopped], ("s",)))
    assert metrics.finished == {"stop": 1, "length": 0, "abort": 0}
    assert metrics.ttft.count == 1


def test_every_command_that_ends_a_request_ends_it_as_abort() -> None:
    """Every early end is a command the loop applies and observes (a client's cancel, a
    vanished client's, shutdown's, a handoff cancel): its `ended` ends the record."""
    clock = [0.0]
    core = make_core()
    metrics = tally(core, lambda: clock[0])
    for request_id in ("c", "gone", "shutdown"):
        submit(core, metrics, request_id, 40, 10, at=0.0)
    for at, request_id in ((5.0, "c"), (7.0, "gone"), (30.0, "shutdown")):
        clock[0] = at
        cancel = Cancel(request_id)
        metrics.on_command(0, at, cancel, CommandReport.of(core.apply(cancel, now_ms=at)))
    assert metrics.finished == {"stop": 0, "length": 0, "abort": 3}
    assert_same(metrics.e2e, reference([5.0, 7.0, 30.0], REQUEST_LATENCY_BUCKETS))
    assert metrics.requests == {}
    # A Cancel that found nothing ends nothing.
    effects = core.apply(Cancel("c"), now_ms=31.0)
    assert effects.ended == []
    metrics.on_command(0, 31.0, Cancel("c"), CommandReport.of(effects))
    assert metrics.finished["abort"] == 3


def test_a_sent_cancel_reaches_the_metrics_through_the_loop() -> None:
    """`EngineLoop.send` (a vanished client's cancel) is observed like `call`."""

    async def scenario() -> None:
        config = DaemonConfig(engine=EngineArgs(block_size=16, num_gpu_blocks=64).normalized())
        metrics = VllmMetrics.from_config(config)
        sinks = _Sinks()
        loop = EngineLoop(
            Engine(config.engine), kv=sinks, fpm=sinks, delivery=sinks, model_clock=ModelClock(0.0)
        )
        tallies = metrics.attach(loop)
        runner = asyncio.create_task(loop.run())
        request = Request(token_ids=list(range(40)), max_tokens=10_000, request_id="x")
        await loop.call(Submit(request))
        assert set(tallies.requests) == {"x"}
        loop.send(Cancel("x"))
        await loop.call(Cancel("not-there"))  # applied after the sent one
        assert tallies.requests == {}
        assert tallies.finished == {"stop": 0, "length": 0, "abort": 1}
        loop.stop()
        await runner

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_handoff_sides_are_tracked_until_they_end() -> None:
    """Destinations live outside the core's request table until activated; sources end held."""
    decode = make_core(worker_type="decode", num_gpu_blocks=64)
    metrics = tally(decode)

    def command(core: Engine, tallies: RankMetrics, at: float, cmd: Command) -> None:
        tallies.on_command(0, at, cmd, CommandReport.of(core.apply(cmd, now_ms=at)))

    for handoff_id in ("h1", "h2"):
        request = Request(token_ids=list(range(40)), max_tokens=5, request_id=f"d-{handoff_id}")
        command(decode, metrics, 0.0, ReserveDestination(handoff_id, request))
    command(decode, metrics, 1.0, ActivateDestination("h1"))
    command(decode, metrics, 1.0, CancelDestination("h2"))  # ended by a command: no Cancel
    now = 2.0
    while not decode.is_empty():
        result = decode.execute_pass(now)
        metrics.on_pass(0, now, PassReport.of(result))
        now = result.end_ms
    assert metrics.finished == {"stop": 0, "length": 1, "abort": 1}
    assert (metrics.ttft.count, metrics.requests) == (1, {})

    prefill = make_core(worker_type="prefill", num_gpu_blocks=64)
    source = tally(prefill)
    request = Request(token_ids=list(range(40)), max_tokens=1, request_id="p")
    command(prefill, source, 0.0, SubmitHandoffPrefill("h", request))
    while not prefill.is_empty():
        source.on_pass(0, 0.0, PassReport.of(prefill.execute_pass(0.0)))
    assert source.finished == {"stop": 0, "length": 1, "abort": 0}
    assert source.requests == {}
    held = prefill.inspect_handoff("h")  # its KV is held, the request has finished
    assert held is not None and held.source is not None


# --- RankMetrics against a real core and a per-token reference ------------------------------


@dataclass
class _Truth:
    """Per-request timelines recorded signal by signal: the slow, obvious way."""

    arrival: dict[str, float] = field(default_factory=dict)
    admitted: dict[str, float] = field(default_factory=dict)
    token_passes: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    prompt_tokens: int = 0


def run_core(
    core: Engine, metrics: RankMetrics, count: int, seed: int, *, prompt_max: int = 300
) -> _Truth:
    """Closed loop: requests arrive over time (some mid-run), every pass goes to `metrics`."""
    rng = random.Random(seed)
    truth = _Truth()
    prompts = {f"r{n}": rng.randrange(20, prompt_max) for n in range(count)}
    waiting = list(prompts)
    now = 0.0

    def arrive() -> None:
        request_id = waiting.pop(0)
        submit(core, metrics, request_id, prompts[request_id], rng.randrange(1, 40), at=now)
        truth.arrival[request_id] = now

    for _ in range(count // 2):
        arrive()
    while len(truth.finished) < count:
        if waiting and (core.is_empty() or rng.random() < 0.2):
            arrive()
        start = now
        result = core.execute_pass(now)
        now = result.end_ms
        for admission in result.admissions:
            truth.admitted.setdefault(admission.request_id, start)
        for output in result.request_outputs():
            if output.new_token_ids:
                truth.tokens += len(output.new_token_ids)
                passes = truth.token_passes.setdefault(output.request_id, [])
                if not passes or passes[-1] != now:
                    passes.append(now)
            if output.finish_reason is not None:
                truth.finished[output.request_id] = now
        metrics.on_pass(0, start, PassReport.of(result))
    truth.prompt_tokens = sum(prompts.values())
    return truth


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("plain", {}),
        ("preempting", {"num_gpu_blocks": 40}),
        ("mtp", {"aic_nextn": 2, "aic_nextn_accept_rates": "0.8,0.5"}),
        ("mtp-preempting", {"num_gpu_blocks": 40, "aic_nextn": 3}),
    ],
)
def test_real_core_passes_match_a_per_token_reference(name: str, args: dict[str, object]) -> None:
    core = make_core(**args)
    metrics = tally(core)
    # A fixed seed per case (str hash() changes between processes).
    truth = run_core(core, metrics, count=40, seed=zlib.crc32(name.encode()) % 1000)
    if "preempting" in name:
        assert core.metrics().preemptions_total > 0
    ttft, itl, e2e, queue = [], [], [], []
    for request_id, arrival in truth.arrival.items():
        passes = truth.token_passes[request_id]
        ttft.append(passes[0] - arrival)
        itl += [later - earlier for earlier, later in itertools.pairwise(passes)]
        e2e.append(truth.finished[request_id] - arrival)
        queue.append(truth.admitted[request_id] - arrival)
    assert_same(metrics.ttft, reference(ttft, TTFT_BUCKETS))
    assert_same(metrics.itl, reference(itl, ITL_BUCKETS))
    assert_same(metrics.e2e, reference(e2e, REQUEST_LATENCY_BUCKETS))
    assert_same(metrics.queue, reference(queue, REQUEST_LATENCY_BUCKETS))
    assert metrics.generation_tokens == truth.tokens
    assert metrics.prompt_tokens == truth.prompt_tokens
    assert metrics.finished == {"stop": 0, "length": 40, "abort": 0}
    assert metrics.requests == {}
    if "mtp" in name:
        assert metrics.itl.count < truth.tokens - 40  # one sample per burst, not per token


def test_latencies_are_modeled_time_at_any_speedup() -> None:
    """The core's clock is modelled time at any speedup (pacing is the loop's ModelClock),
    so the histograms of a core at speedup 4 are those of one at speedup 0, exactly."""
    sums = []
    for ratio in (0.0, 4.0):
        core = make_core(speedup_ratio=ratio, num_gpu_blocks=60)
        metrics = RankMetrics(0, gauges=core.metrics, now_ms=lambda: 0.0)
        run_core(core, metrics, count=20, seed=7)
        sums.append((metrics.ttft.sum, metrics.itl.sum, metrics.e2e.sum, metrics.itl.count))
    (ttft0, itl0, e2e0, n0), (ttft4, itl4, e2e4, n4) = sums
    assert n0 == n4
    assert (ttft4, itl4, e2e4) == (ttft0, itl0, e2e0)


# --- the collector ----------------------------------------------------------------------------


def test_collector_exposes_vllm_names_and_labels_per_rank() -> None:
    config = DaemonConfig(
        model_name="m", engine=EngineArgs(block_size=16, num_gpu_blocks=24, dp_size=2).normalized()
    )
    metrics = VllmMetrics.from_config(config)
    sinks = _Sinks()
    for dp_rank in range(2):
        core = Engine(config.engine, dp_rank=dp_rank)
        loop = EngineLoop(core, kv=sinks, fpm=sinks, delivery=sinks, model_clock=ModelClock(0.0))
        tallies = metrics.attach(loop)
        assert loop.pass_observers == [tallies.on_pass]
        assert loop.command_observers == [tallies.on_command]
        run_core(core, tallies, count=10 + dp_rank, seed=dp_rank)
    families = parse(generate_latest(metrics.registry).decode())
    assert set(families) == VLLM_NAMES
    for name, samples in families.items():
        for sample in samples:
            if name == "vllm:admission_rejections":  # the API server's, per model (as vLLM)
                assert set(sample.labels) == {"model_name", "reason"}
                continue
            assert sample.labels["engine"] in ("0", "1"), name
            if name != "vllm:cache_config_info":
                assert sample.labels["model_name"] == "m"
    success = families["vllm:request_success"]
    ttft = families["vllm:time_to_first_token_seconds"]
    for engine, done in (("0", 10), ("1", 11)):
        for reason, count in (("stop", 0), ("length", done), ("abort", 0)):
            got = value(
                success, "vllm:request_success_total", engine=engine, finished_reason=reason
            )
            assert got == count
        assert value(ttft, "vllm:time_to_first_token_seconds_count", engine=engine) == done
        assert (
            value(ttft, "vllm:time_to_first_token_seconds_bucket", engine=engine, le="+Inf") == done
        )
        preemptions = metrics.ranks[int(engine)].gauges().preemptions_total
        assert preemptions > 0
        got = value(families["vllm:num_preemptions"], "vllm:num_preemptions_total", engine=engine)
        assert got == preemptions
        running = families["vllm:num_requests_running"]
        assert value(running, "vllm:num_requests_running", engine=engine) == 0
    info = families["vllm:cache_config_info"]
    assert [s.labels["engine"] for s in info] == ["0", "1"]
    assert info[0].labels == {
        "block_size": "16",
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "engine": "0",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": "24",
        "num_gpu_blocks_override": "24",
    }
    assert all(s.value == 1.0 for s in info)


def test_offload_tiers_are_exposed_per_tier_and_state() -> None:
    """With G2/G3, `engined:kv_tier_blocks` reads the tier pools; the GPU gauge is unchanged."""
    engine = EngineArgs(
        block_size=16,
        num_gpu_blocks=24,
        num_g2_blocks=10,
        num_g3_blocks=30,
        kv_bytes_per_token=1000,
    ).normalized()
    config = DaemonConfig(model_name="m", engine=engine)
    metrics = VllmMetrics.from_config(config)
    sinks = _Sinks()
    core = Engine(config.engine)
    loop = EngineLoop(core, kv=sinks, fpm=sinks, delivery=sinks, model_clock=ModelClock(0.0))
    run_core(core, metrics.attach(loop), count=12, seed=3)
    gauges = core.metrics()
    assert gauges.g2_total_blocks == 10 and gauges.g3_total_blocks == 30
    assert gauges.g2_inactive_blocks > 0, "the workload evicts, so G2 receives blocks"
    families = parse(generate_latest(metrics.registry).decode())
    assert set(families) == VLLM_NAMES | {"engined:kv_tier_blocks"}
    tiers = families["engined:kv_tier_blocks"]
    for tier, active, inactive, total in (
        ("g2", gauges.g2_active_blocks, gauges.g2_inactive_blocks, 10),
        ("g3", gauges.g3_active_blocks, gauges.g3_inactive_blocks, 30),
    ):
        read = {
            state: value(tiers, "engined:kv_tier_blocks", engine="0", tier=tier, state=state)
            for state in ("active", "inactive", "free")
        }
        assert read == {"active": active, "inactive": inactive, "free": total - active - inactive}
    usage = value(families["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc", engine="0")
    assert usage == gauges.kv_cache_usage
    info = families["vllm:cache_config_info"]
    assert info[0].labels["num_cpu_blocks"] == "10"


def test_scrapes_at_every_await_point_see_no_phantom_aborts() -> None:
    """A scrape reads the tallies and the engine's gauges; it must never see a pass half
    observed, nor count an abort that did not happen.

    Paced, a pass awaits its deadline between running and publishing. Observers run before
    that await, so a scrape there finds the tallies already matching the engine.
    """

    async def scenario() -> None:
        engine = EngineArgs(block_size=16, num_gpu_blocks=24, speedup_ratio=100.0).normalized()
        metrics = VllmMetrics.from_config(DaemonConfig(engine=engine))
        sinks = _Sinks()
        loop = EngineLoop(
            Engine(engine), kv=sinks, fpm=sinks, delivery=sinks, model_clock=ModelClock(100.0)
        )
        tallies = metrics.attach(loop)
        runner = asyncio.create_task(loop.run())
        finished = asyncio.Event()

        async def scraper() -> int:
            scrapes = 0
            while not finished.is_set():
                generate_latest(metrics.registry)
                scrapes += 1
                await asyncio.sleep(0)  # yield to the loop: scrape at every await point
            return scrapes

        scraping = asyncio.create_task(scraper())
        await asyncio.gather(
            *(
                loop.call(Submit(Request(token_ids=list(range(n * 9, n * 9 + 100)), max_tokens=30)))
                for n in range(12)
            )
        )
        loop.stop()
        await runner
        finished.set()
        assert await scraping > 12
        assert tallies.finished == {"stop": 0, "length": 12, "abort": 0}
        assert tallies.gauges().preemptions_total > 0

    asyncio.run(asyncio.wait_for(scenario(), 60))


# --- the HTTP server --------------------------------------------------------------------------


class _Exploding(Collector):
    def collect(self) -> Iterator[object]:  # type: ignore[override]
        raise RuntimeError("collector bug")


@pytest.fixture
def served() -> Iterator[tuple[asyncio.AbstractEventLoop, HttpServer, list[HealthState]]]:
    """An HttpServer on an ephemeral port with a settable health state, on its own loop."""
    loop = asyncio.new_event_loop()
    registry = CollectorRegistry()
    metrics = VllmMetrics(model_name="m", cache_info={"block_size": "16"})
    registry.register(metrics)
    state: list[HealthState] = ["serving"]
    server = HttpServer(metrics.registry, health=lambda: state[0])
    loop.run_until_complete(server.start("127.0.0.1", 0))
    try:
        yield loop, server, state
    finally:
        loop.run_until_complete(server.close())
        loop.close()


def test_http_routes(
    served: tuple[asyncio.AbstractEventLoop, HttpServer, list[HealthState]],
) -> None:
    loop, server, state = served
    port = server.port

    async def scenario() -> None:
        metrics = await http_get(port, "/metrics")
        assert metrics.status == 200
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert int(metrics.headers["content-length"]) == len(metrics.body)
        assert "vllm:cache_config_info" in parse(metrics.body.decode())
        query = await http_get(port, "/metrics?name[]=x")
        assert query.status == 200
        # OpenMetrics when asked for, as prometheus_client's handlers (and vLLM) answer.
        om = await http_get(port, "/metrics", accept="application/openmetrics-text; version=1.0.0")
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert "vllm:cache_config_info" in {f.name for f in openmetrics_families(om.body.decode())}
        head = await http_get(port, "/metrics", method="HEAD")
        assert (head.status, head.body) == (200, b"")
        assert int(head.headers["content-length"]) > 0
        cases: tuple[tuple[HealthState, int], ...] = (
            ("starting", 503),
            ("serving", 200),
            ("draining", 503),
        )
        for health, status in cases:
            state[0] = health
            response = await http_get(port, "/health")
            assert response.status == status
            assert response.body == (b"ok\n" if status == 200 else f"{health}\n".encode())
        assert (await http_get(port, "/nope")).status == 404
        post = await http_get(port, "/metrics", method="POST")
        assert post.status == 405
        assert post.headers["allow"] == "GET, HEAD"

    loop.run_until_complete(asyncio.wait_for(scenario(), 30))


def test_http_refuses_garbage_and_keeps_serving(
    served: tuple[asyncio.AbstractEventLoop, HttpServer, list[HealthState]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop, server, _ = served
    port = server.port
    monkeypatch.setattr(http_module, "IO_TIMEOUT_S", 0.5)

    async def scenario() -> None:
        bad = [
            b"\x00\xff\xfe garbage\r\n\r\n",
            b"GET /metrics\r\n\r\n",
            b"GET /metrics HTTP/2\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"G(T /metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\n folded: header\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nX: \xff\r\n\r\n",
        ]
        for raw in bad:
            response = await http_raw(port, raw)
            assert response is not None and response.status == 400, raw
        # Cut short (the client half-closes), too large, and silent (timed out).
        cut = await http_raw(port, b"GET /metrics HTT", half_close=True)
        assert cut is not None and cut.status == 400
        large = await http_raw(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000)
        assert large is not None and large.status == 431
        silent = await http_raw(port, b"")
        assert silent is not None and silent.status == 408
        # A client that hangs up at once, and fifty at once.
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        responses = await asyncio.gather(*(http_get(port, "/health") for _ in range(50)))
        assert {r.status for r in responses} == {200}

    loop.run_until_complete(asyncio.wait_for(scenario(), 30))


def test_http_collector_failure_is_a_500_not_a_crash() -> None:
    async def scenario() -> None:
        registry = CollectorRegistry()
        registry.register(_Exploding())
        server = HttpServer(registry, health=lambda: "serving")
        await server.start("127.0.0.1", 0)
        try:
            assert (await http_get(server.port, "/metrics")).status == 500
            assert (await http_get(server.port, "/health")).status == 200
        finally:
            await server.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_daemon_health_states() -> None:
    async def scenario() -> None:
        daemon = Daemon(DaemonConfig())
        assert daemon.health() == "starting"
        daemon.started = True
        assert daemon.health() == "serving"

    asyncio.run(scenario())


# --- a live daemon ------------------------------------------------------------------------------


async def scrape(port: int) -> dict[str, list[Sample]]:
    response = await http_get(port, "/metrics")
    assert response.status == 200
    return parse(response.body.decode())


def total(families: dict[str, list[Sample]], family: str, sample: str, **labels: str) -> float:
    return sum(
        s.value for s in families[family] if s.name == sample and labels.items() <= s.labels.items()
    )


COUNTERS = (
    ("vllm:generation_tokens", "vllm:generation_tokens_total"),
    ("vllm:prompt_tokens", "vllm:prompt_tokens_total"),
    ("vllm:num_preemptions", "vllm:num_preemptions_total"),
    ("vllm:request_success", "vllm:request_success_total"),
    ("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total"),
    ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count"),
)


def test_live_scrape_under_load_matches_the_clients_tallies(tmp_path: Path) -> None:
    port = free_tcp_port()
    args = [
        "--speedup-ratio", "10", "--block-size", "16", "--num-gpu-blocks", "48",
        "--data-parallel-size", "2", "--nextn", "2", "--model-name", "metrics-test",
        "--http-port", str(port),
    ]  # fmt: skip
    rng = random.Random(5)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(60, 200))] for _ in range(24)]

    async def scenario(control: str) -> None:
        assert (await http_get(port, "/health")).status == 200
        async with await EngineClient.connect(control) as client:
            work = asyncio.gather(*(client.generate(p, 80, timeout=60) for p in prompts))
            # Scrape while the daemon works: every scrape parses, counters never go back.
            # Paced at speedup 10 the work takes about a second, so some scrapes land mid-run.
            previous: dict[str, float] = {}
            midway = 0
            while not work.done():
                families = await scrape(port)
                for family, sample in COUNTERS:
                    now = total(families, family, sample)
                    assert now >= previous.get(sample, 0.0), sample
                    previous[sample] = now
                done = total(families, "vllm:request_success", "vllm:request_success_total")
                midway += 0 < done < len(prompts)
                await asyncio.wait([work], timeout=0.01)
            generations: list[Generation] = await work
            assert midway > 0, "no scrape landed while requests were in flight"
            stats = await client.stats()
        families = await scrape(port)
        assert all(g.finish_reason == "length" for g in generations)
        preemptions = [r.preemptions_total for r in stats.ranks]
        assert sum(preemptions) > 0, "the pool is meant to be small enough to preempt"
        for rank in ("0", "1"):
            pairs = [
                (p, g) for p, g in zip(prompts, generations, strict=True) if g.dp_rank == int(rank)
            ]
            mine = [g for _, g in pairs]
            on = {"engine": rank, "model_name": "metrics-test"}
            assert total(
                families, "vllm:generation_tokens", "vllm:generation_tokens_total", **on
            ) == sum(len(g.token_ids) for g in mine)
            assert total(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **on) == sum(
                len(p) for p, _ in pairs
            )
            assert total(
                families, "vllm:request_success", "vllm:request_success_total",
                finished_reason="length", **on,
            ) == len(mine)  # fmt: skip
            assert (
                total(families, "vllm:num_preemptions", "vllm:num_preemptions_total", **on)
                == preemptions[int(rank)]
            )
            for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
                name = f"vllm:{histogram}_seconds"
                assert total(families, name, f"{name}_count", **on) == len(mine)
            # One inter-token sample per output entry after the first: an MTP burst is one.
            itl = "vllm:inter_token_latency_seconds"
            assert total(families, itl, f"{itl}_count", **on) == sum(
                g.num_outputs - 1 for g in mine
            )
            assert (
                total(families, "vllm:num_requests_running", "vllm:num_requests_running", **on) == 0
            )
        assert total(families, "vllm:request_success", "vllm:request_success_total") == len(prompts)
        hits = total(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        queries = total(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        assert queries > 0 and hits <= queries
        assert (await http_get(port, "/health")).status == 200

    with start_daemon(tmp_path, *args) as daemon:
        asyncio.run(asyncio.wait_for(scenario(daemon.control), 120))


def test_live_health_is_503_while_draining(tmp_path: Path) -> None:
    port = free_tcp_port()
    args = ["--speedup-ratio", "1", "--drain-timeout", "60", "--http-port", str(port)]

    async def scenario(control: str, terminate: Callable[[], None]) -> None:
        async with await EngineClient.connect(control) as client:
            assert (await http_get(port, "/health")).status == 200
            # A request that would take minutes of modeled decode keeps the drain going.
            stream = client.stream(list(range(64)), 100_000, timeout=30)
            await anext(stream)
            terminate()
            deadline = asyncio.get_running_loop().time() + 10
            while (await http_get(port, "/health")).status != 503:
                assert asyncio.get_running_loop().time() < deadline, "still healthy"
            assert (await http_get(port, "/health")).body == b"draining\n"
            families = await scrape(port)
            assert total(families, "vllm:num_requests_running", "vllm:num_requests_running") == 1

    # Leaving the context sends the second SIGTERM, which skips the drain (exit 0).
    with start_daemon(tmp_path, *args) as daemon:
        asyncio.run(asyncio.wait_for(scenario(daemon.control, daemon.proc.terminate), 60))


def test_live_http_port_in_use_is_a_startup_failure(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = DaemonProcess(tmp_path, ["--http-port", str(port)], None)
        try:
            assert daemon.proc.wait(30) == 3, daemon.log()
        finally:
            daemon.stop()
    assert "startup failed" in daemon.log_path.read_text()
