"""The frames between the daemon and its rank workers carry the core's own values.

Every command, every result and every `CoreError` a rank can answer with comes out of a
frame as the value (or the exception) that went in; nothing is re-encoded by hand.
"""

from __future__ import annotations

from typing import get_type_hints

import msgspec
import pytest

from engined.core import errors
from engined.core import types as core
from engined.core.args import EngineArgs
from engined.core.command_report import CommandReport
from engined.core.engine import Engine
from engined.core.errors import CoreFailure
from engined.core.pass_report import PassReport
from engined.server.ranks import rank_wire as w

REQUEST = core.Request(token_ids=[1, 2, 3], max_tokens=4, request_id="r", seed=7)
COMMANDS: list[core.Command] = [
    core.Submit(REQUEST),
    core.Cancel("r"),
    core.SubmitHandoffPrefill("h", REQUEST),
    core.ReleaseSource("h"),
    core.CancelSource("h"),
    core.ReserveDestination("h", REQUEST),
    core.ActivateDestination("h"),
    core.CancelDestination("h"),
    core.SetVocabulary(100, (3, 4)),
    core.ResetPrefixCache(),
]
RESULTS: list[core.CommandResult] = [
    core.Submitted("r"),
    core.DestinationAccepted("r"),
    core.Applied(),
    core.Noop(),
    core.Refused("KV blocks are in use"),
]
METRICS = core.EngineMetrics(0, 1, 2, 3, 0.25, 1, 0, 0)


@pytest.mark.parametrize("order", [*COMMANDS, w.StopRank(), w.SetFpmWorkerId("host:1")])
def test_an_order_arrives_as_it_was_sent(order: w.Order) -> None:
    frame = w.encoder.encode((9, 2, order))
    corr, rank, decoded = w.order_decoder.decode(frame)
    assert (corr, rank) == (9, 2)
    assert type(decoded) is type(order)
    assert decoded == order


@pytest.mark.parametrize("result", RESULTS)
def test_a_reply_carries_the_core_result(result: core.CommandResult) -> None:
    reply = w.Reply(3, 1, 12.5, CommandReport(result), METRICS)
    (decoded,) = w.item_decoder.decode(w.encoder.encode([reply]))
    assert isinstance(decoded, w.Reply)
    assert type(decoded.report.result) is type(result)
    assert decoded.report.result == result
    assert decoded == reply


ERRORS: list[errors.CoreError] = [
    errors.CoreError("plain"),
    errors.InvalidArgsError("block_size: must be > 0", key="block_size"),
    errors.InvalidArgsError("no key"),
    errors.InvalidRequestError("token_ids: must not be empty"),
    errors.DuplicateRequestError("r-1"),
    errors.HandoffConflictError("destination handoff HandoffId(h) is already active"),
    errors.UnsupportedError("destination reservation is not supported for TRT-LLM"),
    errors.CapacityError("destination prompt exceeds the KV pool capacity"),
]


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
def test_a_failure_is_raised_again_as_the_same_error(exc: errors.CoreError) -> None:
    failure = w.Failure(4, 0, CoreFailure.of(exc))
    (decoded,) = w.item_decoder.decode(w.encoder.encode([failure]))
    assert isinstance(decoded, w.Failure)
    again = decoded.error.error()
    assert type(again) is type(exc)
    assert (again.code, str(again)) == (exc.code, str(exc))
    assert getattr(again, "key", None) == getattr(exc, "key", None)
    assert getattr(again, "request_id", None) == getattr(exc, "request_id", None)


def test_an_error_kind_this_build_does_not_know_is_not_decoded() -> None:
    frame = w.encoder.encode([["failure", 4, 0, ["SegfaultError", "boom", None, None]]])
    with pytest.raises(msgspec.ValidationError, match="SegfaultError"):
        w.item_decoder.decode(frame)


@pytest.mark.parametrize(
    ("report", "source", "left_out"),
    [
        (
            PassReport,
            core.PassResult,
            {"lifecycle_events", "kv_events", "fpm", "progressed", "trace"},
        ),
        (CommandReport, core.CommandEffects, {"lifecycle_events", "kv_events", "progressed"}),
    ],
)
def test_a_report_is_the_engine_values_fields_of_the_same_name(
    report: type, source: type, left_out: set[str]
) -> None:
    """Every field of a report means what the field of its name in the engine's value means;
    what only the rank's own process uses is left out, so a worker cannot send it empty."""
    report_hints = get_type_hints(report)
    source_hints = get_type_hints(source)
    assert {name: source_hints[name] for name in report_hints} == report_hints
    assert set(source_hints) - set(report_hints) == left_out


def test_a_pass_arrives_with_the_report_its_worker_took() -> None:
    engine = Engine(EngineArgs(block_size=4, num_gpu_blocks=16).normalized())
    engine.apply(core.Submit(REQUEST), now_ms=0.0)
    result = engine.execute_pass(0.0)
    report = PassReport.of(result)
    assert (report.end_ms, report.outputs, report.admissions, report.metrics) == (
        result.end_ms,
        result.outputs,
        result.admissions,
        result.metrics,
    )
    item = w.Pass(0, 0.0, report)
    (decoded,) = w.item_decoder.decode(w.encoder.encode([item]))
    assert decoded == item
    assert isinstance(decoded, w.Pass)
    assert decoded.report.admissions == [core.Admission("r", 0)]


def test_a_reply_arrives_with_the_report_its_worker_took() -> None:
    engine = Engine(EngineArgs(block_size=4, num_gpu_blocks=16).normalized())
    engine.apply(core.Submit(REQUEST), now_ms=0.0)
    effects = engine.apply(core.Cancel("r"), now_ms=1.0)
    report = CommandReport.of(effects)
    assert (report.result, report.ended) == (effects.result, effects.ended)
    item = w.Reply(5, 0, 1.0, report, METRICS)
    (decoded,) = w.item_decoder.decode(w.encoder.encode([item]))
    assert decoded == item
    assert isinstance(decoded, w.Reply)
    assert decoded.report.result == core.Applied()
    assert [ended.request_id for ended in decoded.report.ended] == ["r"]
