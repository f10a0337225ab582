"""Forward-pass metrics: Dynamo's v1 schema, key order, heartbeat, decoding."""

from __future__ import annotations

import msgspec
import pytest

from engined.core.types import FpmSnapshot
from engined.wire import fpm_schema
from engined.wire.protocol_errors import WireError

SNAPSHOT = FpmSnapshot(
    num_prefill_requests=2,
    sum_prefill_tokens=300,
    var_prefill_length=2500.0,
    sum_prefill_kv_tokens=64,
    num_decode_requests=3,
    sum_decode_kv_tokens=1200,
    var_decode_kv_tokens=12.5,
    num_queued_prefill=1,
    sum_queued_prefill_tokens=128,
    var_queued_prefill_length=4.0,
    num_queued_decode=5,
    sum_queued_decode_kv_tokens=640,
    var_queued_decode_kv_tokens=8.0,
    wall_time_secs=0.0125,
)


# Dynamo's `dynamo/common/forward_pass_metrics.py` v1 struct tree, restated independently of
# engined.wire.fpm_schema so a reordered or renamed field there fails the byte comparison below.
class _DynScheduled(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class _DynQueued(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class _DynForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    version: int = 1
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    wall_time: float = 0.0
    scheduled_requests: _DynScheduled = msgspec.field(default_factory=_DynScheduled)
    queued_requests: _DynQueued = msgspec.field(default_factory=_DynQueued)


def test_bytes_equal_dynamos_struct_for_the_same_values() -> None:
    expected = msgspec.msgpack.encode(
        _DynForwardPassMetrics(
            worker_id="w",
            dp_rank=1,
            counter_id=7,
            wall_time=0.0125,
            scheduled_requests=_DynScheduled(2, 300, 2500.0, 64, 3, 1200, 12.5),
            queued_requests=_DynQueued(1, 128, 4.0, 5, 640, 8.0),
        )
    )
    assert fpm_schema.encode_fpm(SNAPSHOT, worker_id="w", dp_rank=1, counter_id=7) == expected


def test_heartbeat_equals_dynamos_default_struct() -> None:
    expected = msgspec.msgpack.encode(
        _DynForwardPassMetrics(worker_id="w", dp_rank=2, counter_id=9)
    )
    assert fpm_schema.heartbeat(worker_id="w", dp_rank=2, counter_id=9) == expected


def test_key_order_is_the_schemas() -> None:
    payload = msgspec.msgpack.decode(
        fpm_schema.encode_fpm(SNAPSHOT, worker_id="w", dp_rank=0, counter_id=0)
    )
    assert list(payload) == [
        "version",
        "worker_id",
        "dp_rank",
        "counter_id",
        "wall_time",
        "scheduled_requests",
        "queued_requests",
    ]
    assert list(payload["scheduled_requests"]) == [
        "num_prefill_requests",
        "sum_prefill_tokens",
        "var_prefill_length",
        "sum_prefill_kv_tokens",
        "num_decode_requests",
        "sum_decode_kv_tokens",
        "var_decode_kv_tokens",
    ]
    assert list(payload["queued_requests"]) == [
        "num_prefill_requests",
        "sum_prefill_tokens",
        "var_prefill_length",
        "num_decode_requests",
        "sum_decode_kv_tokens",
        "var_decode_kv_tokens",
    ]


def test_snapshot_maps_onto_the_nested_schema() -> None:
    metrics = fpm_schema.decode_fpm(
        fpm_schema.encode_fpm(SNAPSHOT, worker_id="w", dp_rank=1, counter_id=7)
    )
    assert metrics == fpm_schema.ForwardPassMetrics(
        version=1,
        worker_id="w",
        dp_rank=1,
        counter_id=7,
        wall_time=0.0125,
        scheduled_requests=fpm_schema.ScheduledRequestMetrics(
            num_prefill_requests=2,
            sum_prefill_tokens=300,
            var_prefill_length=2500.0,
            sum_prefill_kv_tokens=64,
            num_decode_requests=3,
            sum_decode_kv_tokens=1200,
            var_decode_kv_tokens=12.5,
        ),
        queued_requests=fpm_schema.QueuedRequestMetrics(
            num_prefill_requests=1,
            sum_prefill_tokens=128,
            var_prefill_length=4.0,
            num_decode_requests=5,
            sum_decode_kv_tokens=640,
            var_decode_kv_tokens=8.0,
        ),
    )


def test_float_fields_are_float64_even_when_the_core_gives_ints() -> None:
    snapshot = FpmSnapshot(var_prefill_length=0, wall_time_secs=1, var_queued_decode_kv_tokens=3)
    payload = msgspec.msgpack.decode(
        fpm_schema.encode_fpm(snapshot, worker_id="", dp_rank=0, counter_id=0)
    )
    floats = [
        payload["wall_time"],
        payload["scheduled_requests"]["var_prefill_length"],
        payload["scheduled_requests"]["var_decode_kv_tokens"],
        payload["queued_requests"]["var_prefill_length"],
        payload["queued_requests"]["var_decode_kv_tokens"],
    ]
    assert all(type(value) is float for value in floats)


def test_heartbeat_is_all_zeros() -> None:
    metrics = fpm_schema.decode_fpm(fpm_schema.heartbeat(worker_id="w", dp_rank=3, counter_id=12))
    assert metrics == fpm_schema.ForwardPassMetrics(worker_id="w", dp_rank=3, counter_id=12)
    assert metrics.wall_time == 0.0
    assert metrics.version == fpm_schema.FPM_VERSION == 1


def test_heartbeat_equals_an_empty_snapshot() -> None:
    assert fpm_schema.heartbeat(worker_id="w", dp_rank=0, counter_id=1) == fpm_schema.encode_fpm(
        FpmSnapshot(), worker_id="w", dp_rank=0, counter_id=1
    )


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode([1, "w"]), "Expected `object`, got `array`"),
        (msgspec.msgpack.encode({"version": "1"}), r"at `\$\.version`"),
        (msgspec.msgpack.encode({"version": 2}), r"Unsupported FPM version 2.*`\$\.version`"),
    ],
)
def test_decode_refuses_malformed_payloads(payload: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match) as info:
        fpm_schema.decode_fpm(payload)
    assert info.value.code == "bad_message"


@pytest.mark.parametrize(
    "value",
    [
        fpm_schema.ScheduledRequestMetrics(1, 2, 3.5, 4, 5, 6, 7.5),
        fpm_schema.QueuedRequestMetrics(1, 2, 3.5, 4, 5, 6.5),
        fpm_schema.make_fpm(SNAPSHOT, worker_id="w", dp_rank=1, counter_id=2),
    ],
    ids=lambda v: type(v).__name__,
)
def test_struct_round_trip(value: msgspec.Struct) -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=type(value)) == value
