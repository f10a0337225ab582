"""vLLM's sleep-mode operation metrics (engined.server.ops.sleep_mode_operations).

The clock is a list of readings; the exposition is compared with what prometheus_client
itself gives for vLLM's `SleepModeOperationMetrics` (vllm/entrypoints/serve/dev/sleep/
metrics.py: the same Histogram and Gauge, on a registry of their own) fed the same
durations, `_created` samples aside (engined exposes none: README, Metrics).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from engined.server.ops.sleep_mode_operations import BUCKETS, SleepModeOperations


def readings(*values: float) -> Iterator[float]:
    yield from values


def exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def vllms(durations: list[tuple[str, float]], in_flight: dict[str, int]) -> list[str]:
    """What vLLM's own objects expose after these calls (and these still awaited)."""
    registry = CollectorRegistry()
    duration = Histogram(
        "vllm:sleep_mode_operation_duration_seconds",
        "Duration of one sleep-mode operation.",
        ["operation"],
        buckets=BUCKETS,
        registry=registry,
    )
    active = Gauge(
        "vllm:sleep_mode_operations_in_flight",
        "Sleep-mode operations currently awaited.",
        ["operation"],
        registry=registry,
    )
    for operation, seconds in durations:
        active.labels(operation)
        duration.labels(operation).observe(seconds)
    for operation, count in in_flight.items():
        active.labels(operation).inc(count)
        duration.labels(operation)
    return exposition(registry)


def test_nothing_is_exposed_before_the_first_operation() -> None:
    registry = CollectorRegistry()
    registry.register(SleepModeOperations())
    assert generate_latest(registry) == b""


def test_durations_and_in_flight_are_vllms() -> None:
    clock = readings(10.0, 10.5, 20.0, 20.25, 30.0, 130.0, 40.0, 41.0)
    operations = SleepModeOperations(clock=lambda: next(clock))
    registry = CollectorRegistry()
    registry.register(operations)
    with operations.record("sleep"):
        assert 'operations_in_flight{operation="sleep"} 1.0' in generate_latest(registry).decode()
    with operations.record("wake"):
        pass
    with pytest.raises(RuntimeError), operations.record("release_kv_cache_memory"):
        raise RuntimeError("refused: still counted, as vLLM's `finally` counts it")
    with operations.record("wake"):
        awaited = exposition(registry)
        assert awaited == vllms(
            [("sleep", 0.5), ("wake", 0.25), ("release_kv_cache_memory", 100.0)], {"wake": 1}
        )
