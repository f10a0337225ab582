"""Golden frames: engined's encoder output for fixed inputs, kept in `proto/golden/`.

`python -m engined.wire.golden [DIR]` rewrites the `engined_*.bin` files; the
`vllm*_reference_*.bin` files next to them are vLLM's own bytes and are never regenerated.
A test fails when `golden_frames()` differs from the committed files, so any change to the
bytes on the wire shows up in review as a changed binary plus this module's inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from engined.core import types as core
from engined.core.args import EngineType, WorkerType
from engined.wire import control, fpm_schema
from engined.wire.kv_events import KvEventEncoder
from engined.wire.output_bytes import OutputWriter

DEFAULT_DIR: Final = Path(__file__).resolve().parents[2] / "proto" / "golden"

TS: Final = 1757500000.25
H1: Final = 0x9D3C5A6E1F2B4C70  # >= 2**63: msgpack uint64
H2: Final = 0x1A2B3C4D5E6F7081  # in [2**32, 2**63)
H_SMALL: Final = 5  # < 2**32: published as 2**63 | 5

# One pass's events: a root store of two blocks, a CPU store chained on it whose hash needs
# the remap, an eviction, and a reset.
KV_EVENTS: Final[tuple[core.KvEvent, ...]] = (
    core.BlockStored(
        event_id=0,
        dp_rank=1,
        parent_hash=None,
        block_hashes=[H1, H2],
        local_hashes=[11, 12],
        token_ids=[128000, 9125, 271, 1, 2, 3, 4, 5],
        block_size=4,
    ),
    core.BlockStored(
        event_id=1,
        dp_rank=1,
        parent_hash=H2,
        block_hashes=[H_SMALL],
        local_hashes=[13],
        token_ids=[6, 7, 8, 9],
        block_size=4,
        medium=core.Medium.CPU,
    ),
    core.BlockRemoved(event_id=2, dp_rank=1, block_hashes=[H1]),
    core.AllBlocksCleared(event_id=3, dp_rank=1),
)

FPM_SNAPSHOT: Final = core.FpmSnapshot(
    num_prefill_requests=2,
    sum_prefill_tokens=300,
    var_prefill_length=2500.0,
    sum_prefill_kv_tokens=64,
    num_decode_requests=3,
    sum_decode_kv_tokens=1200,
    var_decode_kv_tokens=12.5,
    num_queued_prefill=1,
    sum_queued_prefill_tokens=128,
    var_queued_prefill_length=0.0,
    num_queued_decode=0,
    sum_queued_decode_kv_tokens=0,
    var_queued_decode_kv_tokens=0.0,
    wall_time_secs=0.0125,
)

SUBMIT: Final = control.Submit(
    id=1,
    request=control.WireRequest(
        request_id="req-1", token_ids=[1, 2, 3, 4, 5], max_tokens=8, dp_rank=0
    ),
)
SUBMIT_STOPS: Final = control.Submit(
    id=2,
    request=control.WireRequest(
        token_ids=[1, 2, 3, 4, 5],
        max_tokens=16,
        stop_token_ids=[2, 128009],
        min_tokens=4,
        cache_salt="tenant-a",
    ),
)
RESERVE_DESTINATION: Final = control.ReserveDestination(
    id="c-7",
    handoff_id="h-1",
    request=control.WireRequest(
        token_ids=[1, 2, 3, 4], max_tokens=4, output_token_ids=[9, 9], seed=1234
    ),
)
WELCOME: Final = control.Welcome(
    id=1,
    protocol=control.PROTOCOL_VERSION,
    version="0.1.0",
    engine_type=EngineType.VLLM,
    worker_type=WorkerType.AGGREGATED,
    block_size=16,
    num_gpu_blocks=16384,
    dp_size=2,
    model_name="Qwen/Qwen3-0.6B",
    kv_events_endpoints=["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"],
    kv_replay_endpoints=[],
    fpm_endpoints=["tcp://127.0.0.1:20380", "tcp://127.0.0.1:20381"],
    instance_id="9f86d081884c7d659a2feaa0c55ad015",
)
OUTPUT: Final = control.Output(
    dp_rank=0,
    outputs=[
        control.OutputEntry(
            request_id="req-1",
            token_ids=[42],
            finished=False,
            finish_reason=None,
            cached_tokens=0,
        ),
        control.OutputEntry(
            request_id="req-2",
            token_ids=[7, 8, 9],
            finished=True,
            finish_reason="length",
            handoff_delay_ms=1.5,
        ),
    ],
)
OUTPUT_STOP: Final = control.Output(
    dp_rank=0,
    outputs=[
        control.OutputEntry(
            request_id="req-5",
            token_ids=[7, 128009],
            finished=True,
            finish_reason="stop",
            stop_reason=128009,
        ),
    ],
)
# A decoding pass as the daemon sends it to one client (`OutputWriter` writes its bytes):
# plain decode steps, with a one-byte and a uint32 token, around OUTPUT's two entries.
PASS_OUTPUTS: Final = [
    core.RequestOutput("req-1", [42], None, 0),
    core.RequestOutput("req-2", [7, 8, 9], core.FinishReason.LENGTH, handoff_delay_ms=1.5),
]
PASS_DECODES: Final = core.Decodes(["req-3", "req-4"], [5, 128009], [0, 1])
PASS_OWNER: Final = b"client"
_STEP_3, _STEP_4 = (
    control.OutputEntry(request_id=r, token_ids=[t], finished=False, finish_reason=None)
    for r, t in (("req-3", 5), ("req-4", 128009))
)
OUTPUT_PASS: Final = control.Output(
    dp_rank=1, outputs=[OUTPUT.outputs[0], _STEP_3, OUTPUT.outputs[1], _STEP_4]
)


def pass_output() -> bytes:
    """The `output` message `OutputWriter` writes for the pass above."""
    owners = dict.fromkeys(["req-1", "req-2", "req-3", "req-4"], PASS_OWNER)
    messages, _ = OutputWriter(str).route(PASS_OUTPUTS, PASS_DECODES, owners, 1)
    return messages[PASS_OWNER]


LIFECYCLE: Final = control.Lifecycle(
    dp_rank=1,
    events=[
        control.SourceHeldEvent(
            handoff_id="h-1",
            request_id="req-3",
            transfer_timing=control.TransferTiming(
                mode=control.KvTransferTimingMode.DESTINATION_MISSING,
                full_prompt_tokens=100,
                kv_bytes_per_token=131072,
                bandwidth_gb_s=25.0,
            ),
        ),
        control.DestinationReservedEvent(
            handoff_id="h-2", request_id="req-4", transferable_prompt_tokens=48
        ),
    ],
)
METRICS: Final = control.Metrics(id=5, accept="application/openmetrics-text; version=1.0.0")
METRICS_REPLY: Final = control.MetricsReply(
    id=5,
    content_type="text/plain; version=0.0.4; charset=utf-8",
    text="# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="engined"} 0.0\n',
)
ERROR: Final = control.ErrorReply(
    id=3,
    code="invalid_request",
    message="Expected `array` of length >= 1 - at `$.request.token_ids`",
)


def golden_frames() -> dict[str, bytes]:
    """engined's bytes for the fixed inputs above, by golden file name."""
    return {
        "engined_kv_vllm.bin": KvEventEncoder("vllm").encode_batch(TS, KV_EVENTS, 1),
        "engined_kv_vllm_array.bin": KvEventEncoder("vllm-array").encode_batch(TS, KV_EVENTS, 1),
        "engined_fpm_pass.bin": fpm_schema.encode_fpm(
            FPM_SNAPSHOT, worker_id="worker-a", dp_rank=1, counter_id=41
        ),
        "engined_fpm_heartbeat.bin": fpm_schema.heartbeat(
            worker_id="worker-a", dp_rank=1, counter_id=42
        ),
        "engined_control_submit.bin": control.encode_message(SUBMIT),
        "engined_control_submit_stops.bin": control.encode_message(SUBMIT_STOPS),
        "engined_control_reserve_destination.bin": control.encode_message(RESERVE_DESTINATION),
        "engined_control_welcome.bin": control.encode_reply(WELCOME),
        "engined_control_output.bin": control.encode_reply(OUTPUT),
        "engined_control_output_stop.bin": control.encode_reply(OUTPUT_STOP),
        "engined_control_output_pass.bin": pass_output(),
        "engined_control_lifecycle.bin": control.encode_reply(LIFECYCLE),
        "engined_control_error.bin": control.encode_reply(ERROR),
        "engined_control_metrics.bin": control.encode_message(METRICS),
        "engined_control_metrics_reply.bin": control.encode_reply(METRICS_REPLY),
    }


def write_golden(directory: Path = DEFAULT_DIR) -> list[Path]:
    """Write every `engined_*.bin` file into `directory`; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, payload in golden_frames().items():
        path = directory / name
        path.write_bytes(payload)
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_golden(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR):
        print(written_path)
