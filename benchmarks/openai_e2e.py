"""engined's own OpenAI API server against Dynamo 1.6.1's frontend: one workload, one run.

Issue 22's benchmark. Each backend serves the tiny model of `tests/interop/tiny_model.py`
from a fresh daemon with the same engine flags (`--speedup-ratio 0`, block size, pool,
max_num_seqs, max_num_batched_tokens, the model directory as MODEL):

  dynamo        `engined serve --port ""` + `python -m engined.dynamo` + Dynamo's frontend
                (`--router-mode`, default kv), all from the peers venv but the daemon;
  engined-api   `engined serve --port P` (one API server process);
  engined-api2  the same with `--api-server-count 2`.

The load generator is `benchmarks/dynamo_e2e.py loadgen` (peers venv: asyncio + aiohttp),
the same for every backend: `--requests` streaming `/v1/completions` at `--concurrency`,
`--isl` one-token words, exactly `--osl` tokens (`min_tokens`, `ignore_eos`). Tokens are
counted the same way for both, from each chunk's list of token ids: Dynamo's
`nvext.completion_token_ids`, engined's `choices[].token_ids` (`return_token_ids: true`, as
vLLM 0.33 returns them); a request counts only with `[DONE]`, the usage chunk and exactly
ISL/OSL tokens. The CPU seconds are each process's user + system time over the load
generator's run (warm-up included), read from /proc; engined's API server processes are the
daemon's children.

    .venv/bin/python benchmarks/openai_e2e.py [--backends dynamo engined-api engined-api2]
        [--rounds 1] [--requests 1024] [--concurrency 256] [--isl 512] [--osl 256]
        [--profile DIR]

`--rounds N` runs the backends in turn N times (ABC ABC ...) and reports each round and the
medians. `--profile DIR` runs every engined API server process under cProfile (a
sitecustomize put on its PYTHONPATH by this script only) and writes `DIR/api-<pid>.prof`
when it exits; the figures of a profiled run are not the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dynamo_e2e import LOADGEN_TIMEOUT_S, MODEL, VOCAB_WORDS, cpu_seconds  # noqa: E402

BACKENDS = ("dynamo", "engined-api", "engined-api2")
HEALTH_TIMEOUT_S = 60.0

# Started by Python in every process of the API server's environment; profiles only the API
# server (`python -m engined.openai`) and dumps on a normal exit (SIGTERM drains, then exits).
_SITECUSTOMIZE = """\
import atexit, cProfile, os
_out = os.environ.get("OPENAI_E2E_PROFILE_DIR")
try:
    _cmd = open("/proc/self/cmdline", "rb").read()
except OSError:
    _cmd = b""
if _out and b"engined.openai" in _cmd:
    _profile = cProfile.Profile()
    _profile.enable()
    atexit.register(
        lambda: _profile.dump_stats(os.path.join(_out, "api-%d.prof" % os.getpid()))
    )
"""


def children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc), in start order."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(found)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def process_table(cluster: Any) -> dict[str, int]:
    """Every process of the backend by name: the cluster's, and the daemons' children."""
    table: dict[str, int] = {}
    for process in cluster.processes:
        if process.pid is None:
            continue
        table[process.name] = process.pid
        api = rank = 0
        for child in children(process.pid):
            if "engined.openai" in _cmdline(child):
                table[f"api-server-{api}"] = child
                api += 1
            else:
                table[f"{process.name}-child-{rank}"] = child
                rank += 1
    return table


def wait_health(url: str, daemon: Any) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        daemon.check_alive()
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2.0) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"no /health within {HEALTH_TIMEOUT_S:.0f} s\n{daemon.describe()}")


def engined_version() -> str:
    """`engined --version`, one line: the release and whether the core is compiled or pure."""
    # NOTE: the core's build ("core: compiled (mypyc)" or pure) goes to stderr.
    text = subprocess.run(
        [sys.executable, "-m", "engined.cli", "--version"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ).stdout
    return ", ".join(line for line in text.splitlines() if line)


def run_backend(
    backend: str, args: argparse.Namespace, python: Path, model: Path, workdir: Path
) -> dict[str, Any] | None:
    from tests.interop.dynamo_cluster import DynamoCluster
    from tests.support import free_tcp_port

    engine = [
        str(model),
        "--served-model-name",
        MODEL,
        "--speedup-ratio",
        "0",
        "--block-size",
        str(args.block_size),
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    tag = f"[{backend}]"
    env: dict[str, str] = {}
    if args.profile is not None and backend != "dynamo":
        site = workdir / "profile-site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        args.profile.mkdir(parents=True, exist_ok=True)
        env = {
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "OPENAI_E2E_PROFILE_DIR": str(args.profile.absolute()),
        }
    with DynamoCluster(python, workdir / backend, model_path=model, model_name=MODEL) as cluster:
        try:
            started = time.perf_counter()
            if backend == "dynamo":
                url = cluster.frontend(router_mode=args.router_mode).url
                daemon = cluster.engined_daemon(*engine, "--port", "")
                cluster.engined_worker(daemon)
                ids = "nvext"
            else:
                count = "2" if backend == "engined-api2" else "1"
                port = free_tcp_port()
                api = ["--host", "127.0.0.1", "--port", str(port), "--api-server-count", count]
                daemon = cluster.engined_daemon(*engine, *api, env=env)
                url = f"http://127.0.0.1:{port}"
                wait_health(url, daemon)
                ids = "token_ids"
            print(f"{tag} up in {time.perf_counter() - started:.1f} s (logs: {workdir / backend})")
        except AssertionError as exc:
            first = str(exc).splitlines()[0]
            print(f"{tag} could not start: {first} (logs: {workdir / backend})", file=sys.stderr)
            return None
        command = [
            str(python),
            str(REPO_ROOT / "benchmarks" / "dynamo_e2e.py"),
            "loadgen",
            "--url",
            url,
            "--ids",
            ids,
            "--requests",
            str(args.requests),
            "--concurrency",
            str(args.concurrency),
            "--isl",
            str(args.isl),
            "--osl",
            str(args.osl),
            "--warmup",
            str(args.warmup),
        ]
        pids = process_table(cluster)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        loadgen_env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        run = subprocess.run(
            command, capture_output=True, text=True, timeout=LOADGEN_TIMEOUT_S, env=loadgen_env
        )
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        if run.returncode != 0:
            print(f"{tag} load generator failed:\n{run.stderr[-3000:]}", file=sys.stderr)
            return None
        result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
        result["process_cpu_s"] = {
            name: after[name] - b  # type: ignore[operator]
            for name, b in before.items()
            if b is not None and after.get(name) is not None
        }
    result["exit_codes"] = cluster.exit_codes
    return result


def rates(r: dict[str, Any]) -> tuple[float, float]:
    return r["output_tokens"] / r["wall_s"], r["completed"] / r["wall_s"]


def report(backend: str, r: dict[str, Any]) -> None:
    tag = f"[{backend}]"
    tokens_s, requests_s = rates(r)
    print(
        f"{tag} completed {r['completed']:,}, failed {r['failed']:,}, wall {r['wall_s']:.2f} s, "
        f"{tokens_s:,.0f} output tokens/s, {requests_s:,.2f} requests/s"
    )
    for error, count in r["errors"].items():
        print(f"{tag}   {count} x {error}")
    if r["warmup_failed"]:
        print(f"{tag}   warm-up failures: {r['warmup_failed']}")
    print(
        f"{tag}   TTFT ms p50 {r['ttft_p50_ms']:.1f} p99 {r['ttft_p99_ms']:.1f}; "
        f"ITL ms p50 {r['itl_p50_ms']:.2f} p99 {r['itl_p99_ms']:.2f}; "
        f"streams with fewer chunks than half their tokens: {r['short_streams']}"
    )
    cpu = ", ".join(f"{name} {s:.1f}" for name, s in r["process_cpu_s"].items())
    print(f"{tag}   CPU s over the run: {cpu}, loadgen {r['cpu_s']:.1f}")
    print(f"{tag}   exit codes {r['exit_codes']}")


def summary(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    """The medians over rounds as a Markdown table, and each engined backend's ratio."""
    print(
        f"\n{args.requests} streaming completions per round, concurrency {args.concurrency}, "
        f"ISL {args.isl}, OSL {args.osl}, speedup 0, rounds {args.rounds} (medians)\n"
    )
    print(
        "| backend | output tokens/s | requests/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| CPU s per process | ratio to dynamo |"
    )
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(rates(r)[0] for r in runs["dynamo"]) if runs.get("dynamo") else None
    for backend, results in runs.items():
        if not results:
            continue
        tokens_s = statistics.median(rates(r)[0] for r in results)
        requests_s = statistics.median(rates(r)[1] for r in results)

        def med(key: str, results: list[dict[str, Any]] = results) -> float:
            return float(statistics.median(r[key] for r in results))

        names = results[0]["process_cpu_s"].keys()
        cpu = ", ".join(
            f"{n} {statistics.median(r['process_cpu_s'].get(n, 0.0) for r in results):.1f}"
            for n in names
        )
        ratio = f"{tokens_s / base:.2f}" if base else "-"
        print(
            f"| {backend} | {tokens_s:,.0f} | {requests_s:,.2f} "
            f"| {med('ttft_p50_ms'):.1f} / {med('ttft_p99_ms'):.1f} "
            f"| {med('itl_p50_ms'):.2f} / {med('itl_p99_ms'):.2f} | {cpu} | {ratio} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=8, help="untimed requests first")
    parser.add_argument("--router-mode", choices=["kv", "round-robin"], default="kv")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--profile", type=Path, default=None, help="cProfile the API servers")
    parser.add_argument(
        "--peers-python",
        type=Path,
        default=Path(os.environ.get("INTEROP_PEERS_PYTHON", REPO_ROOT / ".venv-peers/bin/python")),
        help="the Dynamo venv's python [env INTEROP_PEERS_PYTHON]",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="logs (default: a tmp dir)")
    args = parser.parse_args()
    if min(args.osl, args.isl, args.requests, args.concurrency, args.rounds) < 1:
        parser.error("--isl, --osl, --requests, --concurrency and --rounds must be >= 1")
    from tests.interop.tiny_model import build_tiny_model

    python = args.peers_python.absolute()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="openai-e2e-"))
    model = build_tiny_model(
        workdir / "tiny-model",
        vocab_words=VOCAB_WORDS,
        max_position_embeddings=max(4096, args.isl + args.osl),
        python=python,
    )
    print(f"{engined_version()}; load average {os.getloadavg()[0]:.2f} at start")
    runs: dict[str, list[dict[str, Any]]] = {backend: [] for backend in args.backends}
    for round_ in range(args.rounds):
        for backend in args.backends:
            result = run_backend(backend, args, python, model, workdir / f"round-{round_}")
            if result is not None:
                runs[backend].append(result)
                report(backend, result)
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    summary(args, runs)
    if any(len(results) < args.rounds for results in runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
