"""Prometheus series of the KV event publishers: how often slow readers were cut off.

vLLM has no such series, so they carry engined's prefix. They exist because a publisher
never waits for a reader (issue 10): a subscriber that falls behind its byte budget misses
batches, and a replay client that stops reading is abandoned. Both are normal under abuse
and invisible to every other client, so an operator needs a counter to see them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LABELS: tuple[str, str] = ("model_name", "engine")


class ReplayFigures(Protocol):
    """A rank's replay counters: its `ReplayServer`, or a rank proxy's copy of a worker's."""

    @property
    def abandoned(self) -> int: ...

    @property
    def refused(self) -> int: ...

    @property
    def streaming(self) -> int: ...


class WatchedPublisher(Protocol):
    """A rank's KV publisher as the metrics read it (or a rank proxy, with the same figures)."""

    @property
    def overflows(self) -> int: ...

    @property
    def replay(self) -> ReplayFigures | None: ...


class PublisherMetrics(Collector):
    """Reads the publishers' counters at scrape time; `publishers[r]` is rank r's."""

    def __init__(self, model_name: str, publishers: Sequence[WatchedPublisher]) -> None:
        self._model = model_name
        self._publishers = list(publishers)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        overflows = CounterMetricFamily(
            "engined:kv_events_overflows",
            "Times a KV event subscriber's queue reached kv_events_buffer_bytes; it misses "
            "batches until it has caught up, and can replay them.",
            labels=LABELS,
        )
        abandoned = CounterMetricFamily(
            "engined:kv_replay_abandoned",
            "KV replays abandoned because their client stopped reading.",
            labels=LABELS,
        )
        refused = CounterMetricFamily(
            "engined:kv_replay_refused",
            "KV replay requests dropped because too many replays were queued.",
            labels=LABELS,
        )
        streaming = GaugeMetricFamily(
            "engined:kv_replay_streams", "KV replays being sent now.", labels=LABELS
        )
        for rank, publisher in enumerate(self._publishers):
            values = [self._model, str(rank)]
            overflows.add_metric(values, publisher.overflows)
            replay = publisher.replay
            if replay is not None:
                abandoned.add_metric(values, replay.abandoned)
                refused.add_metric(values, replay.refused)
                streaming.add_metric(values, replay.streaming)
        yield overflows
        yield abandoned
        yield refused
        yield streaming
