"""A/B benchmark: an older revision against the working tree, alternating runs on one machine.

    .venv/bin/python benchmarks/compare.py REV [--benchmark core|e2e|e2e-pacing] [--repeat 3]
        [--new REV2] [--core default|pure|compiled | --compiled none|new|both]
        [--script-from own|new] [--clock wall|cpu] [-- extra args]

REV is checked out in a temporary `git worktree` (removed at the end, also on Ctrl-C). Each
side runs its *own* copy of the benchmark script with identical arguments, under this
interpreter, with `PYTHONPATH` and the working directory set to its tree: `import engined`
then resolves to that tree (the editable install's finder comes after `sys.path`, so it does
not shadow it), and so does a daemon the script starts with `sys.executable -m engined.cli`
(the child inherits both). Before the runs, each side prints which `engined` it imports.
`--script-from new` runs the new side's script on both trees instead: the same harness (load
generator, measurement) against both daemons, when the benchmark itself changed in between
(e2e_throughput --pacing did after 3a10a4f: the load generator moved to its own process).

The sides alternate old/new, new/old, ... (ABBA) for `--repeat` rounds, so drift on a shared
machine cancels; per round, then as medians and as each side's best round, with the ratio
new/old. Absolute figures on a loaded machine are noise; read the ratios (and the daemon CPU
per token of the e2e benchmark, which is less sensitive to other load than wall time). Other
load only ever slows a run down, so on a noisy day the ratio of the best rounds (timeit's
rule) is the steadier one; the medians say what a typical run gets.

Each side's core is, unless told otherwise, what a default install of its revision gives
(`--core default`: compiled from issue 24 on, pure Python before; 3a10a4f has no compiled
build), so the ratios are what users get; `--core pure` or `--core compiled` sets both
sides, and the older `--compiled new` (old pure, new compiled), `both` and `none` (both pure)
still work. compare_builds.py says how each is built; each side prints which core it runs.

`--clock cpu` (core benchmark only) runs each side's script with `time.perf_counter` replaced
by `time.process_time`, so its rates count CPU seconds, not wall seconds: time the process
spent waiting for a core on a shared machine drops out (it still pays for caches and the
other hyperthread). Both revisions' scripts time their loop with `perf_counter` alone, which
is what makes the swap apply to old and new alike.

Benchmarks: `core` = core_throughput.py, `e2e` = e2e_throughput.py (ipc and tcp throughput),
`e2e-pacing` = e2e_throughput.py --pacing (pass-start lateness; steady-state lines and the
idle CPU only where the script prints them). Keep `--requests` small while developing, e.g.
`-- --requests 256`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from compare_builds import MODES, Side, child_env, prepare, side_python

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Metric:
    name: str
    pattern: re.Pattern[str]
    higher_is_better: bool
    group: int = 1
    # Several matches (one per rank): how to fold them into one number.
    fold: Callable[[list[float]], float] = max


def _m(name: str, pattern: str, higher: bool, group: int = 1) -> Metric:
    return Metric(name, re.compile(pattern, re.MULTILINE), higher, group)


_NUM = r"([\d,]+(?:\.\d+)?)"
# Pass-start lateness of all passes (every revision prints these) and, where the script
# prints them, of the steady state only; worst rank.
_LATE = rf"passes \d+, pass-start lateness ms p50 {_NUM}\s+p99 {_NUM}\s+max {_NUM}"

BENCHMARKS: dict[str, tuple[str, list[str], list[Metric]]] = {
    "core": (
        "core_throughput.py",
        [],
        [
            _m("output tokens/s", rf"^output tokens\s+\d+\s+\({_NUM} tokens/s\)", True),
            _m("passes/s", rf"^passes\s+\d+\s+\({_NUM} passes/s\)", True),
        ],
    ),
    "e2e": (
        "e2e_throughput.py",
        [],
        [
            _m("[ipc] output tokens/s", rf"^\[ipc\]\s+output tokens/s\s+{_NUM}", True),
            _m("[tcp] output tokens/s", rf"^\[tcp\]\s+output tokens/s\s+{_NUM}", True),
            _m("[ipc] µs/token CPU", rf"^\[ipc\]\s+daemon CPU .*\({_NUM} µs per output", False),
            _m("[tcp] µs/token CPU", rf"^\[tcp\]\s+daemon CPU .*\({_NUM} µs per output", False),
            # Printed by the script from 2026-12-05 on (`--script-from new` for older trees).
            _m("[ipc] µs/token CPU, load", rf"^\[ipc\]\s+daemon CPU, load .*\({_NUM} µs", False),
            _m("[tcp] µs/token CPU, load", rf"^\[tcp\]\s+daemon CPU, load .*\({_NUM} µs", False),
        ],
    ),
    "e2e-pacing": (
        "e2e_throughput.py",
        ["--pacing"],
        [
            _m("all p50 ms (worst rank)", rf"^\s+rank \d+: {_LATE}", False, 1),
            _m("all p99 ms (worst rank)", rf"^\s+rank \d+: {_LATE}", False, 2),
            _m("all max ms (worst rank)", rf"^\s+rank \d+: {_LATE}", False, 3),
            _m("steady p50 ms (worst rank)", rf"^\s+steady rank \d+: {_LATE}", False, 1),
            _m("steady p99 ms (worst rank)", rf"^\s+steady rank \d+: {_LATE}", False, 2),
            _m("steady max ms (worst rank)", rf"^\s+steady rank \d+: {_LATE}", False, 3),
            _m("idle daemon cpu %", rf"^idle daemon cpu {_NUM}% of a core", False),
            _m("idle cpu % (schedstat)", rf"^idle daemon cpu .*; {_NUM}% from schedstat", False),
        ],
    ),
}


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def describe(rev: str | None) -> str:
    if rev is None:
        head = git("log", "-1", "--format=%h %s")
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
        return f"working tree at {head}" + (" + uncommitted changes" if dirty else "")
    return git("log", "-1", "--format=%h %s", rev)


@contextmanager
def worktree(rev: str, parent: Path, side: str) -> Iterator[Path]:
    """A detached checkout of `rev` under `parent`, removed on the way out."""
    path = parent / f"{side}-{git('rev-parse', '--short', rev)}"
    git("worktree", "add", "--detach", str(path), rev)
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True
        )
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def check_import(side: Side, scratch: Path) -> str:
    """The `engined` the side's children import."""
    tree = side.tree
    proc = side_python(side, scratch, "import engined.cli; print(engined.cli.__file__)")
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or ["no message"]
        raise SystemExit(f"{tree}: `import engined.cli` fails: {last[0]}")
    out = proc.stdout.strip()
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: `import engined` resolved to {out}, outside the tree")
    return out


# Runs the script (argv[1]) as __main__ with the CPU clock standing in for perf_counter.
_CPU_CLOCK = (
    "import runpy, sys, time; time.perf_counter = time.process_time; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_side(side: Side, script: Path, args: list[str], clock: str = "wall") -> str:
    """One run; its own process group, so an interrupt here also ends the daemon it started."""
    launch = [sys.executable] if clock == "wall" else [sys.executable, "-c", _CPU_CLOCK]
    cmd = [*launch, str(script), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=side.tree,
        env=child_env(side.tree, side.env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate()
    except BaseException:
        end_group(proc)
        raise
    if proc.returncode != 0:
        sys.stderr.write(out + err)
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
    return out


def end_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the run's process group (the script, its daemon, a load generator)."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        # The script is gone; give the rest of its group (a daemon draining) a moment.
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def parse(metrics: list[Metric], text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for metric in metrics:
        found = [
            float(m.group(metric.group).replace(",", "")) for m in metric.pattern.finditer(text)
        ]
        if found:
            values[metric.name] = metric.fold(found)
    return values


def fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3f}"


def machine() -> str:
    u = os.uname()
    return (
        f"machine: {platform.processor() or u.machine}, {os.cpu_count()} CPUs, "
        f"{u.sysname} {u.release} {u.version} {u.machine}; python {platform.python_version()}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> None:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rev", help="the old revision (e.g. 3a10a4f)")
    parser.add_argument("--benchmark", choices=sorted(BENCHMARKS), default="core")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (one run of each side)")
    parser.add_argument("--new", default=None, help="a revision instead of the working tree")
    parser.add_argument(
        "--core",
        choices=MODES,
        default=None,
        help="each side's core: as a default install of its revision builds it (the "
        "default), pure Python, or compiled by mypyc (needs mypy and a C compiler)",
    )
    parser.add_argument(
        "--compiled",
        choices=("none", "new", "both"),
        default=None,
        help="the older spelling: none = --core pure; new = the old side pure, the new "
        "compiled; both = --core compiled",
    )
    parser.add_argument(
        "--script-from",
        choices=("own", "new"),
        default="own",
        help="each side runs its own tree's benchmark script, or both the new side's",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="rates per wall second, or per CPU second of the benchmark process (core only)",
    )
    ns = parser.parse_args(argv)
    if ns.clock == "cpu" and ns.benchmark != "core":
        parser.error("--clock cpu applies to the core benchmark only (e2e runs a daemon)")
    if ns.core is not None and ns.compiled is not None:
        parser.error("--core and --compiled: say it once")
    old_mode, new_mode = {
        None: (ns.core or "default",) * 2,
        "none": ("pure", "pure"),
        "new": ("pure", "compiled"),
        "both": ("compiled", "compiled"),
    }[ns.compiled]
    script, fixed, metrics = BENCHMARKS[ns.benchmark]
    args = fixed + extra
    signal.signal(signal.SIGTERM, _interrupt)  # so the worktrees are removed then as well

    print(machine())
    shown = " ".join(args) or "(default arguments)"
    print(f"benchmark: {script} {shown}; {ns.repeat} rounds, ABBA order, {ns.clock} clock")
    print(f"old: {describe(ns.rev)}")
    print(f"new: {describe(ns.new)}")
    scratch = Path(tempfile.mkdtemp(prefix="engined-compare-"))
    try:
        with worktree(ns.rev, scratch, "old") as old_tree:
            old = prepare(old_tree, old_mode, scratch, working_tree=False)
            print(f"old core ({old_mode}): {old.core}")
            with contextlib.ExitStack() as stack:
                if ns.new is not None:
                    new_tree = stack.enter_context(worktree(ns.new, scratch, "new"))
                else:
                    new_tree = REPO
                new = prepare(new_tree, new_mode, scratch, working_tree=ns.new is None)
                print(f"new core ({new_mode}): {new.core}")
                run_rounds(
                    old, new, script, ns.script_from, args, metrics, ns.repeat, scratch, ns.clock
                )
    except KeyboardInterrupt:
        print("interrupted; worktrees removed", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_rounds(
    old: Side,
    new: Side,
    script: str,
    script_from: str,
    args: list[str],
    metrics: list[Metric],
    repeat: int,
    scratch: Path,
    clock: str = "wall",
) -> None:
    sides = {"old": old, "new": new}
    scripts: dict[str, Path] = {}
    for side, built in sides.items():
        scripts[side] = (new if script_from == "new" else built).tree / "benchmarks" / script
        print(f"{side} imports {check_import(built, scratch)}, runs {scripts[side]}")
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for n in range(repeat):
        order = ("old", "new") if n % 2 == 0 else ("new", "old")
        for side in order:
            started = time.perf_counter()
            values = parse(metrics, run_side(sides[side], scripts[side], args, clock))
            results[side].append(values)
            shown = ", ".join(f"{k} {fmt(v)}" for k, v in values.items())
            print(f"round {n + 1} {side}: {shown}  ({time.perf_counter() - started:.1f} s)")
    width = max(len(m.name) for m in metrics)
    summaries: list[tuple[str, Callable[[list[float], bool], float]]] = [
        ("median", lambda found, _higher: statistics.median(found)),
        ("best", lambda found, higher: max(found) if higher else min(found)),
    ]
    for title, summary in summaries:
        print(f"\n{title:<{width}}  {'old':>12}  {'new':>12}  new/old")
        for metric in metrics:
            folded: dict[str, float | None] = {}
            for side in ("old", "new"):
                found = [r[metric.name] for r in results[side] if metric.name in r]
                folded[side] = summary(found, metric.higher_is_better) if found else None
            old, new = folded["old"], folded["new"]
            if old is None and new is None:
                continue
            ratio = f"{new / old:.3f}" if old and new is not None else "n/a"
            better = "higher is better" if metric.higher_is_better else "lower is better"
            print(f"{metric.name:<{width}}  {fmt(old):>12}  {fmt(new):>12}  {ratio:>7}  ({better})")


if __name__ == "__main__":
    main()
