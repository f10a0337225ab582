"""Streamed timing through engined's API server at speedup 1: does each token leave on its pass?

Issue 22: "tokens leave on the pass that generated them: a streaming client measures the
modelled TTFT and ITL, not the API server's queueing. At speedup 1 and 64 concurrent streams,
the client-observed ITL p50 is within 10% of the modelled decode pass time."

One `engined serve --port P` (the tiny model of `tests/interop/tiny_model.py`) paced in real
time (`--speedup-ratio 1`) with the fixed perf model, so that a pass that only decodes takes
exactly `--decode-ms` (`--fixed-decode-ms-per-pass`) and one that also prefills takes
`--overhead-ms` + `--prefill-ms-per-token` per new token more. The load generator of
`benchmarks/dynamo_e2e.py` (peers venv, aiohttp) keeps `--concurrency` streams in flight
(closed loop) and measures ITL between chunks that carry tokens, as the client reads them.

Printed: the client-observed ITL p50 and p99 against the modelled decode pass, their ratio
(target within 10%), TTFT, and how many streams had fewer chunks than half their tokens
(target: none; such a stream got tokens of several passes in one chunk). Also the mean ITL
as the client sees it beside the daemon's own (`vllm:inter_token_latency_seconds` from
the daemon's `--http-port`, pass end to pass end): what lies between the two is the API server's.

    .venv/bin/python benchmarks/openai_itl.py [--concurrency 64] [--requests 256]
        [--isl 128] [--osl 256] [--decode-ms 10] [--api-server-count 1]
        [--realtime-priority 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dynamo_e2e import (  # noqa: E402
    MODEL,
    add_peers_arguments,
    loadgen_result,
    peers_and_model,
    run_loadgen,
)
from openai_e2e import engined_version, wait_health  # noqa: E402

TARGET = 0.10


def daemon_itl(url: str) -> tuple[float, float]:
    """`vllm:inter_token_latency_seconds` sum and count, as the daemon measures its passes."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10.0) as reply:
        text = reply.read().decode()
    totals = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for suffix in totals:
            if name.startswith(f"vllm:inter_token_latency_seconds{suffix}"):
                totals[suffix] += float(value.split()[0])
    return totals["_sum"], totals["_count"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--decode-ms", type=float, default=10.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.02)
    parser.add_argument("--overhead-ms", type=float, default=1.0)
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument(
        "--realtime-priority",
        type=int,
        default=0,
        help="the daemon's --realtime-priority (SCHED_FIFO ranks; needs CAP_SYS_NICE)",
    )
    add_peers_arguments(parser)
    args = parser.parse_args()
    from tests.interop.dynamo_cluster import DynamoCluster
    from tests.support import free_tcp_port

    python, workdir, model = peers_and_model(args, "openai-itl-")
    port, metrics_port = free_tcp_port(), free_tcp_port()
    flags = [
        str(model),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-server-count",
        str(args.api_server_count),
        "--http-port",
        str(metrics_port),
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
        "--realtime-priority",
        str(args.realtime_priority),
    ]
    url = f"http://127.0.0.1:{port}"
    # NOTE: the daemon's own Prometheus port: /metrics on the API port is part d's, to come.
    metrics = f"http://127.0.0.1:{metrics_port}"
    print(f"{engined_version()}; load average {os.getloadavg()[0]:.2f} at start")
    print(f"engined serve MODEL {' '.join(flags[1:])}")
    with DynamoCluster(python, workdir, model_path=model, model_name=MODEL) as cluster:
        wait_health(url, cluster.engined_daemon(*flags))
        before = daemon_itl(metrics)
        run = run_loadgen(python, url, args, "--ids", "token_ids")
        after = daemon_itl(metrics)
    if run.returncode != 0:
        sys.exit(f"load generator failed:\n{run.stderr[-3000:]}")
    r = loadgen_result(run)
    ratio = r["itl_p50_ms"] / args.decode_ms
    print(
        f"{r['completed']} of {args.requests} streams completed ({r['failed']} failed), "
        f"concurrency {args.concurrency}, ISL {args.isl}, OSL {args.osl}, "
        f"load average {os.getloadavg()[0]:.2f} at end"
    )
    for error, count in r["errors"].items():
        print(f"  {count} x {error}")
    print(f"modelled decode pass      {args.decode_ms:.2f} ms")
    print(f"client ITL p50            {r['itl_p50_ms']:.2f} ms  ({ratio:.3f} of the pass)")
    print(f"client ITL p99            {r['itl_p99_ms']:.2f} ms")
    itl_sum, itl_count = after[0] - before[0], after[1] - before[1]
    if itl_count:
        print(
            f"ITL mean: client {r['itl_mean_ms']:.2f} ms, the daemon's own "
            f"{itl_sum / itl_count * 1000:.2f} ms (vllm:inter_token_latency_seconds, "
            "warm-up included)"
        )
    print(f"client TTFT p50 / p99     {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} ms")
    print(
        f"streams with fewer chunks than half their tokens: {r['short_streams']} "
        f"(fewest chunks per token {r['min_chunks_per_token']:.3f})"
    )
    ok = abs(ratio - 1) <= TARGET and r["short_streams"] == 0 and r["failed"] == 0
    verdict = "yes" if ok else "NO"
    print(f"ITL p50 within {TARGET:.0%} of the pass, every stream per pass: {verdict}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
