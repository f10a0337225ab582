"""The same OpenAI workload through a real NVIDIA Dynamo 1.6.1 frontend, against two backends.

One run, one backend after the other, each behind a fresh frontend (`--router-mode kv` by
default) on the loopback, serving the tiny model of `tests/interop/tiny_model.py`:

  engined  `engined serve --speedup-ratio 0 --block-size 16 --num-gpu-blocks 16384` (this
           venv's engined) plus its Dynamo worker `python -m engined.dynamo` (peers venv,
           with engined installed there);
  mocker   `python -m dynamo.mocker --speedup-ratio 1e6` with the same block size, pool,
           max_num_seqs and max_num_batched_tokens. (Its `--speedup-ratio 0`, "infinite
           speedup" says its help, runs at about real time in 1.6.1: 29 ms ITL at 256 in
           flight, where 1e6 makes the frontend the limit.)

Workload: `--requests` streaming `/v1/completions`, `--concurrency` in flight (closed loop),
prompts of `--isl` random vocabulary words (one token each: checked against
`usage.prompt_tokens`), exactly `--osl` output tokens (`max_tokens` = `min_tokens` = OSL,
`ignore_eos`). Tokens are counted from `nvext.completion_token_ids` (the mocker's ids lie
outside the tiny vocabulary and decode to nothing), so TTFT (request sent to first token) and
ITL (between chunks that carry tokens, as the client reads them: a burst of chunks read back to
back shows as near-zero gaps) are measured the same way for both backends. A request
counts as completed only with `[DONE]`, the usage chunk and exactly ISL/OSL tokens.

The load generator is its own process: this file under the peers venv's python (asyncio +
aiohttp, `loadgen` subcommand), started after a few warm-up requests. Printed per backend:
completed, failed, wall s, output tokens/s, requests/s, TTFT and ITL p50/p99, the CPU seconds
of every process; at the end the engined/mocker output tokens/s ratio.

    .venv/bin/python benchmarks/dynamo_e2e.py [--backend engined|mocker|both] [--requests 1024]
        [--concurrency 256] [--isl 512] [--osl 256]

Everything binds 127.0.0.1 (Dynamo's event-plane PUB sockets excepted: 0.0.0.0, random
ports) and every process is stopped (SIGTERM, then SIGKILL) when its backend is done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
VOCAB_WORDS = 997
LOADGEN_TIMEOUT_S = 3600.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# --- the load generator (peers venv: stdlib + aiohttp) ----------------------------------------


# Where a chunk carries its token ids: Dynamo's `nvext.completion_token_ids`, or vLLM's
# `choices[].token_ids` (`return_token_ids: true`, engined's own API server). Either way the
# ids of the chunk's one choice are counted, never the usage.
ID_KEYS = {"nvext": b'"completion_token_ids":[', "token_ids": b'"token_ids":['}


def _count_ids(payload: bytes, key: bytes = ID_KEYS["nvext"]) -> int:
    """Token ids in a chunk's id list named by `key`, without parsing the JSON."""
    start = payload.find(key)
    if start < 0:
        return 0
    start += len(key)
    end = payload.find(b"]", start)
    return 0 if end == start else payload.count(b",", start, end) + 1


def _prompt(rng: random.Random, isl: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(isl))


async def _one(
    session: Any, url: str, body: bytes, isl: int, osl: int, key: bytes
) -> dict[str, Any]:
    """One streamed request: {"ok", "ttft", "itl": [...], "tokens", "chunks", "end", "error"}
    (`chunks`: those that carried tokens)."""
    sent = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens = chunks = 0
    usage: dict[str, Any] | None = None
    done = False
    error = ""
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as reply:
            if reply.status != 200:
                text = (await reply.text())[:200]
                return {"ok": False, "error": f"HTTP {reply.status}: {text}", "tokens": 0}
            event = b""
            async for line in reply.content:
                line = line.rstrip(b"\r\n")
                if line.startswith(b"event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith(b"data:"):
                    if not line:
                        event = b""
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                if event == b"error" or payload.startswith(b'{"error"'):
                    error = f"stream error: {payload[:200]!r}"
                    break
                n = _count_ids(payload, key)
                if n:
                    chunks += 1
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        assert last is not None
                        itl.append(now - last)
                    last = now
                    tokens += n
                if b'"usage":{' in payload:
                    usage = json.loads(payload).get("usage")
    except Exception as exc:  # a benchmark counts failures, it does not stop at one
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tokens": tokens}
    end = time.perf_counter()
    if not error:
        if not done:
            error = "no [DONE]"
        elif usage is None:
            error = "no usage chunk"
        elif usage.get("prompt_tokens") != isl:
            error = f"prompt_tokens {usage.get('prompt_tokens')} != ISL {isl}"
        elif usage.get("completion_tokens") != osl or tokens != osl:
            error = f"{tokens} ids, completion_tokens {usage.get('completion_tokens')} != {osl}"
    ttft = None if first is None else first - sent
    return {
        "ok": not error,
        "error": error,
        "ttft": ttft,
        "itl": itl,
        "tokens": tokens,
        "chunks": chunks,
        "end": end,
    }


async def _loadgen(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp  # type: ignore[import-not-found, unused-ignore]  # the peers venv's

    url = f"{args.url.rstrip('/')}/v1/completions"

    key = ID_KEYS[args.ids]
    ids: dict[str, Any] = (
        {"nvext": {"extra_fields": ["completion_token_ids"]}}
        if args.ids == "nvext"
        else {"return_token_ids": True}
    )

    def body(rng: random.Random) -> bytes:
        return json.dumps(
            {
                "model": args.model,
                "prompt": _prompt(rng, args.isl),
                "max_tokens": args.osl,
                "min_tokens": args.osl,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                **ids,
            }
        ).encode()

    warm_rng, rng = random.Random(args.seed + 1), random.Random(args.seed)
    warm = [body(warm_rng) for _ in range(args.warmup)]
    bodies = [body(rng) for _ in range(args.requests)]
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warm_results = await asyncio.gather(
            *(_one(session, url, b, args.isl, args.osl, key) for b in warm)
        )
        warm_failed = [r["error"] for r in warm_results if not r["ok"]]
        queue = list(reversed(bodies))
        results: list[dict[str, Any]] = []

        async def client() -> None:
            while queue:
                results.append(await _one(session, url, queue.pop(), args.isl, args.osl, key))

        cpu0 = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(args.concurrency, args.requests))))
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu0
    ok = [r for r in results if r["ok"]]
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "warmup_failed": warm_failed[:3],
        "wall_s": wall,
        "output_tokens": sum(r["tokens"] for r in ok),
        # A request whose tokens came in fewer chunks than half their number was batched up
        # on its way: its tokens did not leave on the pass that made them.
        "short_streams": sum(1 for r in ok if 2 * r["chunks"] < r["tokens"]),
        "min_chunks_per_token": min((r["chunks"] / r["tokens"] for r in ok), default=0.0),
        "chunks_min": min((r["chunks"] for r in ok), default=0),
        "chunks_p50": percentile([float(r["chunks"]) for r in ok], 50),
        "ttft_ms": [r["ttft"] * 1000 for r in ok if r["ttft"] is not None],
        "itl_ms": [d * 1000 for r in ok for d in r["itl"]],
        "cpu_s": cpu,
    }


def loadgen_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="dynamo_e2e.py loadgen")
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--isl", type=int, required=True)
    parser.add_argument("--osl", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--ids", choices=sorted(ID_KEYS), default="nvext")
    args = parser.parse_args(argv)
    try:
        import uvloop

        result = uvloop.run(_loadgen(args))
    except ImportError:
        result = asyncio.run(_loadgen(args))
    ttft, itl = result.pop("ttft_ms"), result.pop("itl_ms")
    result.update(
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        itl_p50_ms=percentile(itl, 50),
        itl_p99_ms=percentile(itl, 99),
        itl_mean_ms=sum(itl) / len(itl) if itl else float("nan"),
        itl_samples=len(itl),
    )
    print(json.dumps(result))


# --- the driver (the project's venv) ----------------------------------------------------------


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU a process has used (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def add_peers_arguments(parser: argparse.ArgumentParser) -> None:
    """The Dynamo venv and the log directory every Dynamo benchmark takes."""
    parser.add_argument(
        "--peers-python",
        type=Path,
        default=Path(os.environ.get("INTEROP_PEERS_PYTHON", REPO_ROOT / ".venv-peers/bin/python")),
        help="the Dynamo venv's python [env INTEROP_PEERS_PYTHON]",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="logs (default: a tmp dir)")


def peers_and_model(args: argparse.Namespace, prefix: str) -> tuple[Path, Path, Path]:
    """(the Dynamo venv's python, the log directory, a tiny model fit for `args.isl + args.osl`)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.interop.tiny_model import build_tiny_model

    # Not resolved: a venv's python is a symlink whose target lacks the venv's packages.
    python = args.peers_python.absolute()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    model = build_tiny_model(
        workdir / "tiny-model",
        vocab_words=VOCAB_WORDS,
        max_position_embeddings=max(4096, args.isl + args.osl),
        python=python,
    )
    return python, workdir, model


def run_loadgen(
    python: Path, url: str, args: argparse.Namespace, *extra: str
) -> subprocess.CompletedProcess[str]:
    """This script's `loadgen` in the Dynamo venv against `url`, with `args`' workload."""
    command = [str(python), str(Path(__file__).resolve()), "loadgen", "--url", url, *extra]
    command += ["--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    command += ["--isl", str(args.isl), "--osl", str(args.osl), "--warmup", str(args.warmup)]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=LOADGEN_TIMEOUT_S, env=env
    )


def loadgen_result(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON line a successful `loadgen` printed last."""
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine's shape as both backends take it: block size and pool first (the mocker
    takes those as arguments of its own), then `max_num_seqs` and `max_num_batched_tokens`."""
    return [
        "--block-size",
        str(args.block_size),
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]


def run_backend(
    backend: str, args: argparse.Namespace, python: Path, model: Path, workdir: Path
) -> dict[str, Any] | None:
    from tests.interop.dynamo_cluster import DynamoCluster

    engine = engine_flags(args)
    tag = f"[{backend}]"
    with DynamoCluster(python, workdir / backend, model_path=model, model_name=MODEL) as cluster:
        try:
            started = time.perf_counter()
            frontend = cluster.frontend(router_mode=args.router_mode)
            if backend == "engined":
                daemon = cluster.engined_daemon(
                    # No OpenAI API server of its own: Dynamo's frontend is the API here.
                    "--speedup-ratio",
                    "0",
                    "--model-name",
                    MODEL,
                    "--port",
                    "",
                    *engine,
                )
                cluster.engined_worker(daemon)
            else:
                cluster.mocker(
                    block_size=args.block_size,
                    num_gpu_blocks=args.num_gpu_blocks,
                    speedup_ratio=args.mocker_speedup_ratio,
                    extra_args=engine[4:],  # max_num_seqs, max_num_batched_tokens
                )
            print(f"{tag} up in {time.perf_counter() - started:.1f} s (logs: {workdir / backend})")
        except AssertionError as exc:
            first = str(exc).splitlines()[0]
            print(f"{tag} could not start: {first} (logs: {workdir / backend})", file=sys.stderr)
            return None
        run = run_loadgen(python, frontend.url, args)
        cpu = {p.name: cpu_seconds(p.pid) for p in cluster.processes}
        if run.returncode != 0:
            print(f"{tag} load generator failed:\n{run.stderr[-3000:]}", file=sys.stderr)
            return None
        result = loadgen_result(run)
        result["process_cpu_s"] = cpu
        routed = [r for r in frontend.route_lines() if r.outcome == "success"]
        result["routed_ok"] = len(routed)
    result["exit_codes"] = cluster.exit_codes
    return result


def report(backend: str, args: argparse.Namespace, r: dict[str, Any]) -> None:
    tag = f"[{backend}]"
    wall = r["wall_s"]
    print(
        f"{tag} {args.requests} streaming completions, concurrency {args.concurrency}, "
        f"ISL {args.isl}, OSL {args.osl}, router {args.router_mode}"
        + (f", speedup {args.mocker_speedup_ratio:g}" if backend == "mocker" else ", speedup 0")
    )
    print(f"{tag}   completed         {r['completed']:>12,}")
    print(f"{tag}   failed            {r['failed']:>12,}")
    for error, count in r["errors"].items():
        print(f"{tag}     {count} x {error}")
    if r["warmup_failed"]:
        print(f"{tag}   warm-up failures: {r['warmup_failed']}")
    print(f"{tag}   wall s            {wall:>12.2f}")
    print(f"{tag}   output tokens/s   {r['output_tokens'] / wall:>12,.0f}")
    print(f"{tag}   requests/s        {r['completed'] / wall:>12,.2f}")
    print(f"{tag}   TTFT ms           p50 {r['ttft_p50_ms']:>9.1f}   p99 {r['ttft_p99_ms']:>9.1f}")
    print(f"{tag}   ITL ms            p50 {r['itl_p50_ms']:>9.2f}   p99 {r['itl_p99_ms']:>9.2f}")
    chunks = r["itl_samples"] + r["completed"]  # token-carrying chunks
    if chunks:
        # Near-zero ITL quantiles mean tokens arrive in bursts of chunks read back to back.
        print(f"{tag}   tokens per chunk  {r['output_tokens'] / chunks:>12.2f}")
    cpu = ", ".join(f"{name} {s:.1f}" for name, s in r["process_cpu_s"].items() if s is not None)
    print(f"{tag}   CPU s (with start-up) {cpu}, loadgen {r['cpu_s']:.1f}")
    print(f"{tag}   route lines (success) {r['routed_ok']:,}; exit codes {r['exit_codes']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "loadgen":
        loadgen_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["engined", "mocker", "both"], default="both")
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
    parser.add_argument(
        "--mocker-speedup-ratio",
        type=float,
        default=1e6,
        help="the mocker's --speedup-ratio (its 0 is not infinite in 1.6.1)",
    )
    add_peers_arguments(parser)
    args = parser.parse_args()
    if args.osl < 1 or args.isl < 1 or args.requests < 1 or args.concurrency < 1:
        parser.error("--isl, --osl, --requests and --concurrency must be >= 1")
    python, workdir, model = peers_and_model(args, "dynamo-e2e-")
    backends = ["engined", "mocker"] if args.backend == "both" else [args.backend]
    results: dict[str, dict[str, Any]] = {}
    for backend in backends:
        result = run_backend(backend, args, python, model, workdir)
        if result is not None:
            results[backend] = result
            report(backend, args, result)
    if {"engined", "mocker"} <= results.keys():
        e, m = results["engined"], results["mocker"]
        ratio = (e["output_tokens"] / e["wall_s"]) / (m["output_tokens"] / m["wall_s"])
        print(f"engined/mocker output tokens/s ratio: {ratio:.2f}")
    if len(results) < len(backends):
        sys.exit(1)


if __name__ == "__main__":
    main()
