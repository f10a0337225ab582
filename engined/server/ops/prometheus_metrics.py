"""Prometheus metrics under vLLM's names: dashboards and routers built for vLLM read us unchanged.

Every series carries the labels vLLM gives it: `model_name` (the served model name) and `engine`
(the data-parallel rank, as vLLM labels its engine cores), plus each family's own
(`finished_reason`, `source`, `reason`, ...). Names, label names, help texts and buckets are
vLLM 0.33's `PrometheusStatLogger` (engined.server.ops.prometheus_families), for every family that
means something for a simulated engine; README.md's metrics section lists which and why.

Cost is the design constraint: a daemon at speedup 0 emits ~300k tokens/s, so nothing here runs
per token in Python. Each rank's `RankMetrics` (engined.server.ops.prometheus_rank) is fed once per
engine pass (an `EngineLoop` pass observer), once per command (a command observer, for arrival
times, cancels and handoff commands) and once per handoff event (`on_lifecycle`, which the
daemon calls for every rank's events):

* counters are plain ints bumped by per-pass totals (`PassReport.accept_length_output_tokens`,
  `prefix_cache_queries/hits`, MTP's decode forwards);
* inter-token latency: a request that emitted in the previous emitting pass and emits again
  has waited exactly `end_ms - previous end_ms`, the same value for all of them, so the whole
  cohort is one `add(value, count)`;
* histograms are bucket counts in plain lists (`LatencyHistogram`), because prometheus_client's
  `Histogram` has no observe-with-count. The collector turns them into `HistogramMetricFamily`
  at scrape time, with the `le` spellings and label values computed once;
* gauges and `vllm:num_preemptions_total` are read from the engines' `metrics()` at scrape
  time, so scraping adds no work to passes;
* a request's record ends when a result says it ended: `PassReport.ended` (finished,
  rejected) or `CommandReport.ended` (cancelled by any path, since every path that ends a
  request early is a command the loop applies and observes). Its per-request histograms are
  recorded then.

Latencies are modeled time: the core's millisecond clock is modelled time at every speedup
(engined.model_clock), so the histograms show what the modeled engine would have shown,
whatever the pacing, with nothing to undo.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Final, TypeAlias

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from engined.core.assembly import served_context
from engined.core.types import EngineMetrics, LifecycleEvent
from engined.server.ops import prometheus_families as spec
from engined.server.ops.prometheus_families import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Family,
    LatencyHistogram,
)
from engined.server.ops.prometheus_lora import LoraRequestsInfo
from engined.server.ops.prometheus_rank import RankMetrics
from engined.server.ops.prometheus_render import HistogramRows, Row, Rows, TextRenderer, to_metric
from engined.server.publish.prometheus_publishers import PublisherMetrics, WatchedPublisher

if TYPE_CHECKING:
    from engined.config import DaemonConfig
    from engined.server.ranks.rank_handle import RankHandle

__all__ = [
    "ITL_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "TTFT_BUCKETS",
    "LatencyHistogram",
    "RankMetrics",
    "VllmMetrics",
    "cache_config_info",
]


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


class _Rank:
    """A rank's tallies with its label values, spelled once."""

    __slots__ = ("labels", "tallies")

    def __init__(self, tallies: RankMetrics, model_name: str) -> None:
        self.tallies = tallies
        self.labels: tuple[str, ...] = (model_name, str(tallies.rank))


class VllmMetrics(Collector):
    """The collector behind `/metrics`: one `RankMetrics` per attached rank.

    It has its own `CollectorRegistry` (`registry`) rather than the process-global one, so
    nothing else in the process (or another daemon in a test process) leaks into the scrape.
    The registry holds this collector, then `others` (the build info, the KV publishers'
    counters: `register`), so that `render` plus the registry encoder's text of `others` is
    the registry's whole exposition.

    Args:
        model_name: the `model_name` label.
        cache_info: the labels of `vllm:cache_config_info`.
        max_model_len: the longest prompt + output (the last token-count bucket).
        block_size: KV block size (a destination's transferred prompt tokens).
        spec_tokens: MTP draft tokens per step when the ranks draft (0: no `spec_decode_*`).
        kv_fetch: the ranks are P/D destinations (`num_requests_kv_fetch_by_stage`).
        kv_residency: `kv_cache_metrics` is on (the `kv_block_*` histograms).
        max_loras: `engine.max_loras` with `enable_lora` (`vllm:lora_requests_info`), else
            None.
        clock: Unix seconds, the value of `vllm:lora_requests_info`.
    """

    def __init__(
        self,
        *,
        model_name: str,
        cache_info: Mapping[str, str],
        max_model_len: int = 1 << 16,
        block_size: int = 16,
        spec_tokens: int = 0,
        kv_fetch: bool = False,
        kv_residency: bool = False,
        max_loras: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model_name = model_name
        self.cache_info = dict(cache_info)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.spec_tokens = spec_tokens
        self.kv_fetch = kv_fetch
        self.kv_residency = kv_residency
        self.ranks: list[RankMetrics] = []
        self.lora = None if max_loras is None else LoraRequestsInfo(max_loras, clock=clock)
        self._ranks: list[_Rank] = []
        self._admission: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self._renderer = TextRenderer()
        self._info = Family(
            spec.CACHE_CONFIG_INFO_NAME,
            "gauge",
            spec.CACHE_CONFIG_INFO_HELP,
            (*self.cache_info, "engine"),
        )
        self._info_values = tuple(self.cache_info.values())
        self.others = CollectorRegistry(auto_describe=False)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.registry.register(self.others)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> VllmMetrics:
        engine = config.engine
        return cls(
            model_name=config.model_name,
            cache_info=cache_config_info(config),
            max_model_len=served_context(engine),
            block_size=engine.block_size,
            # A prefill worker's bursts are one token: it drafts nothing (as vLLM's prefill).
            spec_tokens=0 if engine.is_prefill else engine.aic_nextn or 0,
            kv_fetch=engine.is_decode,
            kv_residency=engine.kv_cache_metrics,
            max_loras=engine.max_loras if engine.enable_lora else None,
        )

    def attach(self, loop: RankHandle) -> RankMetrics:
        """Start tallying a rank: register its observers on the loop."""
        rank = RankMetrics(
            loop.rank,
            gauges=lambda: loop.gauges().metrics,
            now_ms=loop.now_ms,
            max_model_len=self.max_model_len,
            spec_tokens=self.spec_tokens,
            lora=self.lora,
        )
        loop.command_observers.append(rank.on_command)
        loop.pass_observers.append(rank.on_pass)
        self.ranks.append(rank)
        self._ranks.append(_Rank(rank, self.model_name))
        return rank

    def on_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        """Handoff events of `rank`, as the daemon delivers them to their owners."""
        for tallies in self.ranks:
            if tallies.rank == rank:
                tallies.on_lifecycle(events, self.block_size)

    def watch_admission(self, read: Callable[[], tuple[int, int]]) -> None:
        """Read the admission refusals by vLLM's reasons (`ADMISSION_REASONS`) at each
        scrape: `vllm:admission_rejections_total`."""
        self._admission = read

    def watch_publishers(self, publishers: Sequence[WatchedPublisher]) -> None:
        """Expose the KV publishers' slow-reader counters
        (engined.server.publish.prometheus_publishers)."""
        self.register(PublisherMetrics(self.model_name, publishers))

    def register(self, collector: Collector) -> None:
        """Expose `collector`'s families after the vLLM ones."""
        self.others.register(collector)

    def describe(self) -> list[Metric]:
        # NOTE: registering calls describe(); an empty list skips a collect() at start-up.
        return []

    def collect(self) -> Iterator[Metric]:
        """Every family, read from the tallies and the engines as they are now."""
        for family, rows in self.families():
            yield to_metric(family, rows)

    def render(self, openmetrics: bool, underscored: bool) -> str:
        """The same families as text (`TextRenderer`): what the registry's encoder for that
        format (and escaping) gives for this collector."""
        return self._renderer.render(self.families(), openmetrics, underscored)

    def families(self) -> list[tuple[Family, Rows | HistogramRows]]:
        """Every family with its rows, read from the tallies and the engines as they are now."""
        ranks = self._ranks
        gauges = {rank.tallies.rank: rank.tallies.gauges() for rank in ranks}
        families: list[tuple[Family, Rows | HistogramRows]] = []
        add = families.append
        snapshots = [(rank.labels, rank.tallies, gauges[rank.tallies.rank]) for rank in ranks]
        add((spec.RUNNING, [(labels, g.running) for labels, _, g in snapshots]))
        add((spec.WAITING, [(labels, g.waiting) for labels, _, g in snapshots]))
        by_reason: list[Row] = []
        for labels, _, g in snapshots:
            deferred = g.waiting_deferred
            by_reason += (
                ((*labels, "capacity"), g.waiting - deferred),
                ((*labels, "deferred"), deferred),
            )
        add((spec.WAITING_BY_REASON, by_reason))
        if self.kv_fetch:
            fetch: list[Row] = []
            for labels, t, g in snapshots:
                counts = (0, g.waiting_for_kv, len(t.fetched))
                stages = zip(spec.KV_FETCH_STAGES, counts, strict=True)
                fetch += [((*labels, stage), n) for stage, n in stages]
            add((spec.KV_FETCH_BY_STAGE, fetch))
        sleep = [
            ((*labels, state), value)
            for labels, _, g in snapshots
            for state, value in zip(spec.SLEEP_STATES, _sleep_state(g), strict=True)
        ]
        add((spec.SLEEP_STATE, sleep))
        add((spec.KV_CACHE_USAGE, [(labels, g.kv_cache_usage) for labels, _, g in snapshots]))
        if any(g.g2_total_blocks for _, _, g in snapshots):
            add((spec.TIER_BLOCKS, _tier_blocks(snapshots)))
        for family, read in _COUNTERS:
            add((family, [(labels, read(t, g)) for labels, t, g in snapshots]))
        for family, label_values, read_all in _LABELLED_COUNTERS:
            rows: list[Row] = []
            for labels, t, _ in snapshots:
                tallied = read_all(t)
                rows += [
                    ((*labels, v), count) for v, count in zip(label_values, tallied, strict=True)
                ]
            add((family, rows))
        rejections: list[Row] = [
            ((self.model_name, reason), count)
            for reason, count in zip(spec.ADMISSION_REASONS, self._admission(), strict=True)
        ]
        add((spec.ADMISSION_REJECTIONS, rejections))
        if self.spec_tokens:
            for family, attribute in _SPEC_DECODE:
                add((family, [(labels, getattr(t, attribute)) for labels, t, _ in snapshots]))
            per_pos: list[Row] = []
            for labels, t, _ in snapshots:
                per_pos += [((*labels, str(i)), n) for i, n in enumerate(t.accepted_per_pos)]
            add((spec.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, per_pos))
        histograms = spec.HISTOGRAMS
        if self.kv_residency:
            histograms += spec.RESIDENCY_HISTOGRAMS
        for family, attribute in histograms:
            add((family, [(labels, getattr(t, attribute)) for labels, t, _ in snapshots]))
        if self.lora is not None:
            add((spec.LORA_REQUESTS_INFO, self.lora.rows()))
        info = self._info_values
        add((self._info, [((*info, labels[1]), 1.0) for labels, _, _ in snapshots]))
        return families


def _sleep_state(g: EngineMetrics) -> tuple[int, int, int]:
    """(awake, weights_offloaded, discard_all) as vLLM's `record_sleep_state(sleep, level)`
    sets them (vllm/v1/metrics/loggers.py) once a sleep or a full wake-up returns: asleep at
    level 0 is neither offloaded nor discarded."""
    if not g.asleep:
        return 1, 0, 0
    return 0, int(g.sleep_level == 1), int(g.sleep_level == 2)


_Snapshot: TypeAlias = tuple[tuple[str, ...], RankMetrics, EngineMetrics]
_COUNTERS: Final[tuple[tuple[Family, Callable[[RankMetrics, EngineMetrics], int]], ...]] = (
    (spec.PREFIX_CACHE_QUERIES, lambda t, g: t.prefix_cache_queries),
    (spec.PREFIX_CACHE_HITS, lambda t, g: t.prefix_cache_hits),
    (spec.EXTERNAL_PREFIX_CACHE_QUERIES, lambda t, g: t.external_queries),
    (spec.EXTERNAL_PREFIX_CACHE_HITS, lambda t, g: t.external_hits),
    (spec.NUM_PREEMPTIONS, lambda t, g: g.preemptions_total),
    (spec.PROMPT_TOKENS, lambda t, g: t.prompt_tokens),
    (spec.PROMPT_TOKENS_CACHED, lambda t, g: t.prompt_by_source[1] + t.prompt_by_source[2]),
    (spec.GENERATION_TOKENS, lambda t, g: t.generation_tokens),
)
_LABELLED_COUNTERS: Final[
    tuple[tuple[Family, tuple[str, ...], Callable[[RankMetrics], Sequence[int]]], ...]
] = (
    (spec.PROMPT_TOKENS_BY_SOURCE, spec.PROMPT_SOURCES, lambda t: t.prompt_by_source),
    (spec.PROMPT_TOKENS_CACHED_BY_SOURCE, spec.CACHE_HIT_SOURCES, lambda t: t.cached_by_source),
    (
        spec.REQUEST_SUCCESS,
        spec.FINISHED_REASONS,
        lambda t: [t.finished.get(reason, 0) for reason in spec.FINISHED_REASONS],
    ),
)
_SPEC_DECODE: Final = (
    (spec.SPEC_DECODE_NUM_DRAFTS, "drafts"),
    (spec.SPEC_DECODE_NUM_DRAFT_TOKENS, "draft_tokens"),
    (spec.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "accepted"),
)


def _tier_blocks(snapshots: list[_Snapshot]) -> Rows:
    """The offload tiers' blocks by state, for the ranks that have the tier."""
    rows: list[Row] = []
    for labels, _, g in snapshots:
        for tier, active, inactive, total in (
            ("g2", g.g2_active_blocks, g.g2_inactive_blocks, g.g2_total_blocks),
            ("g3", g.g3_active_blocks, g.g3_inactive_blocks, g.g3_total_blocks),
        ):
            if total:
                rows.append(((*labels, tier, "active"), active))
                rows.append(((*labels, tier, "inactive"), inactive))
                rows.append(((*labels, tier, "free"), total - active - inactive))
    return rows
