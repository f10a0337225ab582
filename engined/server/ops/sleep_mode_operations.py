"""vLLM's sleep-mode operation metrics: how long `sleep`, `release_kv_cache_memory` and
`wake_up` calls take, and how many are awaited now.

vLLM's API server times its dev routes `/sleep`, `/release_kv_cache_memory` and `/wake_up`
(vllm/entrypoints/serve/dev/sleep/metrics.py): a histogram
`vllm:sleep_mode_operation_duration_seconds{operation}` and a gauge
`vllm:sleep_mode_operations_in_flight{operation}`, operations "sleep",
"release_kv_cache_memory" and "wake", failed calls included. Its metrics object is made at
the first such call, so neither family is exposed before one, and an operation's series
exist from its first call on. Here the daemon times the control messages those routes send
(engined.server.control.pauses), whoever sends them, from their arrival to their reply, so
one series serves every API server process and every operator.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engined.server.ops.prometheus_families import LatencyHistogram

DURATION: Final = "vllm:sleep_mode_operation_duration_seconds"
IN_FLIGHT: Final = "vllm:sleep_mode_operations_in_flight"
BUCKETS: Final = (0.01, 0.1, 1.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class SleepModeOperations(Collector):
    """The two families, filled by `record` around each operation.

    Args:
        clock: seconds, for the durations (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        # By operation, in the order first called (vLLM's children order).
        self._durations: dict[str, LatencyHistogram] = {}
        self._in_flight: dict[str, int] = {}

    @contextlib.contextmanager
    def record(self, operation: str) -> Iterator[None]:
        """Count `operation` in flight while the block runs, then its duration, however the
        block ends."""
        durations = self._durations.get(operation)
        if durations is None:
            durations = self._durations[operation] = LatencyHistogram(BUCKETS)
        self._in_flight[operation] = self._in_flight.get(operation, 0) + 1
        started = self._clock()
        try:
            yield
        finally:
            self._in_flight[operation] -= 1
            durations.add(self._clock() - started)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if not self._durations:
            return
        duration = HistogramMetricFamily(
            DURATION, "Duration of one sleep-mode operation.", labels=["operation"]
        )
        for operation, histogram in self._durations.items():
            duration.add_metric([operation], histogram.cumulative(), histogram.sum)
        yield duration
        in_flight = GaugeMetricFamily(
            IN_FLIGHT, "Sleep-mode operations currently awaited.", labels=["operation"]
        )
        for operation, count in self._in_flight.items():
            in_flight.add_metric([operation], float(count))
        yield in_flight
