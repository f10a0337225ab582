"""The operator CLI (`engined submit|events|fpm|stats|bench`) against a live daemon.

One daemon (two data-parallel ranks, speedup 0, caching on, replay on) serves the module.
Commands that end on their own run in-process through typer's CliRunner; commands that follow
a stream (`events`, `fpm`) run as subprocesses while the test drives load until they exit,
because a subscriber only sees what is published after it joined. Every wait is bounded (a
deadline on the subprocess, `--count` on the stream, timeouts on sockets); nothing sleeps to
synchronise. Output is read with `--json` and checked line by line; a few checks read the
plain-text mode too.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from typer.testing import CliRunner, Result

from engined.cli import app
from engined.client import EngineClient
from engined.config import ENV_PREFIX
from engined.core import types as core
from engined.tools.bench import Workload
from engined.tools.bench_report import percentile
from engined.tools.distributions import Distribution, parse_distribution
from engined.wire.kv_events import REPLAY_END_FRAMES, KvEventEncoder, read_seq, seq_bytes
from tests.server.daemon_harness import DaemonProcess, start_daemon

BLOCK_SIZE = 16
DP_SIZE = 2
DAEMON_FLAGS = (
    "--speedup-ratio",
    "0",
    "--block-size",
    str(BLOCK_SIZE),
    "--num-gpu-blocks",
    "4096",
    "--data-parallel-size",
    str(DP_SIZE),
)
ENGINED = [sys.executable, "-m", "engined.cli"]
# Bound on one streaming command run (start-up of a Python process included).
RUN_TIMEOUT_S = 60.0
# Prompts never seen before, so each one stores new blocks (and publishes BlockStored).
_fresh = itertools.count(1)


def fresh_prompt(blocks: int = 2, extra: int = 3) -> list[int]:
    rng = random.Random(f"cli-tools-{next(_fresh)}")
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK_SIZE + extra)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with start_daemon(tmp_path_factory.mktemp("cli"), *DAEMON_FLAGS) as running:
        yield running


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ENGINED_* variable left in the shell (the control endpoint) would steer the tests."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, list(args), env=env)


def records(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def plain(text: str) -> str:
    """typer's error box without its frame and line breaks, for substring checks."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


async def generate(control: str, prompt: list[int], max_tokens: int, dp_rank: int = 0) -> None:
    async with await EngineClient.connect(control) as client:
        gen = await client.generate(prompt, max_tokens, dp_rank=dp_rank, timeout=10)
        assert gen.finish_reason == "length"


def run_while_loading(
    daemon: DaemonProcess, *args: str, ranks: tuple[int, ...] = (0,)
) -> tuple[int, str, str]:
    """Run `engined ARGS` as a process and submit fresh prompts until it exits.

    The load is what the streaming command waits for: each request stores new blocks and
    runs a few passes. Returns (exit code, stdout, stderr).
    """

    async def scenario() -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *ENGINED,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        done = asyncio.ensure_future(proc.communicate())
        try:
            async with asyncio.timeout(RUN_TIMEOUT_S):
                async with await EngineClient.connect(daemon.control) as client:
                    for n in itertools.count():
                        if done.done():
                            break
                        rank = ranks[n % len(ranks)]
                        await client.generate(fresh_prompt(), 2, dp_rank=rank, timeout=10)
                out, err = await done
        except TimeoutError:
            proc.kill()
            out, err = await done
            raise AssertionError(f"engined {args} did not finish: {err.decode()}") from None
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    return asyncio.run(scenario())


# --- submit ---------------------------------------------------------------------------------


def test_submit_streams_every_output(daemon: DaemonProcess) -> None:
    result = invoke(
        "submit",
        "--random-prompt",
        "40",
        "--seed",
        "7",
        "--max-tokens",
        "5",
        "--request-id",
        "cli-submit-1",
        "--control-endpoint",
        daemon.control,
        "--json",
    )
    assert result.exit_code == 0, result.output
    lines = records(result.stdout)
    assert lines[0] == {
        "type": "submitted",
        "request_id": "cli-submit-1",
        "dp_rank": lines[0]["dp_rank"],
        "prompt_tokens": 40,
    }
    outputs = [r for r in lines if r["type"] == "output"]
    assert sum(len(r["token_ids"]) for r in outputs) == 5
    assert outputs[0]["cached_tokens"] == 0
    assert [r["finished"] for r in outputs] == [False] * (len(outputs) - 1) + [True]
    done = lines[-1]
    assert done["type"] == "done"
    assert (done["num_tokens"], done["finish_reason"]) == (5, "length")
    assert done["token_ids"] == [t for r in outputs for t in r["token_ids"]]


def test_submit_text_mode_and_prefix_cache(daemon: DaemonProcess) -> None:
    tokens = ",".join(str(t) for t in fresh_prompt(blocks=3, extra=1))
    args = ("submit", "--tokens", tokens, "--max-tokens", "2", "--dp-rank", "1")
    first = invoke(*args, "--control-endpoint", daemon.control)
    assert first.exit_code == 0, first.output
    assert "finished" in first.stdout and "length, 2 tokens" in first.stdout
    # The same prompt again on the same rank: its three full blocks are cached now.
    second = invoke(*args, "--json", "--control-endpoint", daemon.control)
    assert records(second.stdout)[-1]["cached_tokens"] == 3 * BLOCK_SIZE


def test_submit_positional_tokens_and_environment(daemon: DaemonProcess) -> None:
    result = invoke(
        "submit",
        "1",
        "2",
        "3",
        "--max-tokens",
        "1",
        "--json",
        env={f"{ENV_PREFIX}CONTROL_ENDPOINT": daemon.control},
    )
    assert result.exit_code == 0, result.output
    assert records(result.stdout)[-1]["prompt_tokens"] == 3


def test_submit_error_reply_exits_1_with_the_message(daemon: DaemonProcess) -> None:
    result = invoke(
        "submit", "1", "2", "--dp-rank", "7", "--json", "--control-endpoint", daemon.control
    )
    assert result.exit_code == 1
    (error,) = records(result.stdout)
    assert error["error"]["code"] == "invalid_request"
    assert "dp_rank" in error["error"]["message"]
    assert "error: invalid_request:" in result.stderr


@pytest.mark.parametrize(
    ("args", "option"),
    [
        ((), "--tokens"),
        (("1", "--random-prompt", "4"), "--random-prompt"),
        (("--tokens", "1,x"), "--tokens"),
        (("1", "--max-tokens", "-1"), "--max-tokens"),
        (("1", "--control-endpoint", "localhost:5555"), "--control-endpoint"),
        (("1", "--control-endpoint", "tcp://127.0.0.1"), "--control-endpoint"),
        (("1", "--timeout", "0"), "--timeout"),
    ],
)
def test_submit_bad_input(args: tuple[str, ...], option: str) -> None:
    result = invoke("submit", *args)
    assert result.exit_code == 2, result.output
    assert f"'{option}'" in plain(result.output)


def test_submit_without_a_daemon_exits_1(tmp_path: Path) -> None:
    result = invoke(
        "submit", "1", "--control-endpoint", f"ipc://{tmp_path}/none", "--timeout", "0.3"
    )
    assert result.exit_code == 1
    assert "no answer from the daemon" in result.stderr


# --- events ---------------------------------------------------------------------------------


def replayed_messages(daemon: DaemonProcess, rank: int = 0) -> list[dict[str, Any]]:
    result = invoke(
        "events",
        "--replay-from",
        "0",
        "--no-follow",
        "--rank",
        str(rank),
        "--json",
        "--control-endpoint",
        daemon.control,
    )
    assert result.exit_code == 0, result.output
    return records(result.stdout)


def check_stored(event: dict[str, Any]) -> None:
    assert event["num_tokens"] == event["num_blocks"] * BLOCK_SIZE
    assert event["block_size"] == BLOCK_SIZE
    assert event["medium"] == "GPU"
    assert all(isinstance(h, int) and h >= 2**32 for h in event["block_hashes"])


def test_events_replay_from_0_shows_what_was_published_before(daemon: DaemonProcess) -> None:
    prompt = fresh_prompt(blocks=5, extra=3)
    asyncio.run(generate(daemon.control, prompt, 1, dp_rank=1))
    events = replayed_messages(daemon, rank=1)
    assert events and all(e["replayed"] for e in events)
    seqs = sorted({e["seq"] for e in events})
    assert seqs == list(range(len(seqs)))
    stored = [e for e in events if e["type"] == "BlockStored"]
    for event in stored:
        check_stored(event)
        assert event["dp_rank"] == 1
    # The prompt's five full blocks were stored in the newest batches, chained by parents.
    assert sum(e["num_blocks"] for e in stored if e["seq"] == seqs[-1]) >= 1
    assert sum(e["num_blocks"] for e in stored) >= 5


def test_events_follow_live(daemon: DaemonProcess) -> None:
    code, out, err = run_while_loading(
        daemon, "events", "--count", "3", "--json", "--control-endpoint", daemon.control
    )
    assert code == 0, err
    lines = records(out)
    assert not [r for r in lines if "gap" in r or "recovered" in r]
    seqs = sorted({r["seq"] for r in lines})
    assert seqs == list(range(seqs[0], seqs[0] + 3))
    assert not any(r["replayed"] for r in lines)
    for event in lines:
        if event["type"] == "BlockStored":
            check_stored(event)


def test_events_replay_then_follow_is_contiguous(daemon: DaemonProcess) -> None:
    asyncio.run(generate(daemon.control, fresh_prompt(), 1))
    buffered = len({e["seq"] for e in replayed_messages(daemon)})
    wanted = buffered + 3
    code, out, err = run_while_loading(
        daemon,
        "events",
        "--replay-from",
        "0",
        "--count",
        str(wanted),
        "--json",
        "--control-endpoint",
        daemon.control,
    )
    assert code == 0, err
    lines = records(out)
    # A gap while joining is allowed (the SUB may connect after a publish), but it must be
    # recovered in full, and no batch may be shown twice.
    assert all(r["recovered"]["missing"] == 0 for r in lines if "recovered" in r)
    events = [r for r in lines if "seq" in r]
    order = [r["seq"] for r in events]
    assert order == sorted(order)
    assert sorted(set(order)) == list(range(wanted))
    assert all(r["replayed"] for r in events if r["seq"] < buffered)


def test_events_reports_a_gap_it_cannot_recover(daemon: DaemonProcess) -> None:
    """Start at seq 0 on the PUB alone (no replay socket): seq 0 is long gone."""
    asyncio.run(generate(daemon.control, fresh_prompt(), 1))
    args = ("events", "--kv-events-endpoint", daemon.kv_endpoint(0), "--replay-from", "0")
    code, out, err = run_while_loading(daemon, *args, "--count", "1", "--json")
    assert code == 0, err
    lines = records(out)
    gap = lines[0]["gap"]
    assert (gap["expected"], gap["source"]) == (0, "live")
    assert gap["got"] > 0
    assert {r["seq"] for r in lines[1:]} == {gap["got"]}
    code, out, err = run_while_loading(daemon, *args, "--count", "1")
    assert code == 0, err
    assert out.startswith("warning: gap in the live stream: expected seq 0, got ")


def test_events_recovers_a_live_gap_from_replay(tmp_path: Path) -> None:
    """A scripted publisher skips seqs 6 and 7; the command fills them from its replay socket.

    The daemon never skips a seq, so the publisher here is a test double speaking the same
    frames (vLLM 0.23 array payloads, which the command must decode too). An XPUB socket
    tells the test when the command has subscribed, so nothing is published too early.
    """
    encoder = KvEventEncoder("vllm-array")

    def payload(seq: int) -> bytes:
        event = core.BlockStored(seq, 0, None, [2**40 + seq], [seq], [seq] * 4, 4)
        return encoder.encode_batch(1757500000.0 + seq, [event], 0)

    async def scenario() -> tuple[int, str, str]:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        replay = ctx.socket(zmq.ROUTER)
        try:
            pub.bind(f"ipc://{tmp_path}/pub")
            replay.bind(f"ipc://{tmp_path}/replay")
            proc = await asyncio.create_subprocess_exec(
                *ENGINED,
                "events",
                "--kv-events-endpoint",
                f"ipc://{tmp_path}/pub",
                "--kv-replay-endpoint",
                f"ipc://{tmp_path}/replay",
                "--count",
                "4",
                "--json",
                "--timeout",
                "20",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            async with asyncio.timeout(RUN_TIMEOUT_S):
                assert await pub.recv() == b"\x01"  # the command subscribed to everything
                for seq in (5, 8):
                    await pub.send_multipart([b"", seq_bytes(seq), payload(seq)])
                identity, empty, start = await replay.recv_multipart()
                assert (empty, read_seq(start)) == (b"", 6)
                for seq in (6, 7, 8):
                    await replay.send_multipart([identity, b"", b"", seq_bytes(seq), payload(seq)])
                await replay.send_multipart([identity, b"", *REPLAY_END_FRAMES])
                out, err = await proc.communicate()
            assert proc.returncode is not None
            return proc.returncode, out.decode(), err.decode()
        finally:
            pub.close(linger=0)
            replay.close(linger=0)
            ctx.term()

    code, out, err = asyncio.run(scenario())
    assert code == 0, err
    lines = records(out)
    assert lines[1] == {"gap": {"expected": 6, "got": 8, "source": "live"}}
    assert [(r["seq"], r["replayed"]) for r in lines if "seq" in r] == [
        (5, False),
        (6, True),
        (7, True),
        (8, False),
    ]
    recovered = next(r["recovered"] for r in lines if "recovered" in r)
    assert recovered == {"expected": 6, "got": 8, "batches": 2, "missing": 0, "error": None}
    assert lines[0]["block_hashes"] == [2**40 + 5] and lines[0]["num_tokens"] == 4


def test_events_hex_hashes(daemon: DaemonProcess) -> None:
    asyncio.run(generate(daemon.control, fresh_prompt(), 1))
    result = invoke(
        "events",
        "--replay-from",
        "0",
        "--no-follow",
        "--count",
        "1",
        "--hash-format",
        "hex",
        "--json",
        "--control-endpoint",
        daemon.control,
    )
    assert result.exit_code == 0, result.output
    event = records(result.stdout)[0]
    assert event["seq"] == 0
    assert all(re.fullmatch(r"0x[0-9a-f]{16}", h) for h in event["block_hashes"])


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--replay-from", "-1"), "--replay-from"),
        (("--kv-events-endpoint", "tcp://127.0.0.1:http"), "--kv-events-endpoint"),
        (("--count", "0"), "--count"),
        (("--duration", "-2"), "--duration"),
        (("--hash-format", "oct"), "--hash-format"),
    ],
)
def test_events_bad_input(args: tuple[str, ...], option: str) -> None:
    result = invoke("events", *args)
    assert result.exit_code == 2, result.output
    assert f"'{option}'" in plain(result.output)


def test_events_judges_rank_and_follow_against_the_daemon(daemon: DaemonProcess) -> None:
    result = invoke("events", "--rank", "5", "--control-endpoint", daemon.control)
    assert result.exit_code == 2
    assert "'--rank'" in plain(result.output) and f"has {DP_SIZE} rank(s)" in result.output
    assert "'--dp-rank' / '--rank'" in plain(result.output)  # named as typer names it
    result = invoke("events", "--no-follow", "--control-endpoint", daemon.control)
    assert result.exit_code == 2
    assert "'--no-follow'" in plain(result.output)


# --- fpm ------------------------------------------------------------------------------------


def test_fpm_snapshots_count_up(daemon: DaemonProcess) -> None:
    code, out, err = run_while_loading(
        daemon, "fpm", "--count", "5", "--json", "--control-endpoint", daemon.control
    )
    assert code == 0, err
    lines = records(out)
    assert len(lines) == 5
    counters = [r["counter_id"] for r in lines]
    assert counters == sorted(set(counters))
    assert {r["dp_rank"] for r in lines} == {0}
    assert {r["version"] for r in lines} == {1}
    assert set(lines[0]["scheduled_requests"]) >= {
        "num_prefill_requests",
        "sum_prefill_tokens",
        "num_decode_requests",
        "sum_decode_kv_tokens",
    }
    assert set(lines[0]["queued_requests"]) >= {"num_prefill_requests", "num_decode_requests"}
    assert any(
        r["scheduled_requests"]["num_prefill_requests"]
        + r["scheduled_requests"]["num_decode_requests"]
        for r in lines
    )


def test_fpm_all_ranks_text(daemon: DaemonProcess) -> None:
    code, out, err = run_while_loading(
        daemon,
        "fpm",
        "--all-ranks",
        "--count",
        "30",
        "--control-endpoint",
        daemon.control,
        ranks=(0, 1),
    )
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 30
    assert {line.split()[1] for line in lines} == {"0", "1"}
    assert all(re.match(r"rank [01] #\d+ wall [\d.]+ ms", line) for line in lines)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--fpm-endpoint", "udp://127.0.0.1:1"), "--fpm-endpoint"),
        (("--count", "-3"), "--count"),
        (("--rank", "-1"), "--rank"),
    ],
)
def test_fpm_bad_input(args: tuple[str, ...], option: str) -> None:
    result = invoke("fpm", *args)
    assert result.exit_code == 2, result.output
    assert f"'{option}'" in plain(result.output)


# --- stats ----------------------------------------------------------------------------------


def test_stats_one_row_per_rank(daemon: DaemonProcess) -> None:
    result = invoke("stats", "--json", "--control-endpoint", daemon.control)
    assert result.exit_code == 0, result.output
    rows = records(result.stdout)
    assert [r["dp_rank"] for r in rows] == list(range(DP_SIZE))
    for row in rows:
        assert row["total_blocks"] == 4096
        assert {"active_blocks", "inactive_blocks", "kv_cache_usage", "running", "waiting"} <= set(
            row
        )
        assert {"preemptions_total", "passes_total", "lateness_p99_ms"} <= set(row)
    text = invoke("stats", "--control-endpoint", daemon.control)
    assert text.exit_code == 0, text.output
    header, *lines = text.stdout.splitlines()
    assert header.split()[:4] == ["rank", "active", "inactive", "total"]
    assert [line.split()[0] for line in lines] == ["0", "1"]


def test_stats_bad_input(tmp_path: Path) -> None:
    result = invoke("stats", "--control-endpoint", "ipc://")
    assert result.exit_code == 2
    assert "'--control-endpoint'" in plain(result.output)
    result = invoke(
        "stats", "--json", "--control-endpoint", f"ipc://{tmp_path}/x", "--timeout", "0.2"
    )
    assert result.exit_code == 1
    assert records(result.stdout)[0]["error"]["message"].startswith("no answer from the daemon")


# --- bench ----------------------------------------------------------------------------------

REPORT_KEYS = {
    "mode",
    "concurrency",
    "rate",
    "requests",
    "failed",
    "errors",
    "duration_s",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "requests_per_s",
    "output_tokens_per_s",
    "prefix_hit_rate",
    "preemptions",
    "speedup_ratio",
    "ttft_ms",
    "itl_ms",
    "e2e_ms",
}


def test_bench_closed_loop_report(daemon: DaemonProcess) -> None:
    result = invoke(
        "bench",
        "--requests",
        "12",
        "--concurrency",
        "4",
        "--prompt-len",
        "fixed:64",
        "--output-len",
        "fixed:8",
        "--shared-prefix-ratio",
        "0.5",
        "--prefix-groups",
        "2",
        "--seed",
        "3",
        "--speedup-ratio",
        "2",
        "--json",
        "--control-endpoint",
        daemon.control,
    )
    assert result.exit_code == 0, result.output
    (report,) = records(result.stdout)
    assert set(report) >= REPORT_KEYS
    assert (report["mode"], report["concurrency"], report["rate"]) == ("closed", 4, None)
    assert report["speedup_ratio"] == 2.0  # as given
    assert (report["requests"], report["failed"], report["errors"]) == (12, 0, {})
    assert report["output_tokens"] == 12 * 8
    assert report["prompt_tokens"] == 12 * 64
    # Half of each prompt (two full blocks) comes from one of two prefixes: later requests hit.
    assert 0 < report["prefix_hit_rate"] <= 0.5
    assert report["cached_tokens"] % BLOCK_SIZE == 0
    assert report["preemptions"] == 0
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        stats = report[key]
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert report["ttft_ms"]["max"] <= report["e2e_ms"]["max"]
    assert report["output_tokens_per_s"] > 0 and report["requests_per_s"] > 0


def test_bench_open_loop_and_text_report(daemon: DaemonProcess) -> None:
    result = invoke(
        "bench",
        "--rate",
        "400",
        "--requests",
        "10",
        "--prompt-len",
        "uniform:16:48",
        "--output-len",
        "uniform:2:6",
        "--json",
        "--control-endpoint",
        daemon.control,
    )
    assert result.exit_code == 0, result.output
    (report,) = records(result.stdout)
    assert (report["mode"], report["rate"], report["requests"]) == ("open", 400.0, 10)
    assert report["speedup_ratio"] == 1.0  # the daemon runs at speedup 0: wall time
    assert 10 * 2 <= report["output_tokens"] <= 10 * 6
    assert 10 * 16 <= report["prompt_tokens"] <= 10 * 48
    text = invoke(
        "bench",
        "--duration",
        "0.2",
        "--concurrency",
        "2",
        "--prompt-len",
        "normal:40:8",
        "--output-len",
        "4",
        "--control-endpoint",
        daemon.control,
    )
    assert text.exit_code == 0, text.output
    assert re.search(r"^requests\s+[1-9]\d* completed, 0 failed", text.stdout, re.M)
    assert re.search(r"^TTFT\s+[\d.]+", text.stdout, re.M)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--prompt-len", "lognormal:3:1"), "--prompt-len"),
        (("--output-len", "uniform:9:2"), "--output-len"),
        (("--prompt-len", "fixed:0"), "--prompt-len"),
        (("--shared-prefix-ratio", "1.5"), "--shared-prefix-ratio"),
        (("--concurrency", "2", "--rate", "3"), "--rate"),
        (("--rate", "0"), "--rate"),
        (("--speedup-ratio", "0"), "--speedup-ratio"),
        (("--control-endpoint", "tcp://:5555"), "--control-endpoint"),
    ],
)
def test_bench_bad_input(args: tuple[str, ...], option: str) -> None:
    result = invoke("bench", *args)
    assert result.exit_code == 2, result.output
    assert f"'{option}'" in plain(result.output)


# --- pieces ---------------------------------------------------------------------------------


def test_distribution_syntax() -> None:
    assert parse_distribution("512") == Distribution("fixed", 512)
    assert parse_distribution("uniform:1:3") == Distribution("uniform", 1, 3)
    normal = parse_distribution("normal:10:0")
    rng = random.Random(0)
    assert {normal.sample(rng) for _ in range(5)} == {10}
    uniform = parse_distribution("uniform:1:3")
    assert {uniform.sample(rng) for _ in range(200)} == {1, 2, 3}
    for bad in ("", "fixed", "fixed:1:2", "uniform:3", "normal:0:1", "normal:5:-1", "x:1"):
        with pytest.raises(ValueError, match="expected fixed:N"):
            parse_distribution(bad)


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([5.0], 99) == 5.0


def test_workload_is_seeded_and_shares_prefixes() -> None:
    def make() -> Workload:
        return Workload(Distribution("fixed", 100), Distribution("fixed", 4), 0.5, 1, seed=9)

    first, second = make(), make()
    a, b = first.next(), first.next()
    assert (a, b) == (second.next(), second.next())
    assert a[0][:50] == b[0][:50]
    assert a[0][50:] != b[0][50:]
    assert a[1] == 4


def test_stats_tier_rows_appear_only_with_tiers() -> None:
    """1. Stats of two ranks without tiers: no tier rows.
    2. The same with a G2 tier on rank 1: one row per rank with held/cached/total blocks.
    """
    from engined.tools.stats import tier_rows
    from engined.wire.control import RankStats

    def rank(n: int, **tiers: int) -> RankStats:
        stats = RankStats(
            dp_rank=n,
            active_blocks=0,
            inactive_blocks=0,
            total_blocks=8,
            kv_cache_usage=0.0,
            running=0,
            waiting=0,
            preemptions_total=0,
            passes_total=0,
        )
        return msgspec.structs.replace(stats, **tiers)

    assert tier_rows([rank(0), rank(1)]) == []
    rows = tier_rows(
        [rank(0), rank(1, g2_active_blocks=2, g2_inactive_blocks=5, g2_total_blocks=64)]
    )
    assert rows == [["0", "0", "0", "0", "0", "0", "0"], ["1", "2", "5", "64", "0", "0", "0"]]


def test_bench_takes_the_speedup_the_daemon_announces(tmp_path: Path) -> None:
    """A daemon at speedup 10: latencies are wall x 10 without --speedup-ratio (issue 26)."""
    with start_daemon(tmp_path, "--speedup-ratio", "10", "--block-size", "16") as paced:
        result = invoke(
            "bench",
            "--requests",
            "2",
            "--output-len",
            "fixed:2",
            "--json",
            "--control-endpoint",
            paced.control,
        )
    assert result.exit_code == 0, result.output
    (report,) = records(result.stdout)
    assert (report["speedup_ratio"], report["requests"]) == (10.0, 2)
