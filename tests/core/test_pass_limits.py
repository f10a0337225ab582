"""vLLM 0.33's scheduling options that bound a pass: `long_prefill_token_threshold` (and its
adaptive floor), the admission `watermark` and the `prefill_schedule_interval` cadence
(engined/core/paged/pass_limits.py), `max_num_active_seqs` and `max_num_scheduled_tokens`.
The parity harness checks whole streams under each against the real scheduler (`random-s10`
to `-s15`, `pressure-watermark0.1`, `max-num-active-seqs-3`)."""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.engine import Engine
from tests.core.factories import request, submit
from tests.core.test_paged_semantics import paged_args


def scheduled_per_pass(core: Engine, passes: int) -> list[dict[str, int]]:
    """Each pass's new tokens by request (the engine built with `record=True`)."""
    out: list[dict[str, int]] = []
    now = 0.0
    for _ in range(passes):
        result = core.execute_pass(now)
        assert result.trace is not None
        out.append({s.request_id: s.new for s in result.trace.scheduled})
        now = result.end_ms
    return out


@pytest.mark.parametrize(
    ("fields", "first_two"),
    [
        # Two 100-token prompts: 32 each a pass, until a prompt's rest is shorter.
        ({"long_prefill_token_threshold": 32}, [{"a": 32, "b": 32}, {"a": 32, "b": 32}]),
        # Adaptive: at least 128 / 2 requests.
        (
            {"long_prefill_token_threshold": 8, "long_prefill_token_threshold_adaptive": True},
            [{"a": 64, "b": 64}, {"a": 36, "b": 36}],
        ),
        ({}, [{"a": 100, "b": 28}, {"a": 1, "b": 72}]),
        # vLLM's max_num_scheduled_tokens: 96 a pass, below the budget of 128.
        ({"max_num_scheduled_tokens": 96}, [{"a": 96}, {"a": 4, "b": 92}]),
        # Its adaptive floor still shares the budget, 128 / 2, not 96 / 2.
        (
            {
                "max_num_scheduled_tokens": 96,
                "long_prefill_token_threshold": 8,
                "long_prefill_token_threshold_adaptive": True,
            },
            [{"a": 64, "b": 32}, {"a": 36, "b": 60}],
        ),
        # Above the budget, the budget bounds the pass.
        ({"max_num_scheduled_tokens": 1000}, [{"a": 100, "b": 28}, {"a": 1, "b": 72}]),
    ],
)
def test_long_prefill_token_threshold_caps_each_request_while_others_wait(
    fields: dict[str, Any], first_two: list[dict[str, int]]
) -> None:
    """vLLM's `long_prefill_token_threshold`: running and admitted requests alike."""
    args = paged_args(num_gpu_blocks=80, max_num_batched_tokens=128, max_model_len=None, **fields)
    core = Engine(args, record=True)
    submit(core, request("a", range(100), 4))
    submit(core, request("b", range(200, 300), 4))
    assert scheduled_per_pass(core, 2) == first_two


def test_long_prefill_token_threshold_spares_a_request_alone() -> None:
    core = Engine(paged_args(num_gpu_blocks=80, long_prefill_token_threshold=16), record=True)
    submit(core, request("a", range(40), 2))
    assert scheduled_per_pass(core, 1) == [{"a": 40}]


@pytest.mark.parametrize(("watermark", "admitted"), [(0.0, ["a", "b"]), (0.25, ["a"])])
def test_an_admission_leaves_the_watermark_free_while_a_request_runs(
    watermark: float, admitted: list[str]
) -> None:
    """20 blocks of 4 (19 usable), a watermark of 5: `a` takes 8 blocks, leaving 11, and
    `b` needs 7 of them."""
    core = Engine(paged_args(num_gpu_blocks=20, watermark=watermark, max_model_len=None))
    submit(core, request("a", range(32), 4))
    submit(core, request("b", range(100, 128), 4))
    result = core.execute_pass(0.0)
    assert [a.request_id for a in result.admissions] == admitted


def test_the_first_admission_ignores_the_watermark() -> None:
    core = Engine(paged_args(num_gpu_blocks=20, watermark=0.25, max_model_len=None))
    submit(core, request("a", range(72), 2))
    result = core.execute_pass(0.0)
    assert [a.request_id for a in result.admissions] == ["a"]


def test_max_num_active_seqs_limits_admission_below_max_num_seqs() -> None:
    core = Engine(paged_args(num_gpu_blocks=40, max_num_seqs=8, max_num_active_seqs=2))
    for i in range(4):
        submit(core, request(f"r{i}", range(10 * i, 10 * i + 8), 2))
    result = core.execute_pass(0.0)
    assert [a.request_id for a in result.admissions] == ["r0", "r1"]
    assert core.queues().waiting == ["r2", "r3"]


def admitted_by_pass(core: Engine, passes: int) -> list[list[str]]:
    out: list[list[str]] = []
    now = 0.0
    for _ in range(passes):
        result = core.execute_pass(now)
        out.append([a.request_id for a in result.admissions])
        now = result.end_ms
    return out


def test_prefill_schedule_interval_holds_admissions_while_a_request_decodes() -> None:
    """Interval 3: `a` prefills in pass 1; `b`, waiting from pass 2 on, is admitted in pass
    4, the third executed pass after the last that prefilled."""
    core = Engine(paged_args(num_gpu_blocks=40, prefill_schedule_interval=3))
    submit(core, request("a", range(8), 10))
    first = core.execute_pass(0.0)
    assert [a.request_id for a in first.admissions] == ["a"]
    submit(core, request("b", range(100, 108), 2))
    assert admitted_by_pass(core, 3) == [[], [], ["b"]]


def test_prefill_schedule_interval_lets_go_when_admissions_leave_requests_waiting() -> None:
    """A budget of 16: the pass that admits `a` and `b` leaves `c` waiting (capacity bound),
    so the next pass does not hold, and admits `c` beside their decodes."""
    args = paged_args(num_gpu_blocks=40, max_num_batched_tokens=16, prefill_schedule_interval=3)
    core = Engine(args)
    for name, first in (("a", 0), ("b", 100), ("c", 200)):
        submit(core, request(name, range(first, first + 8), 10))
    assert admitted_by_pass(core, 2) == [["a", "b"], ["c"]]


def test_a_cadence_never_holds_without_a_decoding_request() -> None:
    core = Engine(paged_args(num_gpu_blocks=40, prefill_schedule_interval=4))
    submit(core, request("a", range(8), 1))
    submit(core, request("b", range(100, 108), 1))
    assert admitted_by_pass(core, 1) == [["a", "b"]]
    submit(core, request("c", range(200, 208), 1))
    assert admitted_by_pass(core, 1) == [["c"]]
