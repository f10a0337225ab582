"""`vllm:lora_requests_info` as vLLM 0.33 keeps it (engined.server.ops.prometheus_lora).

A real core driven pass by pass (tests/server/test_metrics_families.py's `Driver`, the fixed
perf model) and a counting clock standing in for Unix time: each logged pass reads the next
integer, so every series' value says which pass last made it current.
"""

from __future__ import annotations

import itertools

from prometheus_client import generate_latest

from engined.config import DaemonConfig
from engined.core.args import EngineArgs, WorkerType
from engined.core.types import LoraRequest, Request, RequestOutput, Submit
from engined.server.ops.prometheus_lora import LoraRequestsInfo
from engined.server.ops.prometheus_metrics import VllmMetrics
from tests.server.test_metrics import parse, value
from tests.server.test_metrics_families import FIXED, Driver

NAME = "vllm:lora_requests_info"


def counting_clock() -> itertools.count[int]:
    return itertools.count(1)


def lora_metrics(max_loras: int = 2) -> tuple[VllmMetrics, dict[str, object]]:
    engine: dict[str, object] = {"enable_lora": True, "max_loras": max_loras}
    args = EngineArgs(**{**FIXED, **engine}).normalized()  # type: ignore[arg-type]
    config = DaemonConfig(model_name="m", engine=args)
    clock = counting_clock()
    metrics = VllmMetrics.from_config(config)
    assert metrics.lora is not None
    metrics.lora._clock = lambda: float(next(clock))
    return metrics, engine


def lora_submit(request_id: str, first: int, max_tokens: int, lora: str | None) -> Submit:
    adapter = None if lora is None else LoraRequest(lora, ord(lora[0]), f"/adapters/{lora}")
    return Submit(
        Request(
            token_ids=list(range(first, first + 8)),
            max_tokens=max_tokens,
            request_id=request_id,
            lora_request=adapter,
        )
    )


def series(metrics: VllmMetrics) -> dict[tuple[str, str, str], float]:
    samples = parse(generate_latest(metrics.registry).decode()).get(NAME, [])
    return {
        (
            s.labels["max_lora"],
            s.labels["waiting_lora_adapters"],
            s.labels["running_lora_adapters"],
        ): s.value
        for s in samples
    }


def test_no_family_without_enable_lora() -> None:
    args = EngineArgs(**FIXED).normalized()  # type: ignore[arg-type]
    metrics = VllmMetrics.from_config(DaemonConfig(model_name="m", engine=args))
    assert metrics.lora is None
    assert NAME not in generate_latest(metrics.registry).decode()


def test_adapters_count_from_their_first_output_until_they_finish() -> None:
    """Both labels list every adapter with a request that has had an output, in the order
    they entered (vLLM fills both dicts from the same entries); the series of every set ever
    current stays, valued the last pass it was current at."""
    metrics, engine = lora_metrics()
    driver = Driver(metrics, **engine)
    assert series(metrics) == {}  # vLLM's gauge has no child before its first record
    driver.command(lora_submit("r-b", 100, 2, "b"), at=0.0)
    driver.command(lora_submit("r-base", 200, 4, None), at=0.0)
    driver.command(lora_submit("r-a", 300, 3, "a"), at=0.0)
    driver.passes(1)  # prefill all three: every request's first token
    assert series(metrics) == {("2", "b,a", "b,a"): 1.0}
    driver.passes(1)  # r-b's second token: it finishes
    assert series(metrics) == {("2", "b,a", "b,a"): 1.0, ("2", "a", "a"): 2.0}
    driver.passes()  # r-a ends in the next pass, r-base in the one after
    assert series(metrics) == {
        ("2", "b,a", "b,a"): 1.0,
        ("2", "a", "a"): 2.0,
        ("2", "", ""): 4.0,
    }
    # A new request for b makes "b" current again; an old set keeps its last time.
    driver.command(lora_submit("r-b2", 400, 1, "b"), at=driver.now)
    driver.command(lora_submit("r-a2", 500, 2, "a"), at=driver.now)
    driver.passes(1)  # r-b2's only token ends it at its first output: it never counts
    assert series(metrics)[("2", "a", "a")] == 5.0


def test_the_exposition_is_vllms() -> None:
    metrics, engine = lora_metrics(max_loras=3)
    driver = Driver(metrics, **engine)
    driver.command(lora_submit("r-a", 300, 2, "a"), at=0.0)
    driver.passes(1)
    text = metrics.render(openmetrics=False, underscored=False)
    assert (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="a",'
        'waiting_lora_adapters="a"} 1.0\n'
    ) in text
    assert text == generate_latest(metrics.registry).decode()


def test_series_are_bounded_least_recently_current_first() -> None:
    clock = counting_clock()
    info = LoraRequestsInfo(1, clock=lambda: float(next(clock)), max_series=2)
    info.logged()  # "" at 1
    info.submitted(0, "r1", "a")
    info.outputs(0, [RequestOutput("r1", [7], cached_tokens=0)])
    info.logged()  # "a" at 2
    info.finished(0, "r1")
    info.logged()  # "" at 3
    info.submitted(1, "r1", "b")  # the same id on another rank is another request
    info.outputs(1, [RequestOutput("r1", [7], cached_tokens=0)])
    info.logged()  # "b" at 4: "a" (2) goes, "" (3) stays
    assert info.rows() == [(("1", "", ""), 3.0), (("1", "b", "b"), 4.0)]
    info.finished(0, "r1")  # ended already: nothing
    info.finished(1, "r2")  # never submitted: nothing
    info.logged()
    assert info.rows() == [(("1", "", ""), 3.0), (("1", "b", "b"), 5.0)]


def test_a_request_counts_from_its_first_output_with_tokens() -> None:
    info = LoraRequestsInfo(2, clock=lambda: 0.0)
    info.submitted(0, "r1", "a")
    info.submitted(0, "r2", "b")
    info.outputs(0, [RequestOutput("r2", [], finish_reason=None)])  # no token yet
    info.logged()
    info.outputs(0, [RequestOutput("r2", [5], cached_tokens=0), RequestOutput("r1", [6])])
    info.logged()
    info.finished(0, "r2")
    info.logged()
    assert [labels[1] for labels, _ in info.rows()] == ["", "b,a", "a"]


def test_a_request_held_back_by_max_loras_is_deferred_not_fetching() -> None:
    """A decode worker (vLLM: a KV consumer) with `max_loras` 1: the request for a second
    adapter waits `deferred`, as vLLM's skipped request, but no KV fetch is in progress."""
    engine: dict[str, object] = {
        "enable_lora": True,
        "max_loras": 1,
        "worker_type": WorkerType.DECODE,
    }
    args = EngineArgs(**{**FIXED, **engine}).normalized()  # type: ignore[arg-type]
    metrics = VllmMetrics.from_config(DaemonConfig(model_name="m", engine=args))
    driver = Driver(metrics, **engine)
    driver.command(lora_submit("r-a", 100, 4, "a"), at=0.0)
    driver.command(lora_submit("r-b", 200, 4, "b"), at=0.0)
    driver.passes(1)
    families = parse(generate_latest(metrics.registry).decode())

    def read(family: str, **labels: str) -> float:
        return value(families[family], family, **labels)

    assert read("vllm:num_requests_running") == 1
    assert read("vllm:num_requests_waiting_by_reason", reason="deferred") == 1
    assert read("vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert read("vllm:num_requests_kv_fetch_by_stage", stage="in_progress") == 0
