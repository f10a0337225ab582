"""Core throughput: a decode-heavy closed loop driven straight through `Engine.execute_pass`.

256 requests in flight (prompt 512, output 256, block size 16, prefix caching on, half of
each prompt shared within one of 8 prefix groups), no time scaling and no sleeping: this
measures the simulation itself. Run by hand:

    .venv/bin/python benchmarks/core_throughput.py [--requests 1024] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from engined.core import build
from engined.core.args import EngineArgs
from engined.core.engine import Engine
from engined.core.types import Request, Submit


def run(total_requests: int, concurrency: int, prompt: int, output: int, groups: int) -> None:
    args = EngineArgs(
        block_size=16,
        num_gpu_blocks=16384,
        max_num_seqs=concurrency,
        max_num_batched_tokens=8192,
        enable_prefix_caching=True,
        speedup_ratio=0.0,
    )
    core = Engine(args)
    rng = random.Random(0)
    prefixes = [[rng.randrange(50_000) for _ in range(prompt // 2)] for _ in range(groups)]

    pending = [
        Request(
            token_ids=prefixes[n % groups]
            + [rng.randrange(50_000) for _ in range(prompt - prompt // 2)],
            max_tokens=output,
            request_id=f"r{n}",
        )
        for n in range(total_requests)
    ]

    def make(n: int) -> Request:
        return pending[n]

    submitted = 0
    for _ in range(min(concurrency, total_requests)):
        core.apply(Submit(make(submitted)), now_ms=0.0)
        submitted += 1
    passes = tokens = events = finished = 0
    now = 0.0
    start = time.perf_counter()
    cpu_start = time.process_time()
    while finished < total_requests:
        result = core.execute_pass(now)
        now = result.end_ms
        passes += 1
        tokens += result.accept_length_output_tokens
        events += len(result.kv_events)
        for _ in result.ended:
            finished += 1
            if submitted < total_requests:
                core.apply(Submit(make(submitted)), now_ms=now)
                submitted += 1
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    print(f"core                {build()}")
    print(f"requests            {total_requests} (concurrency {concurrency})")
    print(f"passes              {passes}  ({passes / elapsed:,.0f} passes/s)")
    print(f"output tokens       {tokens}  ({tokens / elapsed:,.0f} tokens/s)")
    print(f"KV events           {events}  ({events / elapsed:,.0f} events/s)")
    print(f"wall time           {elapsed:.2f} s; modeled time {now / 1000:.1f} s")
    # CPU time leaves out the time the process waited for a core: on a shared machine it is
    # the steadier figure to compare revisions by.
    print(f"cpu time            {cpu:.2f} s  ({tokens / cpu:,.0f} output tokens per CPU s)")
    assert core.metrics().active_blocks == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile run")
    ns = parser.parse_args()
    if ns.profile:
        profiler = cProfile.Profile()
        profiler.runcall(run, ns.requests, ns.concurrency, ns.prompt, ns.output, ns.groups)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    else:
        run(ns.requests, ns.concurrency, ns.prompt, ns.output, ns.groups)


if __name__ == "__main__":
    main()
