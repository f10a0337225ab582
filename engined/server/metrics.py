"""Prometheus metrics under vLLM's names: dashboards and routers built for vLLM read us unchanged.

Every series carries the labels vLLM gives it: `model_name` (the served model name) and `engine`
(the data-parallel rank, as vLLM labels its engine cores), plus `finished_reason` on
`vllm:request_success_total`. Names, label names, help texts and histogram buckets follow
vLLM's `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`).

Cost is the design constraint: a daemon at speedup 0 emits ~300k tokens/s, so nothing here runs
per token in Python. Each rank's `RankMetrics` is fed once per engine pass (an `EngineLoop` pass
observer) and once per command (a command observer, for arrival times and cancels):

* counters are plain ints bumped by per-pass totals (`PassResult.accept_length_output_tokens`,
  `prefix_cache_queries/hits`);
* inter-token latency: a request that emitted in the previous emitting pass and emits again
  has waited exactly `end_ms - previous end_ms`, the same value for all of them, so the whole
  cohort is one `add(value, count)`. Membership is found with C-level set operations; only
  requests new to the cohort (first token, resumed after preemption) get Python-level work;
* histograms are bucket counts in plain lists (`LatencyHistogram`), because prometheus_client's
  `Histogram` has no observe-with-count. The collector turns them into `HistogramMetricFamily`
  at scrape time;
* gauges and `vllm:num_preemptions_total` are read from the engines' `metrics()` at scrape
  time, so scraping adds no work to passes;
* a request's record ends when a result says it ended: `PassResult.ended` (finished,
  rejected) or `CommandEffects.ended` (cancelled by any path, since every path that ends a
  request early is a command the loop applies and observes).

Latencies are modeled time. The core's millisecond clock is modeled time at speedup 0
(virtual clock); at speedup ratio r > 0 the core's times are wall time (modeled durations
divided by r), so they are multiplied back by r: the histograms show what the modeled engine
would have shown, whatever the pacing.

Like vLLM's `IterationStats` / `FinishedRequestStats`: TTFT is arrival to first token, ITL one
sample per request per step that emitted tokens (an MTP burst is one step, so one sample, as in
vLLM with speculative decoding), prompt tokens are counted when the first token is emitted,
and queue time (arrival to first scheduling), e2e latency (arrival to finish) and
`request_success_total` are recorded when the request finishes. Arrival is when the rank
received the request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from engined.core.types import (
    Command,
    CommandEffects,
    DestinationAccepted,
    EngineMetrics,
    FinishReason,
    PassResult,
    ReserveDestination,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
)
from engined.server.publisher_metrics import PublisherMetrics, WatchedPublisher

if TYPE_CHECKING:
    from engined.config import DaemonConfig
    from engined.server.rank_handle import RankHandle

# Bucket boundaries (seconds) of vLLM's PrometheusStatLogger, vllm/v1/metrics/loggers.py:
# `vllm:time_to_first_token_seconds` (22 boundaries),
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# `vllm:inter_token_latency_seconds` (the buckets of `time_per_output_token_seconds`, 19),
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# and `request_latency_buckets`, shared by `vllm:e2e_request_latency_seconds` and
# `vllm:request_queue_time_seconds` (21).
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# vLLM's v1 `FinishReason` values, each exposed from the start (at 0) as vLLM pre-creates them.
# Ours map onto them: "stop" and "length" are themselves; "rejected" and "cancelled" are
# vLLM's "abort".
FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort")

LABELS: tuple[str, str] = ("model_name", "engine")

# How prometheus_client's own Histogram spells `le` ("0.001", "1.0"); typed here, untyped there.
_go_float: Callable[[float], str] = floatToGoString


class LatencyHistogram:
    """A Prometheus histogram as plain bucket counts, filled with `add(value, count)`.

    Exists because `prometheus_client.Histogram.observe` takes one sample per call (under a
    lock), and a pass wants to add "N requests waited X seconds" in one step.
    """

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds: tuple[float, ...] = tuple(bounds)
        # counts[i]: samples in (bounds[i-1], bounds[i]]; the last slot is (bounds[-1], +Inf).
        self.counts: list[int] = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def add(self, value: float, count: int = 1) -> None:
        """Record `count` samples equal to `value` (le semantics: value <= bound)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.count += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, float]]:
        """Buckets as the exposition wants them: (le, cumulative count), ending with +Inf."""
        les = [_go_float(b) for b in self.bounds] + ["+Inf"]
        return list(zip(les, map(float, accumulate(self.counts)), strict=True))


class _Request:
    """What latencies need of one live request; times are core milliseconds."""

    __slots__ = ("admitted_ms", "arrival_ms", "first_ms", "last_ms", "prompt_len")

    def __init__(self, arrival_ms: float, prompt_len: int) -> None:
        self.arrival_ms = arrival_ms
        self.prompt_len = prompt_len
        self.admitted_ms: float | None = None
        self.first_ms: float | None = None
        # End of the pass of its latest token; only kept up to date once the request leaves
        # the emitting cohort (while in it, its latest token is at the cohort's end).
        self.last_ms = 0.0


class RankMetrics:
    """Tallies of one rank, fed by its EngineLoop's observers, read by the collector.

    Args:
        rank: the data-parallel rank (the `engine` label).
        gauges: the rank's engine gauges now (`Engine.metrics`), read at scrape time.
        now_ms: the rank's clock (`EngineLoop.now_ms`), for requests a command ended.
        seconds_per_ms: modeled seconds per core millisecond (`modeled_seconds_per_ms`).
    """

    def __init__(
        self,
        rank: int,
        *,
        gauges: Callable[[], EngineMetrics],
        now_ms: Callable[[], float],
        seconds_per_ms: float,
    ) -> None:
        self.rank = rank
        self.gauges = gauges
        self._now_ms = now_ms
        self._scale = seconds_per_ms
        self.requests: dict[str, _Request] = {}
        # Requests that emitted a token in the latest pass that emitted any, and its end;
        # a request leaves it when it finishes (so a reused id starts afresh).
        self._cohort: set[str] = set()
        self._cohort_end_ms = 0.0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = LatencyHistogram(TTFT_BUCKETS)
        self.itl = LatencyHistogram(ITL_BUCKETS)
        self.e2e = LatencyHistogram(REQUEST_LATENCY_BUCKETS)
        self.queue = LatencyHistogram(REQUEST_LATENCY_BUCKETS)

    # --- observers ----------------------------------------------------------------------

    def on_command(
        self, rank: int, arrival_ms: float, command: Command, effects: CommandEffects
    ) -> None:
        """A command was applied: a new request starts its clock; a dropped one ends."""
        result = effects.result
        if isinstance(result, Submitted | DestinationAccepted) and isinstance(
            command, Submit | SubmitHandoffPrefill | ReserveDestination
        ):
            self.requests[result.request_id] = _Request(arrival_ms, len(command.request.token_ids))
        if effects.ended:
            now_ms = self._now_ms()
            for ended in effects.ended:
                self._finish(ended.request_id, now_ms, "abort")

    def on_pass(self, rank: int, now_ms: float, result: PassResult) -> None:
        """Fold one pass in: per-pass totals, and per-request work only where it is unavoidable."""
        self.generation_tokens += result.accept_length_output_tokens
        self.prefix_cache_queries += result.prefix_cache_queries
        self.prefix_cache_hits += result.prefix_cache_hits
        requests = self.requests
        for admission in result.admissions:
            record = requests.get(admission.request_id)
            if record is not None and record.admitted_ms is None:
                record.admitted_ms = now_ms  # vLLM's scheduled_ts: the step that scheduled it
        end_ms = result.end_ms
        outputs = result.outputs
        decoded = result.decodes.request_ids
        if outputs or decoded:
            # NOTE: a comprehension, not map(attrgetter): twice as fast on 3.11 for msgspec
            # Structs (specialised attribute loads). A token-less output (rejected, or
            # max_tokens 0) has no latency.
            emitters = {out.request_id for out in outputs if out.new_token_ids}
            emitters.update(decoded)
            if emitters:
                self._emitted(emitters, end_ms)
        for ended in result.ended:
            request_id = ended.request_id
            reason = ended.reason
            finished = reason is FinishReason.LENGTH or reason is FinishReason.STOP
            record = requests.get(request_id)
            if record is not None and record.first_ms is None and finished:
                self.prompt_tokens += record.prompt_len  # prefilled, finished tokenless
            self._finish(request_id, end_ms, reason.value if finished else "abort")

    def _emitted(self, emitters: set[str], end_ms: float) -> None:
        """Latencies of the requests that emitted tokens in a pass ending at `end_ms`."""
        scale = self._scale
        cohort = self._cohort
        previous_end = self._cohort_end_ms
        joined = emitters - cohort if cohort else emitters
        continuing = len(emitters) - len(joined)
        if continuing:
            self.itl.add((end_ms - previous_end) * scale, continuing)
        requests = self.requests
        if continuing < len(cohort):
            # Someone paused (preempted, or out of budget): remember when it last emitted.
            for request_id in cohort - emitters:
                record = requests.get(request_id)
                if record is not None:
                    record.last_ms = previous_end
        for request_id in joined:
            record = requests.get(request_id)
            if record is None:
                continue
            if record.first_ms is None:
                record.first_ms = end_ms
                self.ttft.add((end_ms - record.arrival_ms) * scale)
                self.prompt_tokens += record.prompt_len
            else:
                self.itl.add((end_ms - record.last_ms) * scale)
        self._cohort = emitters
        self._cohort_end_ms = end_ms

    def _finish(self, request_id: str, end_ms: float, reason: str) -> None:
        self._cohort.discard(request_id)
        record = self.requests.pop(request_id, None)
        if record is None:
            return
        self.finished[reason] += 1
        scale = self._scale
        self.e2e.add((end_ms - record.arrival_ms) * scale)
        if record.admitted_ms is not None:
            self.queue.add((record.admitted_ms - record.arrival_ms) * scale)


def _tier_blocks(
    labels: list[tuple[RankMetrics, list[str]]], gauges: Mapping[int, EngineMetrics]
) -> GaugeMetricFamily:
    """`engined:kv_tier_blocks{tier, state}`: blocks of the offload tiers (engined's own name;
    vLLM has no such series). `vllm:kv_cache_usage_perc` stays the GPU pool's."""
    family = GaugeMetricFamily(
        "engined:kv_tier_blocks",
        "KV blocks of the offload tiers (g2: host memory, g3: disk) by state.",
        labels=(*LABELS, "tier", "state"),
    )
    for rank, values in labels:
        g = gauges[rank.rank]
        for tier, active, inactive, total in (
            ("g2", g.g2_active_blocks, g.g2_inactive_blocks, g.g2_total_blocks),
            ("g3", g.g3_active_blocks, g.g3_inactive_blocks, g.g3_total_blocks),
        ):
            if total:
                family.add_metric([*values, tier, "active"], active)
                family.add_metric([*values, tier, "inactive"], inactive)
                family.add_metric([*values, tier, "free"], total - active - inactive)
    return family


def modeled_seconds_per_ms(speedup_ratio: float) -> float:
    """Modeled seconds per core millisecond: the core's clock is wall time / ratio when r > 0."""
    return (speedup_ratio if speedup_ratio > 0 else 1.0) / 1000.0


def cache_config_info(config: DaemonConfig) -> dict[str, str]:
    """Labels of `vllm:cache_config_info`, named and spelled as vLLM's `CacheConfig` fields
    (`metrics_info()` is `str()` of each field, so booleans read "True"/"False")."""
    engine = config.engine
    return {
        "block_size": str(engine.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(bool(engine.enable_prefix_caching)),
        # vLLM's CPU blocks; here the G2 (host) tier, when offload tiers are on.
        "num_cpu_blocks": str(engine.num_g2_blocks)
        if engine.num_g2_blocks and engine.kv_bytes_per_token is not None
        else "None",
        "num_gpu_blocks": str(engine.num_gpu_blocks),
        # Our --num-gpu-blocks is what Dynamo's mocker calls --num-gpu-blocks-override.
        "num_gpu_blocks_override": str(engine.num_gpu_blocks),
    }


class VllmMetrics(Collector):
    """The collector behind `/metrics`: one `RankMetrics` per attached rank.

    It has its own `CollectorRegistry` (`registry`) rather than the process-global one, so
    nothing else in the process (or another daemon in a test process) leaks into the scrape.
    """

    def __init__(self, *, model_name: str, speedup_ratio: float, cache_info: Mapping[str, str]):
        self.model_name = model_name
        self.seconds_per_ms = modeled_seconds_per_ms(speedup_ratio)
        self.cache_info = dict(cache_info)
        self.ranks: list[RankMetrics] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> VllmMetrics:
        return cls(
            model_name=config.model_name,
            speedup_ratio=config.engine.speedup_ratio,
            cache_info=cache_config_info(config),
        )

    def attach(self, loop: RankHandle) -> RankMetrics:
        """Start tallying a rank: register its observers on the loop."""
        rank = RankMetrics(
            loop.rank,
            gauges=loop.engine.metrics,
            now_ms=loop.now_ms,
            seconds_per_ms=self.seconds_per_ms,
        )
        loop.command_observers.append(rank.on_command)
        loop.pass_observers.append(rank.on_pass)
        self.ranks.append(rank)
        return rank

    def watch_publishers(self, publishers: Sequence[WatchedPublisher]) -> None:
        """Expose the KV publishers' slow-reader counters (engined.server.publisher_metrics)."""
        self.registry.register(PublisherMetrics(self.model_name, publishers))

    def describe(self) -> list[Metric]:
        # NOTE: registering calls describe(); an empty list skips a collect() at start-up.
        return []

    def collect(self) -> Iterator[Metric]:
        """Every family, read from the tallies and the engines as they are now."""
        model = self.model_name
        ranks = self.ranks
        labels = [(rank, [model, str(rank.rank)]) for rank in ranks]
        gauges = {rank.rank: rank.gauges() for rank in ranks}

        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=LABELS,
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels=LABELS,
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels=LABELS,
        )
        for rank, values in labels:
            snapshot = gauges[rank.rank]
            running.add_metric(values, snapshot.running)
            waiting.add_metric(values, snapshot.waiting)
            usage.add_metric(values, snapshot.kv_cache_usage)
        yield running
        yield waiting
        yield usage
        if any(snapshot.g2_total_blocks for snapshot in gauges.values()):
            yield _tier_blocks(labels, gauges)

        counters: tuple[tuple[str, str, Callable[[RankMetrics], int]], ...] = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                lambda r: r.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                lambda r: r.prefix_cache_hits,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                lambda r: gauges[r.rank].preemptions_total,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                lambda r: r.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                lambda r: r.generation_tokens,
            ),
        )
        for name, documentation, read in counters:
            counter = CounterMetricFamily(name, documentation, labels=LABELS)
            for rank, values in labels:
                counter.add_metric(values, read(rank))
            yield counter

        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*LABELS, "finished_reason"),
        )
        for rank, values in labels:
            for reason, count in rank.finished.items():
                success.add_metric([*values, reason], count)
        yield success

        histograms: tuple[tuple[str, str, Callable[[RankMetrics], LatencyHistogram]], ...] = (
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                lambda r: r.ttft,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                lambda r: r.itl,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                lambda r: r.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                lambda r: r.queue,
            ),
        )
        for name, documentation, pick in histograms:
            family = HistogramMetricFamily(name, documentation, labels=LABELS)
            for rank, values in labels:
                histogram = pick(rank)
                family.add_metric(values, histogram.cumulative(), histogram.sum)
            yield family

        info_labels = [*self.cache_info, "engine"]
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=info_labels,
        )
        for rank in ranks:
            info.add_metric([*self.cache_info.values(), str(rank.rank)], 1.0)
        yield info
