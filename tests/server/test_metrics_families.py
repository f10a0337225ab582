"""vLLM 0.33's families beyond the first fourteen: exact values after scripted workloads.

Each scenario drives a real core by hand, command by command and pass by pass at chosen
times, with the fixed perf model (a pass with a prefill costs 4 ms, one that emits tokens
10 ms, prefill tokens nothing), and feeds the tallies as the daemon's observers would: so every
latency is a known number of milliseconds and every count a known number of tokens. The
printed pass timelines in the comments are what the core does for these commands.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.samples import Sample

from engined.client import EngineClient, EngineError
from engined.config import DaemonConfig
from engined.core.args import EngineArgs, PerfModelKind, Semantics, WorkerType
from engined.core.command_report import CommandReport
from engined.core.engine import Engine
from engined.core.kv_residency import KvBlockEviction
from engined.core.pass_report import PassReport
from engined.core.types import (
    ActivateDestination,
    Cancel,
    Command,
    EndedRequest,
    FinishReason,
    Request,
    RequestOutput,
    ReserveDestination,
    Submit,
)
from engined.model_clock import ModelClock
from engined.server.ops.prometheus_families import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    KV_CACHE_RESIDENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
    LatencyHistogram,
    request_tokens_buckets,
)
from engined.server.ops.prometheus_metrics import VllmMetrics
from engined.server.ops.prometheus_rank import RankMetrics
from engined.server.ranks.engine_loop import EngineLoop
from tests.server.test_metrics import _Sinks, hand_pass, parse, value
from tests.server.test_rank_processes import config, run, serving
from tests.support import free_tcp_port

connect = EngineClient.connect

FIXED = {
    "block_size": 4,
    "num_gpu_blocks": 64,
    "speedup_ratio": 0.0,
    "perf_model": PerfModelKind.FIXED,
    "fixed_prefill_ms_per_token": 0.0,
    "fixed_pass_overhead_ms": 4.0,
    "fixed_decode_ms_per_pass": 10.0,
}


class Driver:
    """A core and its tallies, fed as EngineLoop's observers and the daemon's delivery do."""

    def __init__(self, metrics: VllmMetrics, **args: object) -> None:
        self.engine = EngineArgs(**{**FIXED, **args}).normalized()  # type: ignore[arg-type]
        self.core = Engine(self.engine)
        sinks = _Sinks()
        loop = EngineLoop(
            self.core, kv=sinks, fpm=sinks, delivery=sinks, model_clock=ModelClock(0.0)
        )
        self.metrics = metrics
        self.tallies = metrics.attach(loop)
        self.tallies._now_ms = lambda: self.now  # a command's end is the rank's clock
        self.now = 0.0

    def command(self, command: Command, at: float) -> None:
        self.now = at
        effects = self.core.apply(command, now_ms=at)
        self.tallies.on_command(0, at, command, CommandReport.of(effects))
        if effects.lifecycle_events:
            self.metrics.on_lifecycle(0, effects.lifecycle_events)

    def passes(self, count: int | None = None) -> None:
        """`count` passes, or until the core is empty."""
        done = 0
        while not self.core.is_empty() if count is None else done < count:
            result = self.core.execute_pass(self.now)
            self.tallies.on_pass(0, self.now, PassReport.of(result))
            if result.lifecycle_events:
                self.metrics.on_lifecycle(0, result.lifecycle_events)
            self.now = result.end_ms
            done += 1


def metrics_for(**engine: object) -> VllmMetrics:
    args = EngineArgs(**{**FIXED, **engine}).normalized()  # type: ignore[arg-type]
    return VllmMetrics.from_config(DaemonConfig(model_name="m", engine=args))


def submit(request_id: str, prompt: Iterable[int], max_tokens: int) -> Submit:
    return Submit(Request(token_ids=list(prompt), max_tokens=max_tokens, request_id=request_id))


def filled(bounds: tuple[float, ...], samples_ms: Iterable[float]) -> LatencyHistogram:
    histogram = LatencyHistogram(bounds)
    for sample in samples_ms:
        histogram.add(sample / 1000.0)
    return histogram


def counts(bounds: tuple[float, ...], samples: Iterable[float]) -> LatencyHistogram:
    histogram = LatencyHistogram(bounds)
    for sample in samples:
        histogram.add(sample)
    return histogram


def same(histogram: LatencyHistogram, expected: LatencyHistogram) -> None:
    assert histogram.counts == expected.counts
    assert histogram.count == expected.count
    assert histogram.sum == pytest.approx(expected.sum, rel=1e-12, abs=1e-15)


# --- buckets -----------------------------------------------------------------------------------


def test_buckets_are_vllm_033s() -> None:
    """Written out from vllm/v1/metrics/buckets.py."""
    assert TTFT_BUCKETS == (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
        2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    )  # fmt: skip
    assert ITL_BUCKETS == (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
        1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    )  # fmt: skip
    assert REQUEST_LATENCY_BUCKETS == (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
        40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
    )  # fmt: skip
    assert ITERATION_TOKENS_BUCKETS == (
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
    )  # fmt: skip
    assert REQUEST_PARAMS_N_BUCKETS == (1, 2, 5, 10, 20)
    assert REQUEST_NUM_PREEMPTIONS_BUCKETS == (1, 2, 3, 4, 5, 10, 20)
    assert KV_CACHE_RESIDENCY_BUCKETS == (
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30,
        60, 120, 300, 600, 1200, 1800,
    )  # fmt: skip
    # `build_1_2_5_buckets(max_model_len)`, its docstring's example among them.
    assert request_tokens_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert request_tokens_buckets(64) == (1, 2, 5, 10, 20, 50)
    assert request_tokens_buckets(1) == (1,)
    assert request_tokens_buckets(40960)[-3:] == (5000, 10000, 20000)


def test_every_histogram_is_exposed_with_vllms_buckets() -> None:
    """The `le` labels of each family in a scrape, against vLLM's boundaries; the token
    families run to max_model_len (64 here: 16 blocks of 4)."""
    metrics = metrics_for(num_gpu_blocks=16, kv_cache_metrics=True)
    Driver(metrics)
    families = parse(generate_latest(metrics.registry).decode())
    expected = {
        "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
        "vllm:inter_token_latency_seconds": ITL_BUCKETS,
        "vllm:request_time_per_output_token_seconds": ITL_BUCKETS,
        "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
        "vllm:request_params_n": REQUEST_PARAMS_N_BUCKETS,
        "vllm:request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
        **dict.fromkeys(
            (
                "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds",
                "vllm:request_inference_time_seconds",
                "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds",
            ),
            REQUEST_LATENCY_BUCKETS,
        ),
        **dict.fromkeys(
            (
                "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens",
                "vllm:request_max_num_generation_tokens",
                "vllm:request_params_max_tokens",
                "vllm:request_prefill_kv_computed_tokens",
            ),
            (1, 2, 5, 10, 20, 50),
        ),
        **dict.fromkeys(
            (
                "vllm:kv_block_lifetime_seconds",
                "vllm:kv_block_idle_before_evict_seconds",
                "vllm:kv_block_reuse_gap_seconds",
            ),
            KV_CACHE_RESIDENCY_BUCKETS,
        ),
    }
    histograms = {name for name, samples in families.items() if name + "_bucket" in {
        s.name for s in samples
    }}  # fmt: skip
    assert histograms == set(expected)
    for name, bounds in expected.items():
        les = [s.labels["le"] for s in families[name] if s.name == f"{name}_bucket"]
        assert les == [*(str(float(b)) for b in bounds), "+Inf"], name


# --- request phases, token counts, parameters ----------------------------------------------------


def test_phases_tokens_and_parameters_of_a_scripted_workload() -> None:
    """One running request at a time (max_num_seqs 1). Passes, from the core:

    a (8 tokens, max 3) and b (8 tokens sharing a's first block, max 2) arrive at 0.
      [0-14] a admitted, first token   [14-24] a   [24-34] a finishes
      [34-48] b admitted (4 cached), first token   [48-58] b finishes
    c (6 tokens, max 5) arrives at 100: [100-114] first token, [114-124], [124-134];
    cancelled at 134 with 3 tokens.
    """
    metrics = metrics_for(max_num_seqs=1, enable_prefix_caching=True, max_model_len=64)
    run = Driver(metrics, max_num_seqs=1, enable_prefix_caching=True, max_model_len=64)
    run.command(submit("a", range(8), 3), 0.0)
    run.command(submit("b", [0, 1, 2, 3, 100, 101, 102, 103], 2), 0.0)
    run.passes()
    run.now = 100.0
    run.command(submit("c", range(50, 56), 5), 100.0)
    run.passes(3)
    run.command(Cancel("c"), run.now)
    t = run.tallies
    assert run.now == 134.0 and t.requests == {}

    same(t.ttft, filled(TTFT_BUCKETS, [14, 48, 14]))
    same(t.itl, filled(ITL_BUCKETS, [10, 10, 10, 10, 10]))
    same(t.e2e, filled(REQUEST_LATENCY_BUCKETS, [34, 58, 34]))
    same(t.queue, filled(REQUEST_LATENCY_BUCKETS, [0, 34, 0]))
    same(t.prefill, filled(REQUEST_LATENCY_BUCKETS, [14, 14, 14]))
    same(t.decode, filled(REQUEST_LATENCY_BUCKETS, [20, 10, 20]))
    same(t.inference, filled(REQUEST_LATENCY_BUCKETS, [34, 24, 34]))
    same(t.tpot, filled(ITL_BUCKETS, [10, 10, 10]))
    tokens = request_tokens_buckets(64)
    same(t.request_prompt, counts(tokens, [8, 8, 6]))
    same(t.request_generation, counts(tokens, [3, 2, 3]))
    same(t.max_generation, counts(tokens, [3, 2, 3]))
    same(t.params_max_tokens, counts(tokens, [3, 2, 5]))
    same(t.params_n, counts(REQUEST_PARAMS_N_BUCKETS, [1, 1, 1]))
    same(t.preemptions, counts(REQUEST_NUM_PREEMPTIONS_BUCKETS, [0, 0, 0]))
    same(t.prefill_computed, counts(tokens, [8, 4, 6]))
    # Per pass with outputs: prompt tokens computed for first tokens, plus tokens emitted.
    same(t.iteration, counts(ITERATION_TOKENS_BUCKETS, [8 + 1, 1, 1, 4 + 1, 1, 6 + 1, 1, 1]))
    assert t.finished == {"stop": 0, "length": 2, "abort": 1}
    assert (t.prompt_tokens, t.prompt_by_source) == (22, [18, 4, 0])
    assert (t.prefix_cache_queries, t.prefix_cache_hits, t.cached_by_source) == (
        22,
        4,
        [4, 0, 0, 0, 0],
    )
    assert (t.external_queries, t.external_hits) == (0, 0)


def test_a_preempted_request_counts_its_preemption_and_every_token() -> None:
    """A pool of 4 blocks of 4 tokens, p and q (4 tokens, max 8 each) at 0. From the core:
    both emit at 14, 24, 34, 44, 54; q is preempted in [54-64]; p finishes at 84; q is
    re-admitted at 84 (4 tokens cached) and emits at 94, 104, 114."""
    metrics = metrics_for(num_gpu_blocks=5)
    run = Driver(metrics, num_gpu_blocks=5)
    run.command(submit("p", range(4), 8), 0.0)
    run.command(submit("q", range(10, 14), 8), 0.0)
    run.passes()
    t = run.tallies
    assert run.core.metrics().preemptions_total == 1
    same(t.preemptions, counts(REQUEST_NUM_PREEMPTIONS_BUCKETS, [0, 1]))
    same(t.request_generation, counts(t.request_generation.bounds, [8, 8]))
    same(t.decode, filled(REQUEST_LATENCY_BUCKETS, [70, 100]))
    same(t.tpot, filled(ITL_BUCKETS, [10, 100 / 7]))
    # q's gap across its preemption is one inter-token sample: 94 - 54.
    same(t.itl, filled(ITL_BUCKETS, [10] * 4 + [10] * 7 + [40, 10, 10]))
    assert t.generation_tokens == 16


def test_stop_is_a_success_reason_of_its_own() -> None:
    """The core's `stop` (stop tokens, another part of issue 22) counts as vLLM's stop."""
    metrics = metrics_for()
    run = Driver(metrics)
    run.command(submit("s", range(8), 9), 0.0)
    result = hand_pass(run.core, 12.0, [RequestOutput("s", [7], FinishReason.LENGTH)], ("s",))
    stopped = [EndedRequest("s", "stop")]  # type: ignore[arg-type]
    run.tallies.on_pass(0, 0.0, msgspec.structs.replace(result, ended=stopped))
    assert run.tallies.finished == {"stop": 1, "length": 0, "abort": 0}
    text = generate_latest(metrics.registry).decode()
    for reason, count in (
        ("stop", 1),
        ("length", 0),
        ("abort", 0),
        ("error", 0),
        ("repetition", 0),
    ):
        labels = {"engine": "0", "finished_reason": reason}
        assert (
            value(parse(text)["vllm:request_success"], "vllm:request_success_total", **labels)
            == count
        )


# --- P/D destinations, waiting reasons ---------------------------------------------------------


def test_a_destination_prompt_arrives_by_transfer() -> None:
    """A decode worker, 10-token prompts of 4-token blocks. d1's prompt is all transferred
    (its `DestinationReserved` says 12 tokens: 3 blocks); d2's, the same prompt after d1 ran,
    finds its first 2 blocks cached and has 4 tokens (1 block) transferred."""
    metrics = metrics_for(worker_type=WorkerType.DECODE, enable_prefix_caching=True)
    run = Driver(metrics, worker_type=WorkerType.DECODE, enable_prefix_caching=True)

    def gauges() -> dict[str, float]:
        families = parse(generate_latest(metrics.registry).decode())
        read = {
            f"waiting_{reason}": value(
                families["vllm:num_requests_waiting_by_reason"],
                "vllm:num_requests_waiting_by_reason",
                reason=reason,
            )
            for reason in ("capacity", "deferred")
        }
        for stage in ("waiting_to_start", "in_progress", "completed_waiting"):
            read[stage] = value(
                families["vllm:num_requests_kv_fetch_by_stage"],
                "vllm:num_requests_kv_fetch_by_stage",
                stage=stage,
            )
        return read

    idle = dict.fromkeys(
        ("waiting_capacity", "waiting_deferred", "waiting_to_start", "in_progress"), 0.0
    )
    prompt = list(range(10))
    run.command(ReserveDestination("h1", Request(token_ids=prompt, max_tokens=2)), 0.0)
    assert gauges() == {
        **idle,
        "waiting_deferred": 1.0,
        "in_progress": 1.0,
        "completed_waiting": 0.0,
    }
    run.command(ActivateDestination("h1"), 1.0)
    assert gauges() == {**idle, "waiting_capacity": 1.0, "completed_waiting": 1.0}
    run.passes()
    assert gauges() == {**idle, "completed_waiting": 0.0}
    run.command(ReserveDestination("h2", Request(token_ids=prompt, max_tokens=2)), 50.0)
    run.command(ActivateDestination("h2"), 51.0)
    run.passes()
    t = run.tallies
    assert t.prompt_by_source == [0, 8, 12]
    assert (t.external_queries, t.external_hits, t.cached_by_source) == (12, 12, [0, 0, 12, 0, 0])
    same(t.prefill_computed, counts(t.prefill_computed.bounds, [0, 0]))
    # Admitted at the pass starting 1 ms (51 ms) after arrival, first token 10 ms later.
    same(t.queue, filled(REQUEST_LATENCY_BUCKETS, [1, 1]))
    same(t.prefill, filled(REQUEST_LATENCY_BUCKETS, [10, 10]))
    same(t.iteration, counts(ITERATION_TOKENS_BUCKETS, [1, 1, 1, 1]))
    families = parse(generate_latest(metrics.registry).decode())
    assert value(families["vllm:prompt_tokens_cached"], "vllm:prompt_tokens_cached_total") == 20


# --- spec decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("semantics", "stats", "iteration"),
    [
        # vLLM's: the first token verifies nothing; each later step a draft of 2, 1 accepted.
        (Semantics.VLLM, (2, 4, 2, [2, 0]), [8 + 1, 2, 2]),
        # The mocker's: every burst a draft of 2 (the first too), 2 tokens, capped at the end.
        (Semantics.MOCKER_1_3_0, (3, 6, 2, [2, 0]), [8 + 2, 2, 1]),
    ],
)
def test_mtp_bursts_are_drafts_with_accepted_positions(
    semantics: Semantics, stats: tuple[int, int, int, list[int]], iteration: list[int]
) -> None:
    """MTP with 2 draft tokens, the first always accepted and the second never: each step
    that verifies drafts emits 2 tokens, capped by what is left. An 8-token prompt, max 5."""
    mtp = {"aic_nextn": 2, "aic_nextn_accept_rates": "1,0", "semantics": semantics}
    metrics = metrics_for(**mtp)
    run = Driver(metrics, **mtp)
    run.command(submit("m", range(8), 5), 0.0)
    run.passes()
    t = run.tallies
    assert (t.drafts, t.draft_tokens, t.accepted, t.accepted_per_pos) == stats
    same(t.request_generation, counts(t.request_generation.bounds, [5]))
    same(t.itl, filled(ITL_BUCKETS, [10, 10]))
    same(t.tpot, filled(ITL_BUCKETS, [20 / 4]))
    same(t.iteration, counts(ITERATION_TOKENS_BUCKETS, iteration))
    families = parse(generate_latest(metrics.registry).decode())
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"]
    reads = [
        value(per_pos, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p)
        for p in ("0", "1")
    ]
    assert reads == [2.0, 0.0]
    drafts, draft_tokens, accepted, _ = stats
    for name, count in (
        ("num_drafts", drafts),
        ("num_draft_tokens", draft_tokens),
        ("num_accepted_tokens", accepted),
    ):
        family = f"vllm:spec_decode_{name}"
        assert value(families[family], f"{family}_total") == count


def test_drafts_a_stop_cuts_count_as_accepted() -> None:
    """vLLM counts what the model accepted before `max_tokens` cuts the tokens: an 8-token
    prompt, max 3, every draft accepted; the second step accepts both drafts, of whose
    tokens one is emitted."""
    mtp = {"aic_nextn": 2, "aic_nextn_accept_rates": "1,1"}
    metrics = metrics_for(**mtp)
    run = Driver(metrics, **mtp)
    run.command(submit("m", range(8), 3), 0.0)
    run.passes()
    t = run.tallies
    assert (t.drafts, t.draft_tokens, t.accepted, t.accepted_per_pos) == (1, 2, 2, [1, 1])
    same(t.request_generation, counts(t.request_generation.bounds, [3]))


def test_without_mtp_there_is_no_spec_decode_family() -> None:
    metrics = metrics_for()
    Driver(metrics)
    assert not any(
        "spec_decode" in name for name in parse(generate_latest(metrics.registry).decode())
    )
    prefill = metrics_for(worker_type=WorkerType.PREFILL, aic_nextn=2)
    assert prefill.spec_tokens == 0  # a prefill worker drafts nothing


# --- KV block residency -----------------------------------------------------------------------


def test_residency_samples_become_modeled_seconds() -> None:
    """The core's milliseconds are modelled ones at any speedup (here 4): seconds / 1000."""
    core = Engine(EngineArgs(block_size=4, num_gpu_blocks=8, speedup_ratio=4.0).normalized())
    tallies = RankMetrics(0, gauges=core.metrics, now_ms=lambda: 0.0)
    result = hand_pass(core, 10.0, [])
    evictions = [KvBlockEviction(200.0, 80.0, (4.0, 8.0)), KvBlockEviction(12.0, 12.0, ())]
    tallies.on_pass(0, 0.0, msgspec.structs.replace(result, kv_block_evictions=evictions))
    same(tallies.block_lifetime, counts(KV_CACHE_RESIDENCY_BUCKETS, [0.2, 0.012]))
    same(tallies.block_idle, counts(KV_CACHE_RESIDENCY_BUCKETS, [0.08, 0.012]))
    same(tallies.block_reuse_gap, counts(KV_CACHE_RESIDENCY_BUCKETS, [0.004, 0.008]))


def test_residency_families_follow_kv_cache_metrics() -> None:
    """Exposed with the setting (from a live core: one eviction 200 ms after allocation),
    absent without it, as in vLLM."""
    metrics = metrics_for(num_gpu_blocks=3, enable_prefix_caching=True, kv_cache_metrics=True,
                          kv_cache_metrics_sample=1.0)  # fmt: skip
    run = Driver(
        metrics, num_gpu_blocks=3, enable_prefix_caching=True, kv_cache_metrics=True,
        kv_cache_metrics_sample=1.0,
    )  # fmt: skip
    for n, start in enumerate((0.0, 100.0, 200.0)):
        run.now = start
        run.command(submit(f"r{n}", range(10 * n, 10 * n + 4), 1), start)
        run.passes()
    same(run.tallies.block_lifetime, counts(KV_CACHE_RESIDENCY_BUCKETS, [0.2]))
    families = parse(generate_latest(metrics.registry).decode())
    lifetime = families["vllm:kv_block_lifetime_seconds"]
    assert value(lifetime, "vllm:kv_block_lifetime_seconds_sum") == 0.2
    off = metrics_for()
    Driver(off)
    assert not any("kv_block" in name for name in parse(generate_latest(off.registry).decode()))


def test_the_always_present_gauges_of_an_idle_rank() -> None:
    metrics = metrics_for()
    Driver(metrics)
    families = parse(generate_latest(metrics.registry).decode())
    sleep = families["vllm:engine_sleep_state"]
    states = {s.labels["sleep_state"]: s.value for s in sleep}
    assert states == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    rejections = families["vllm:admission_rejections"]
    assert {s.labels["reason"]: s.value for s in rejections} == {
        "max_num_queued_reqs": 0.0,
        "max_num_queued_tokens": 0.0,
    }
    assert "vllm:num_requests_kv_fetch_by_stage" not in families  # not a P/D destination


# --- a live daemon ----------------------------------------------------------------------------


def test_live_destinations_and_residency_in_process_and_in_workers(tmp_path: Path) -> None:
    """A decode daemon of 2 ranks, in its own loop and then in 2 worker processes: on rank
    1, d1's 40-token prompt is all transferred, d2's (the same prompt) finds 32 tokens
    cached, and three more prompts overflow the 7-block pool, so blocks are evicted. The
    transfer figures are exact; the residency histograms are the same both ways (the samples
    cross the worker's frames) and not empty."""
    shared = list(range(40))
    prompts = [shared, shared, *([n * 100 + i for i in range(40)] for n in range(1, 4))]

    async def scenario(processes: int) -> dict[str, list[Sample]]:
        path = tmp_path / str(processes)
        path.mkdir()
        cfg = config(
            path,
            2,
            http_port=free_tcp_port(),
            **{
                "engine.worker_type": "decode",
                "engine.num_gpu_blocks": 8,
                "engine.kv_cache_metrics": True,
                "engine.kv_cache_metrics_sample": 1.0,
            },
        )
        async with serving(cfg, processes) as running, await connect(running.endpoint) as c:
            for n, tokens in enumerate(prompts):
                handoff = f"h{n}"
                accepted = await c.reserve_destination(handoff, tokens, 3, dp_rank=1)
                await c.next_lifecycle(handoff, timeout=20)
                await c.activate_destination(handoff)
                assert len((await c.collect(accepted, timeout=20)).token_ids) == 3
            await c.wait_idle(timeout=20)
            return parse((await c.metrics()).text)

    def residency(families: dict[str, list[Sample]]) -> list[tuple[str, str | None, float]]:
        return [
            (s.name, s.labels.get("le"), s.value)
            for family in ("lifetime", "idle_before_evict", "reuse_gap")
            for s in families[f"vllm:kv_block_{family}_seconds"]
            if s.labels["engine"] == "1"
        ]

    in_process, in_workers = run(scenario(0)), run(scenario(2))
    assert residency(in_process) == residency(in_workers)
    for families in (in_process, in_workers):
        on = {"engine": "1"}
        by_source = families["vllm:prompt_tokens_by_source"]
        name = "vllm:prompt_tokens_by_source_total"
        assert value(by_source, name, source="external_kv_transfer", **on) == 40 + 8 + 3 * 40
        assert value(by_source, name, source="local_cache_hit", **on) == 32
        assert value(by_source, name, source="local_compute", **on) == 0
        hits = families["vllm:external_prefix_cache_hits"]
        assert value(hits, "vllm:external_prefix_cache_hits_total", **on) == 168
        cached = families["vllm:prompt_tokens_cached_by_source"]
        assert value(cached, "vllm:prompt_tokens_cached_by_source_total", source="p2p", **on) == 168
        stages = families["vllm:num_requests_kv_fetch_by_stage"]
        assert {s.value for s in stages} == {0.0}
        lifetime = families["vllm:kv_block_lifetime_seconds"]
        # A slot handed out again ends its block's sample: d2's fresh block (d1's partial
        # one, freed to the front), d3's and d4's first (the previous partial one), and
        # d5's three (a partial one, then d1's two cached blocks, the oldest freed).
        assert value(lifetime, "vllm:kv_block_lifetime_seconds_count", **on) == 6


def test_live_queue_refusals_are_admission_rejections(tmp_path: Path) -> None:
    """One request decoding (paced: 10 ms a token, 1,000 tokens), one waiting behind it
    (max_num_seqs 1), and `max_queued_requests` 1: a third submit is refused `overloaded`,
    and counted as vLLM counts a `--max-num-queued-reqs` refusal."""
    cfg = config(
        tmp_path,
        1,
        http_port=free_tcp_port(),
        max_queued_requests=1,
        **{
            "engine.speedup_ratio": 1,
            "engine.max_num_seqs": 1,
            "engine.perf_model": "fixed",
        },
    )

    async def scenario() -> None:
        async with serving(cfg, 0) as running, await connect(running.endpoint) as c:
            first = await c.submit(list(range(16)), 1000)
            await anext(c.outputs(first.request_id, timeout=20))  # running
            second = await c.submit(list(range(100, 116)), 5)
            with pytest.raises(EngineError) as refused:
                await c.submit(list(range(200, 216)), 5)
            assert refused.value.code == "overloaded"
            rejections = parse((await c.metrics()).text)["vllm:admission_rejections"]
            assert {s.labels["reason"]: s.value for s in rejections} == {
                "max_num_queued_reqs": 1.0,
                "max_num_queued_tokens": 0.0,
            }
            waiting = parse((await c.metrics()).text)["vllm:num_requests_waiting_by_reason"]
            assert {s.labels["reason"]: s.value for s in waiting} == {
                "capacity": 1.0,
                "deferred": 0.0,
            }
            for request in (first, second):
                await c.cancel(request.request_id)

    run(scenario())
