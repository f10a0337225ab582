"""A simulated Dynamo cluster on one host: N engined workers against `dynamo.mocker
--num-workers N`, behind the same NVIDIA Dynamo 1.6.1 frontend, at speedup 1.

  engined  one `engined serve --data-parallel-size N --speedup-ratio 1` (this venv's engined)
           and one `python -m engined.dynamo --worker-per-rank` (peers venv): N workers;
  mocker   one `python -m dynamo.mocker --num-workers N --speedup-ratio 1`.

Both with the same block size, pool, max_num_seqs and max_num_batched_tokens, behind a fresh
`--router-mode kv` frontend each, serving the tiny model of tests/interop/tiny_model.py. Once
the frontend routes to all N workers and `--settle` s have passed, printed per backend:

- resident memory (VmRSS) of the backend's processes (the daemon's rank worker processes
  included) and of the frontend, in MB, and per simulated worker;
- idle CPU: CPU seconds the backend's processes used over `--idle` s, as a % of one core;
- under load (dynamo_e2e.py's load generator: `--requests` streaming completions,
  `--concurrency` in flight, ISL/OSL tokens, token ids from `nvext`): TTFT and ITL p50/p99
  against the modelled ones: the polynomial perf model (engined/core/perf_model.py, the
  mocker's default fit) for one request alone on a rank: TTFT = the prefill pass of ISL
  tokens plus its decode step, ITL = one decode step at that KV occupancy. Each request has a
  rank of its own when concurrency <= N (the KV router spreads load), so "keeps real time"
  means measured ITL p50 close to the modelled one.

    .venv/bin/python benchmarks/dynamo_cluster.py [--backend engined|mocker|both] [--workers 64]
        [--requests 256] [--concurrency 32] [--isl 512] [--osl 64] [--rank-processes 0]

Prints the machine's load average before each phase: the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.dynamo_e2e import (  # noqa: E402
    MODEL,
    add_peers_arguments,
    engine_flags,
    loadgen_result,
    peers_and_model,
    run_loadgen,
)
from engined.core.perf_model import PolynomialPerfModel  # noqa: E402

POLL_S = 0.2
REGISTER_TIMEOUT_S = 300.0


def tree_pids(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return found


def rss_mb(pids: list[int]) -> float:
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


def cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


def modelled_ms(args: argparse.Namespace) -> tuple[float, float]:
    """(TTFT, ITL) of one request alone on a rank under the polynomial model."""
    model = PolynomialPerfModel()
    total = args.num_gpu_blocks * args.block_size
    mid = args.isl + args.osl // 2
    itl = model.decode_ms(1, mid, mid, total)
    ttft = model.prefill_ms(1, args.isl, 0) + model.decode_ms(1, args.isl, args.isl, total)
    return ttft, itl


def wait_all_routable(frontend: Any, workers: int) -> list[int]:
    """Until the frontend lists `workers` generate instances and routes to each."""
    from tests.interop.dynamo_worker_support import poll_until, wait_routable

    def listed() -> list[int] | None:
        frontend.check_alive()
        ids = [int(i["instance_id"]) for i in frontend.instances() if i["endpoint"] == "generate"]
        return ids if len(ids) >= workers else None

    ids: list[int] = poll_until(
        f"{workers} instances", listed, REGISTER_TIMEOUT_S, frontend.describe
    )
    wait_routable(frontend, ids, timeout=REGISTER_TIMEOUT_S)
    return ids


def run_backend(
    backend: str, args: argparse.Namespace, python: Path, model: Path, workdir: Path
) -> dict[str, Any]:
    from tests.interop.dynamo_cluster import DynamoCluster

    engine = engine_flags(args)
    tag = f"[{backend}]"
    result: dict[str, Any] = {}
    with DynamoCluster(python, workdir / backend, model_path=model, model_name=MODEL) as cluster:
        started = time.perf_counter()
        frontend = cluster.frontend(router_mode="kv")
        if backend == "engined":
            daemon = cluster.engined_daemon(
                "--speedup-ratio",
                "1",
                "--model-name",
                MODEL,
                "--port",
                "",
                "--data-parallel-size",
                str(args.workers),
                "--rank-processes",
                str(args.rank_processes),
                *engine,
            )
            worker = cluster.engined_worker(daemon, extra_args=["--worker-per-rank"])
            backend_pids = [daemon.pid, worker.pid]
        else:
            mocker = cluster.mocker(
                block_size=args.block_size,
                num_gpu_blocks=args.num_gpu_blocks,
                speedup_ratio=1.0,
                extra_args=[*engine[4:], "--num-workers", str(args.workers)],
            )
            backend_pids = [mocker.pid]
        wait_all_routable(frontend, args.workers)
        print(f"{tag} {args.workers} workers routable in {time.perf_counter() - started:.1f} s")
        time.sleep(args.settle)  # a benchmark's pause: start-up work dies down
        pids = [p for pid in backend_pids if pid is not None for p in tree_pids(pid)]
        assert frontend.pid is not None
        result["rss_mb"] = rss_mb(pids)
        result["rss_by_process"] = {
            pid: rss_mb(tree_pids(pid)) for pid in backend_pids if pid is not None
        }
        result["frontend_rss_mb"] = rss_mb([frontend.pid])
        result["processes"] = len(pids)
        print(f"{tag} idle phase, {load_average()}")
        before, frontend_before = cpu_s(pids), cpu_s([frontend.pid])
        time.sleep(args.idle)  # the measured idle interval
        result["idle_cpu_pct"] = 100 * (cpu_s(pids) - before) / args.idle
        frontend_used = cpu_s([frontend.pid]) - frontend_before
        result["frontend_idle_cpu_pct"] = 100 * frontend_used / args.idle
        print(f"{tag} load phase, {load_average()}")
        run = run_loadgen(python, frontend.url, args)
        if run.returncode != 0:
            raise SystemExit(f"{tag} load generator failed:\n{run.stderr[-3000:]}")
        result.update(loadgen_result(run))
        result["loaded_rss_mb"] = rss_mb(pids)
        routed = {r.worker_id for r in frontend.route_lines() if r.outcome == "success"}
        result["workers_used"] = len(routed)
    result["exit_codes"] = cluster.exit_codes
    return result


def report(backend: str, args: argparse.Namespace, r: dict[str, Any]) -> None:
    tag = f"[{backend}]"
    ttft, itl = modelled_ms(args)
    n = args.workers
    print(f"{tag} {n} workers, {r['processes']} backend process(es)")
    print(
        f"{tag}   RSS MB idle       {r['rss_mb']:>9.1f}  ({r['rss_mb'] / n:.2f} per worker); "
        f"after load {r['loaded_rss_mb']:.1f}; frontend {r['frontend_rss_mb']:.1f}"
    )
    split = ", ".join(f"{mb:.1f}" for mb in r["rss_by_process"].values())
    print(f"{tag}   RSS MB idle by backend process tree: {split}")
    print(
        f"{tag}   idle CPU          {r['idle_cpu_pct']:>9.2f} % of a core over {args.idle:g} s "
        f"(frontend {r['frontend_idle_cpu_pct']:.2f} %)"
    )
    print(
        f"{tag}   load: {args.requests} streams, concurrency {args.concurrency}, ISL {args.isl}, "
        f"OSL {args.osl}: completed {r['completed']}, failed {r['failed']} {r['errors'] or ''}; "
        f"{r['workers_used']} workers used; wall {r['wall_s']:.1f} s"
    )
    print(
        f"{tag}   TTFT ms           p50 {r['ttft_p50_ms']:>8.1f}  p99 {r['ttft_p99_ms']:>8.1f}"
        f"   modelled {ttft:.1f}"
    )
    print(
        f"{tag}   ITL ms            p50 {r['itl_p50_ms']:>8.2f}  p99 {r['itl_p99_ms']:>8.2f}"
        f"   modelled {itl:.2f}; short streams {r['short_streams']}"
    )
    print(f"{tag}   exit codes {r['exit_codes']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["engined", "mocker", "both"], default="both")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8, help="untimed requests first")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--rank-processes", type=int, default=0, help="the daemon's (0: its own process)"
    )
    parser.add_argument("--settle", type=float, default=5.0, help="s before measuring")
    parser.add_argument("--idle", type=float, default=10.0, help="s of idle CPU measured")
    add_peers_arguments(parser)
    args = parser.parse_args()
    from engined.core import running as running_core

    python, workdir, model = peers_and_model(args, "dynamo-cluster-")
    print(f"engined core: {running_core()}; logs: {workdir}")
    backends = ["engined", "mocker"] if args.backend == "both" else [args.backend]
    for backend in backends:
        report(backend, args, run_backend(backend, args, python, model, workdir))


if __name__ == "__main__":
    main()
