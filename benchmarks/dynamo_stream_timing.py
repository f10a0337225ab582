"""Streamed timing through a real Dynamo 1.6.1 frontend and `engined dynamo-worker` at speedup 1.

Issue 26 item 5: "Chunks leave the worker as the engine emits them ... aiperf (or your own
client) through the frontend at speedup 1, 64 concurrent streams, reports ITL p50 within 10%
of the daemon's modelled decode pass and no request with fewer chunks than half its tokens."

Per mode, one fresh cluster on the loopback (file discovery, tcp request plane, zmq events,
`--router-mode kv`), serving the tiny model of `tests/interop/tiny_model.py`:

  agg  one `engined serve` paced in real time (`--speedup-ratio 1`) with the fixed perf
       model (a pass that only decodes takes exactly `--decode-ms`), one aggregated worker;
  pd   a prefill daemon and a decode daemon, paced alike, each behind its worker
       (`--disaggregation-mode prefill|decode`); the frontend's PrefillRouter pairs them.

The load generator of `benchmarks/dynamo_e2e.py` (peers venv, aiohttp) keeps
`--concurrency` streams in flight (closed loop) and measures TTFT and the ITL between chunks
that carry tokens (`nvext.completion_token_ids`), as the client reads them.

Printed per mode: the client's ITL p50/p99 against the modelled decode pass (target: p50
within 10%), TTFT p50/p99, the fewest and the median token-carrying chunks per request
against its tokens (target: no request with fewer chunks than half its tokens), the CPU
seconds of every process, and the load average before and after (the machine is shared).

    .venv/bin/python benchmarks/dynamo_stream_timing.py [--mode agg|pd|both]
        [--concurrency 64] [--requests 256] [--isl 128] [--osl 64] [--decode-ms 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dynamo_e2e import (  # noqa: E402
    MODEL,
    add_peers_arguments,
    cpu_seconds,
    loadgen_result,
    peers_and_model,
    run_loadgen,
)
from openai_e2e import engined_version  # noqa: E402

TARGET = 0.10


def _paced(args: argparse.Namespace) -> list[str]:
    return [
        "--model-name",
        MODEL,
        "--port",
        "",
        "--block-size",
        "16",
        "--speedup-ratio",
        "1",
        "--perf-model",
        "fixed",
        "--fixed-decode-ms-per-pass",
        str(args.decode_ms),
        "--fixed-prefill-ms-per-token",
        str(args.prefill_ms_per_token),
        "--fixed-pass-overhead-ms",
        str(args.overhead_ms),
    ]


def run_mode(mode: str, args: argparse.Namespace, python: Path, model: Path, workdir: Path) -> bool:
    from tests.interop.dynamo_cluster import DynamoCluster

    tag = f"[{mode}]"
    load_before = os.getloadavg()[0]
    with DynamoCluster(python, workdir / mode, model_path=model, model_name=MODEL) as cluster:
        frontend = cluster.frontend(router_mode="kv")
        if mode == "agg":
            daemon = cluster.engined_daemon(*_paced(args))
            cluster.engined_worker(daemon)
        else:
            prefill = cluster.engined_daemon(
                *_paced(args), "--worker-type", "prefill", name="engined-prefill"
            )
            decode = cluster.engined_daemon(
                *_paced(args), "--worker-type", "decode", name="engined-decode"
            )
            cluster.engined_worker(prefill, name="worker-prefill", disaggregation_mode="prefill")
            cluster.engined_worker(decode, name="worker-decode", disaggregation_mode="decode")
            # The decode model is routable once the frontend activated its prefill router.
            deadline = time.monotonic() + 60.0
            while not any(
                r.get("message") == "Prefill router target activated"
                for r in frontend.log_records()
            ):
                frontend.check_alive()
                if time.monotonic() > deadline:
                    print(f"{tag} the prefill router never activated", file=sys.stderr)
                    return False
                time.sleep(0.1)
        run = run_loadgen(python, frontend.url, args)
        cpu = {p.name: cpu_seconds(p.pid) for p in cluster.processes}
    if run.returncode != 0:
        print(f"{tag} load generator failed:\n{run.stderr[-3000:]}", file=sys.stderr)
        return False
    r = loadgen_result(run)
    ratio = r["itl_p50_ms"] / args.decode_ms
    print(
        f"{tag} {r['completed']} of {args.requests} streams completed ({r['failed']} failed), "
        f"concurrency {args.concurrency}, ISL {args.isl}, OSL {args.osl}; "
        f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    for error, count in r["errors"].items():
        print(f"{tag}   {count} x {error}")
    print(f"{tag}   modelled decode pass      {args.decode_ms:.2f} ms")
    print(f"{tag}   client ITL p50            {r['itl_p50_ms']:.2f} ms ({ratio:.3f} of the pass)")
    print(f"{tag}   client ITL p99            {r['itl_p99_ms']:.2f} ms")
    print(f"{tag}   client TTFT p50 / p99     {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} ms")
    print(
        f"{tag}   chunks per request        fewest {r['chunks_min']}, median "
        f"{r['chunks_p50']} (of {args.osl} tokens); {r['short_streams']} with fewer "
        "than half their tokens"
    )
    print(
        f"{tag}   CPU s (with start-up)     "
        + ", ".join(f"{name} {s:.1f}" for name, s in cpu.items() if s is not None)
        + f", loadgen {r['cpu_s']:.1f}"
    )
    ok = abs(ratio - 1) <= TARGET and r["short_streams"] == 0 and r["failed"] == 0
    print(
        f"{tag}   ITL p50 within {TARGET:.0%} of the pass, every stream per pass: "
        + ("yes" if ok else "NO")
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["agg", "pd", "both"], default="both")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--decode-ms", type=float, default=10.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.02)
    parser.add_argument("--overhead-ms", type=float, default=1.0)
    add_peers_arguments(parser)
    args = parser.parse_args()
    python, workdir, model = peers_and_model(args, "dynamo-stream-timing-")
    print(f"{engined_version()}; {os.cpu_count()} CPUs; logs: {workdir}")
    modes = ["agg", "pd"] if args.mode == "both" else [args.mode]
    results = [run_mode(mode, args, python, model, workdir) for mode in modes]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
