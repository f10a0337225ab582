"""Conversions between the core's values and control messages."""

from __future__ import annotations

from typing import get_type_hints

import msgspec
import pytest

from engined.core import types as core
from engined.wire import control, convert

REQUEST = control.WireRequest(
    request_id="r-1", token_ids=[1, 2, 3], max_tokens=5, output_token_ids=[7, 8], dp_rank=1
)
CORE_REQUEST = core.Request(
    token_ids=[1, 2, 3], max_tokens=5, request_id="r-1", output_token_ids=[7, 8]
)


def test_to_core_request_drops_only_the_routing_rank() -> None:
    assert convert.to_core_request(REQUEST) == CORE_REQUEST
    minimal = control.WireRequest(token_ids=[4], max_tokens=0)
    assert convert.to_core_request(minimal) == core.Request(token_ids=[4], max_tokens=0)


def test_to_core_request_carries_the_stops_and_the_salt() -> None:
    wire = control.WireRequest(
        token_ids=[4], max_tokens=8, stop_token_ids=[2, 9], min_tokens=3, cache_salt="t"
    )
    assert convert.to_core_request(wire) == core.Request(
        token_ids=[4], max_tokens=8, stop_token_ids=[2, 9], min_tokens=3, cache_salt="t"
    )


@pytest.mark.parametrize(
    ("msg", "command"),
    [
        (control.Submit(request=REQUEST), core.Submit(CORE_REQUEST)),
        (control.Cancel(request_id="r-1"), core.Cancel("r-1")),
        (
            control.SubmitHandoffPrefill(handoff_id="h", request=REQUEST),
            core.SubmitHandoffPrefill("h", CORE_REQUEST),
        ),
        (control.ReleaseSource(handoff_id="h"), core.ReleaseSource("h")),
        (control.CancelSource(handoff_id="h"), core.CancelSource("h")),
        (
            control.ReserveDestination(handoff_id="h", request=REQUEST),
            core.ReserveDestination("h", CORE_REQUEST),
        ),
        (control.ActivateDestination(handoff_id="h"), core.ActivateDestination("h")),
        (control.CancelDestination(handoff_id="h"), core.CancelDestination("h")),
        (control.Hello(), None),
        (control.Stats(), None),
        (control.ResetPrefixCache(dp_rank=0), core.ResetPrefixCache()),
        (control.SetVocabulary(vocab_size=None), core.SetVocabulary(None, ())),
        (
            control.SetVocabulary(vocab_size=100, excluded_token_ids=[0, 2]),
            core.SetVocabulary(100, (0, 2)),
        ),
        (control.WaitIdle(), None),
        (control.Ping(), None),
        (control.Pause(), core.Pause(core.PauseMode.ABORT, True)),
        (control.Pause(mode="keep", clear_cache=False), core.Pause(core.PauseMode.KEEP, False)),
        (control.Resume(), core.Resume()),
        (control.Sleep(), core.Sleep(1, core.PauseMode.ABORT)),
        (control.Sleep(level=0, mode="wait"), core.Sleep(0, core.PauseMode.WAIT)),
        (control.WakeUp(), core.WakeUp(None)),
        (control.WakeUp(tags=["weights"]), core.WakeUp(("weights",))),
    ],
    ids=lambda v: type(v).__name__,
)
def test_to_core_command(msg: control.ClientMessage, command: core.Command | None) -> None:
    assert convert.to_core_command(msg) == command


def test_to_core_command_names_an_unnamed_request() -> None:
    unnamed = control.WireRequest(token_ids=[4], max_tokens=1)
    named = core.Request(token_ids=[4], max_tokens=1, request_id="given")
    assert convert.to_core_command(
        control.Submit(request=unnamed), request_id="given"
    ) == core.Submit(named)
    assert convert.to_core_command(
        control.ReserveDestination(handoff_id="h", request=unnamed), request_id="given"
    ) == core.ReserveDestination("h", named)
    assert convert.to_core_command(control.Cancel(request_id="c"), request_id="x") == core.Cancel(
        "c"
    )


class TestToOutputEntry:
    def test_a_burst_is_one_entry_with_its_cached_tokens(self) -> None:
        entry = convert.to_output_entry(
            core.RequestOutput("b", [10, 11, 12], core.FinishReason.LENGTH, 32)
        )
        assert entry == control.OutputEntry(
            request_id="b",
            token_ids=[10, 11, 12],
            finished=True,
            finish_reason="length",
            cached_tokens=32,
        )

    def test_an_unfinished_output(self) -> None:
        entry = convert.to_output_entry(core.RequestOutput("a", [1], None, 0))
        assert entry == control.OutputEntry(
            request_id="a", token_ids=[1], finished=False, finish_reason=None, cached_tokens=0
        )

    @pytest.mark.parametrize(
        ("reason", "spelled"),
        [(core.FinishReason.REJECTED, "rejected"), (core.FinishReason.CANCELLED, "cancelled")],
    )
    def test_token_less_ends(
        self, reason: core.FinishReason, spelled: control.FinishReason
    ) -> None:
        entry = convert.to_output_entry(core.RequestOutput("r", [], reason))
        assert entry == control.OutputEntry(
            request_id="r", token_ids=[], finished=True, finish_reason=spelled
        )
        assert type(entry.finish_reason) is str  # the wire's literal, not the core's enum

    def test_prefill_terminal_carries_the_handoff_delay(self) -> None:
        entry = convert.to_output_entry(
            core.RequestOutput("p", [5], core.FinishReason.LENGTH, 0, 3.25)
        )
        assert entry.handoff_delay_ms == 3.25
        assert entry.cached_tokens == 0
        assert entry.finish_reason == "length"

    def test_a_stop_carries_its_stop_id(self) -> None:
        entry = convert.to_output_entry(
            core.RequestOutput("s", [4, 2], core.FinishReason.STOP, None, None, 2)
        )
        assert entry == control.OutputEntry(
            request_id="s", token_ids=[4, 2], finished=True, finish_reason="stop", stop_reason=2
        )

    def test_every_core_reason_has_a_wire_spelling(self) -> None:
        for reason in core.FinishReason:
            assert convert.to_output_entry(core.RequestOutput("r", [], reason)).finished


def test_to_wire_lifecycle() -> None:
    timing = core.TransferTiming(
        mode=core.KvTransferTimingMode.FULL_PROMPT,
        full_prompt_tokens=8,
        kv_bytes_per_token=None,
        bandwidth_gb_s=None,
    )
    held = core.SourceHeld(handoff_id="h", request_id="r", transfer_timing=timing)
    reserved = core.DestinationReserved(
        handoff_id="h2", request_id="r2", transferable_prompt_tokens=16
    )
    wire_held = convert.to_wire_lifecycle(held)
    assert wire_held == control.SourceHeldEvent(
        handoff_id="h",
        request_id="r",
        transfer_timing=control.TransferTiming(
            mode=control.KvTransferTimingMode.FULL_PROMPT,
            full_prompt_tokens=8,
            kv_bytes_per_token=None,
            bandwidth_gb_s=None,
        ),
    )
    assert isinstance(wire_held, control.SourceHeldEvent)
    assert wire_held.transfer_timing is timing
    assert convert.to_wire_lifecycle(reserved) == control.DestinationReservedEvent(
        handoff_id="h2", request_id="r2", transferable_prompt_tokens=16
    )
    with pytest.raises(TypeError, match="Not a lifecycle event"):
        convert.to_wire_lifecycle("source_held")  # type: ignore[arg-type]


def test_core_timing_keeps_the_one_delay_formula() -> None:
    """A `transfer_timing` decoded off the wire is the core's record, with its formula."""
    frame = msgspec.msgpack.encode(
        {
            "mode": "destination_missing",
            "full_prompt_tokens": 100,
            "kv_bytes_per_token": 131072,
            "bandwidth_gb_s": 25.0,
        }
    )
    timing = msgspec.msgpack.decode(frame, type=control.TransferTiming)
    assert control.TransferTiming is core.TransferTiming
    assert timing.mode is core.KvTransferTimingMode.DESTINATION_MISSING
    assert timing.delay_ms(48) == pytest.approx(48 * 131072 / 25e9 * 1000)


def test_rank_stats() -> None:
    metrics = core.EngineMetrics(
        dp_rank=1,
        active_blocks=4,
        inactive_blocks=2,
        total_blocks=10,
        kv_cache_usage=0.4,
        running=2,
        waiting=1,
        preemptions_total=3,
    )
    assert convert.rank_stats(metrics, passes_total=99) == control.RankStats(
        dp_rank=1,
        active_blocks=4,
        inactive_blocks=2,
        total_blocks=10,
        kv_cache_usage=0.4,
        running=2,
        waiting=1,
        preemptions_total=3,
        passes_total=99,
    )


def test_rank_stats_reports_every_core_gauge_it_names() -> None:
    """A `stats` entry takes the core's gauges by name: each means what the core's does."""
    stats_hints = get_type_hints(control.RankStats)
    core_hints = get_type_hints(core.EngineMetrics)
    shared = {name for name in core_hints if name in stats_hints}
    assert set(core_hints) - shared == {"waiting_deferred", "waiting_for_kv"}
    assert {name: stats_hints[name] for name in shared} == {
        name: core_hints[name] for name in shared
    }
    metrics = core.EngineMetrics(1, 4, 2, 10, 0.4, 2, 1, 3, 5, 6, 7, 8, 9, 11, waiting_deferred=1)
    stats = convert.rank_stats(
        metrics, passes_total=99, lateness_ms=(1.0, 2.0, 3.0), kv_events_overflows=12
    )
    assert stats == control.RankStats(
        dp_rank=1,
        active_blocks=4,
        inactive_blocks=2,
        total_blocks=10,
        kv_cache_usage=0.4,
        running=2,
        waiting=1,
        preemptions_total=3,
        passes_total=99,
        lateness_p50_ms=1.0,
        lateness_p99_ms=2.0,
        lateness_max_ms=3.0,
        g2_active_blocks=5,
        g2_inactive_blocks=6,
        g2_total_blocks=7,
        g3_active_blocks=8,
        g3_inactive_blocks=9,
        g3_total_blocks=11,
        kv_events_overflows=12,
    )
