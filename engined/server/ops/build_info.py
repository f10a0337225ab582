"""`engined:build_info`: which core the daemon runs, beside the figures it produces.

The compiled core is more than twice as fast as the pure one, and an install falls back to
the pure one where it cannot compile (and a process where a stale extension is refused): a
dashboard that sees throughput drop can read why here. The series is an info metric (a
constant 1 whose labels carry the facts), named like vLLM's `vllm:cache_config_info` with
engined's prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engined.core.core_build import CoreBuild

LABELS: tuple[str, ...] = ("model_name", "version", "core", "reason")


class BuildInfo(Collector):
    """One sample: the version, `core` ("compiled" or "pure") and why pure ("" if compiled)."""

    def __init__(self, model_name: str, version: str, build: CoreBuild) -> None:
        self._values = [model_name, version, build.core, build.reason]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "engined:build_info",
            "The engined version and which scheduler core runs (compiled by mypyc, or pure "
            "Python and why).",
            labels=LABELS,
        )
        family.add_metric(self._values, 1.0)
        yield family
