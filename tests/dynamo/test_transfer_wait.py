"""The decode side's modeled KV transfer wait (engined/dynamo/handler.py `_transfer_wait_s`).

The prefill worker passes its `source_held` timing in `disaggregated_params`; the decode
worker applies it to its own reservation, so `destination_missing` waits only for the
tokens its prefix cache lacks. The params come from another process over Dynamo's request
plane: malformed timing is refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.dynamo.handler import RequestFailed, _transfer_wait_s
from engined.wire.control import DestinationReservedEvent

# 128 KiB per token over 25 GB/s: 5.24288 us per token.
PER_TOKEN_MS = 131072 / 25e9 * 1000
RESERVED = DestinationReservedEvent(handoff_id="h", request_id="r", transferable_prompt_tokens=48)


def params(timing_mode: str | None, *, speedup: float = 1.0, **timing: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"handoff_delay_ms": 100 * PER_TOKEN_MS, "speedup_ratio": speedup}
    if timing_mode is not None:
        base["transfer_timing"] = {
            "mode": timing_mode,
            "full_prompt_tokens": 100,
            "kv_bytes_per_token": 131072,
            "bandwidth_gb_s": 25.0,
            **timing,
        }
    return base


@pytest.mark.parametrize(
    ("mode", "tokens"), [("full_prompt", 100), ("destination_missing", 48), (None, 100)]
)
def test_the_source_timing_decides_the_tokens_moved(mode: str | None, tokens: int) -> None:
    assert _transfer_wait_s(params(mode), RESERVED) == pytest.approx(tokens * PER_TOKEN_MS / 1e3)


def test_the_wait_is_wall_time_at_the_speedup() -> None:
    wait = _transfer_wait_s(params("destination_missing", speedup=4.0), RESERVED)
    assert wait == pytest.approx(48 * PER_TOKEN_MS / 1e3 / 4)
    assert _transfer_wait_s(params("destination_missing", speedup=0.0), RESERVED) == 0.0


def test_an_unmodelled_transfer_waits_nothing() -> None:
    assert _transfer_wait_s(params("full_prompt", kv_bytes_per_token=None), RESERVED) == 0.0


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"mode": "sideways"}, "mode"),
        ({"full_prompt_tokens": "many"}, "full_prompt_tokens"),
        ({"bandwidth_gb_s": [1]}, "bandwidth_gb_s"),
    ],
)
def test_malformed_timing_is_refused_naming_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestFailed) as caught:
        _transfer_wait_s(params("full_prompt", **bad), RESERVED)
    assert caught.value.status == 400
    assert "disaggregated_params.engined.transfer_timing" in caught.value.message
    assert field in caught.value.message


def test_timing_that_is_not_a_map_is_refused() -> None:
    bad = {"speedup_ratio": 1.0, "transfer_timing": "fast"}
    with pytest.raises(RequestFailed) as caught:
        _transfer_wait_s(bad, RESERVED)
    assert caught.value.status == 400
