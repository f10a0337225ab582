"""Golden frames in proto/golden: committed bytes equal the encoders, and decode back."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from engined.wire import control, fpm_schema, golden
from engined.wire import kv_events as kv
from tests.wire._paths import GOLDEN_DIR

FRAMES = golden.golden_frames()


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_committed_golden_equals_encoder_output(name: str) -> None:
    path = GOLDEN_DIR / name
    assert path.exists(), f"{name} missing: run `python -m engined.wire.golden`"
    assert path.read_bytes() == FRAMES[name], (
        f"{name} is stale: run `python -m engined.wire.golden`"
    )


def test_no_stale_engined_frames_on_disk() -> None:
    on_disk = {path.name for path in GOLDEN_DIR.glob("engined_*.bin")}
    assert on_disk == set(FRAMES)


def test_readme_lists_every_golden_file() -> None:
    readme = (GOLDEN_DIR / "README.md").read_text(encoding="utf-8")
    missing = [path.name for path in GOLDEN_DIR.glob("*.bin") if f"`{path.name}`" not in readme]
    assert missing == []


def test_write_golden_reproduces_the_committed_files(tmp_path: Path) -> None:
    written = golden.write_golden(tmp_path)
    assert {path.name: path.read_bytes() for path in written} == FRAMES


@pytest.mark.parametrize("fmt", ["vllm", "vllm-array"])
def test_kv_golden_decodes_to_its_inputs(fmt: kv.KvEventFormat) -> None:
    name = "engined_kv_vllm.bin" if fmt == "vllm" else "engined_kv_vllm_array.bin"
    batch = kv.decode_batch(FRAMES[name])
    assert (batch.ts, batch.data_parallel_rank) == (golden.TS, 1)
    first, second, third, fourth = batch.events
    assert isinstance(first, kv.BlockStored | kv.ArrayBlockStored)
    assert first.block_hashes == [golden.H1, golden.H2]
    assert isinstance(second, kv.BlockStored | kv.ArrayBlockStored)
    assert (second.block_hashes, second.parent_block_hash, second.medium) == (
        [2**63 | golden.H_SMALL],
        golden.H2,
        "CPU",
    )
    assert isinstance(third, kv.BlockRemoved | kv.ArrayBlockRemoved)
    assert third.block_hashes == [golden.H1]
    assert isinstance(fourth, kv.AllBlocksCleared | kv.ArrayAllBlocksCleared)


def test_fpm_golden_decodes_to_its_inputs() -> None:
    metrics = fpm_schema.decode_fpm(FRAMES["engined_fpm_pass.bin"])
    assert metrics == fpm_schema.make_fpm(
        golden.FPM_SNAPSHOT, worker_id="worker-a", dp_rank=1, counter_id=41
    )
    heartbeat = fpm_schema.decode_fpm(FRAMES["engined_fpm_heartbeat.bin"])
    assert heartbeat == fpm_schema.ForwardPassMetrics(
        worker_id="worker-a", dp_rank=1, counter_id=42
    )


def test_control_golden_decodes_to_its_inputs() -> None:
    decoder, replies = control.ControlDecoder(), control.ReplyDecoder()
    assert decoder.decode(FRAMES["engined_control_submit.bin"]) == golden.SUBMIT
    assert decoder.decode(FRAMES["engined_control_submit_stops.bin"]) == golden.SUBMIT_STOPS
    reserve = FRAMES["engined_control_reserve_destination.bin"]
    assert decoder.decode(reserve) == golden.RESERVE_DESTINATION
    assert replies.decode(FRAMES["engined_control_welcome.bin"]) == golden.WELCOME
    assert replies.decode(FRAMES["engined_control_output.bin"]) == golden.OUTPUT
    assert replies.decode(FRAMES["engined_control_output_stop.bin"]) == golden.OUTPUT_STOP
    assert replies.decode(FRAMES["engined_control_output_pass.bin"]) == golden.OUTPUT_PASS
    assert replies.decode(FRAMES["engined_control_lifecycle.bin"]) == golden.LIFECYCLE
    assert replies.decode(FRAMES["engined_control_error.bin"]) == golden.ERROR
    assert decoder.decode(FRAMES["engined_control_metrics.bin"]) == golden.METRICS
    assert replies.decode(FRAMES["engined_control_metrics_reply.bin"]) == golden.METRICS_REPLY


def test_reference_files_are_vllms_bytes_as_documented() -> None:
    """The reference files hold the hex quoted in the research notes, unchanged."""
    sizes = {path.name: len(path.read_bytes()) for path in GOLDEN_DIR.glob("vllm*_reference_*.bin")}
    assert sizes == {
        "vllm033_reference_block_stored_x2.bin": 267,
        "vllm033_reference_block_removed.bin": 59,
        "vllm033_reference_all_blocks_cleared.bin": 35,
        "vllm033_reference_block_stored_parent.bin": 198,
        "vllm033_reference_block_stored_salted.bin": 221,
        "vllm033_reference_block_stored_lora.bin": 247,
        "vllm033_reference_block_stored_lookahead.bin": 237,
        "vllm024_032_reference_block_stored.bin": 210,
        "vllm024_032_reference_removed_cleared.bin": 99,
        "vllm023_reference_block_stored.bin": 89,
        "vllm023_reference_removed_cleared.bin": 59,
    }
    for name in sizes:
        assert msgspec.msgpack.decode((GOLDEN_DIR / name).read_bytes())[0] > 1.6e9


def test_the_daemon_s_output_bytes_are_the_encoder_s() -> None:
    """The daemon writes `output` messages as bytes (`OutputWriter`): the same bytes the
    Structs encode to."""
    assert FRAMES["engined_control_output_pass.bin"] == control.encode_reply(golden.OUTPUT_PASS)
