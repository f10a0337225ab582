"""Forward-pass metrics in Dynamo's `ForwardPassMetrics` v1 wire schema.

The structs copy `dynamo/common/forward_pass_metrics.py` field for field (maps with string keys
in declaration order, every field present), which is what Dynamo's `FpmEventRelay` forwards and
its planner decodes. The publisher frames a payload as `[b"", seq_bytes(seq), payload]` and
stamps `counter_id = seq`.
"""

from __future__ import annotations

from typing import Final

import msgspec

from engined.core.types import FpmSnapshot
from engined.wire.protocol_errors import WireError

FPM_VERSION: Final = 1


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """Requests executed in the pass (prefill chunks and decode steps)."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """Requests left waiting after the pass."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    """One message per executed pass; all zeros with `wall_time == 0.0` is an idle heartbeat."""

    # NOTE: no `omit_defaults`: Dynamo's struct writes every field, so zeros are sent rather
    # than omitted, which keeps our bytes equal to Dynamo's for the same values.

    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = msgspec.field(
        default_factory=ScheduledRequestMetrics
    )
    queued_requests: QueuedRequestMetrics = msgspec.field(default_factory=QueuedRequestMetrics)


_ENCODE: Final = msgspec.msgpack.Encoder().encode
_DECODER: Final = msgspec.msgpack.Decoder(ForwardPassMetrics)
_IDLE_SCHEDULED: Final = ScheduledRequestMetrics()
_IDLE_QUEUED: Final = QueuedRequestMetrics()


def make_fpm(
    snapshot: FpmSnapshot, *, worker_id: str, dp_rank: int, counter_id: int
) -> ForwardPassMetrics:
    """Map the core's flat snapshot onto Dynamo's nested schema (as the Rust mocker does).

    Variances and the wall time go through `float()`: the schema types them float64 and a
    core that computed an exact 0 must not put a msgpack int on the wire.
    """
    s = snapshot
    return ForwardPassMetrics(
        version=FPM_VERSION,
        worker_id=worker_id,
        dp_rank=dp_rank,
        counter_id=counter_id,
        wall_time=float(s.wall_time_secs),
        scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=s.num_prefill_requests,
            sum_prefill_tokens=s.sum_prefill_tokens,
            var_prefill_length=float(s.var_prefill_length),
            sum_prefill_kv_tokens=s.sum_prefill_kv_tokens,
            num_decode_requests=s.num_decode_requests,
            sum_decode_kv_tokens=s.sum_decode_kv_tokens,
            var_decode_kv_tokens=float(s.var_decode_kv_tokens),
        ),
        queued_requests=QueuedRequestMetrics(
            num_prefill_requests=s.num_queued_prefill,
            sum_prefill_tokens=s.sum_queued_prefill_tokens,
            var_prefill_length=float(s.var_queued_prefill_length),
            num_decode_requests=s.num_queued_decode,
            sum_decode_kv_tokens=s.sum_queued_decode_kv_tokens,
            var_decode_kv_tokens=float(s.var_queued_decode_kv_tokens),
        ),
    )


def encode_fpm(snapshot: FpmSnapshot, *, worker_id: str, dp_rank: int, counter_id: int) -> bytes:
    """The payload for one executed pass; `counter_id` is the message's seq."""
    return _ENCODE(make_fpm(snapshot, worker_id=worker_id, dp_rank=dp_rank, counter_id=counter_id))


def heartbeat(*, worker_id: str, dp_rank: int, counter_id: int) -> bytes:
    """The idle heartbeat: every counter zero and `wall_time` 0.0, sent after 1 s without a pass."""
    return _ENCODE(
        ForwardPassMetrics(
            version=FPM_VERSION,
            worker_id=worker_id,
            dp_rank=dp_rank,
            counter_id=counter_id,
            wall_time=0.0,
            scheduled_requests=_IDLE_SCHEDULED,
            queued_requests=_IDLE_QUEUED,
        )
    )


def decode_fpm(payload: bytes) -> ForwardPassMetrics:
    """Decode one payload.

    Raises:
        WireError: `bad_message` when the bytes do not fit the schema or `version` is not 1
            (Dynamo's decoder drops such messages with a warning).
    """
    try:
        metrics = _DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError("bad_message", str(exc)) from None
    if metrics.version != FPM_VERSION:
        raise WireError(
            "bad_message",
            f"Unsupported FPM version {metrics.version}, expected {FPM_VERSION} - at `$.version`",
        )
    return metrics
