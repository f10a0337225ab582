"""A/B benchmark: an older revision against the working tree, alternating runs on one machine.

    .venv/bin/python benchmarks/compare.py REV [--benchmark core|e2e|e2e-pacing] [--repeat 3]
        [--new REV2] [--compiled none|new|both] [--script-from own|new] [--clock wall|cpu]
        [-- extra args]

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

`--compiled new` compiles the new side's core with mypyc first (`ENGINED_MYPYC=1 setup.py
build_ext --inplace`, under this interpreter, which needs mypy: the dev venv has it), in a copy
of the working tree when that is the new side, so the checkout gets no `.so`; `both` compiles
the old side's worktree too, when its revision has the compiled build (3a10a4f has not: it
stays pure Python, which is the release's figure). Each side says which core it runs.

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


def child_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)  # the tree's engined, not the editable install's
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONHOME", None)
    return env


def side_python(tree: Path, scratch: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` as the side's children run (away from the tree: PYTHONPATH alone)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=scratch,
        env=child_env(tree),
        capture_output=True,
        text=True,
    )


def check_import(tree: Path, scratch: Path) -> str:
    """The `engined` the side's children import."""
    proc = side_python(tree, scratch, "import engined.cli; print(engined.cli.__file__)")
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or ["no message"]
        raise SystemExit(f"{tree}: `import engined.cli` fails: {last[0]}")
    out = proc.stdout.strip()
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: `import engined` resolved to {out}, outside the tree")
    return out


def copy_of_working_tree(scratch: Path) -> Path:
    """The working tree's tracked and unignored files, as a fresh clone would have them plus
    the uncommitted changes, in `scratch` (so compiling it leaves no `.so` in the checkout)."""
    dest = scratch / "new-working-tree"
    dest.mkdir()
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout
    for name in files.decode().split("\0"):
        source = REPO / name
        if name and source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def compile_core(tree: Path, scratch: Path) -> str:
    """Compile the tree's core in place as `ENGINED_MYPYC=1 pip install` would; says what
    the side then runs. A revision from before the compiled build stays pure Python."""
    if not (tree / "setup.py").exists():
        return "pure Python (the revision has no compiled build)"
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tree,
        env={**os.environ, "ENGINED_MYPYC": "1"},
        capture_output=True,
        text=True,
    )
    check = side_python(tree, scratch, "import engined.core as c; print(c.compiled())")
    if proc.returncode != 0 or check.stdout.strip() != "True":
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"{tree}: compiling the core failed (mypy and a C compiler?): {last}")
    return "compiled (mypyc)"


# Runs the script (argv[1]) as __main__ with the CPU clock standing in for perf_counter.
_CPU_CLOCK = (
    "import runpy, sys, time; time.perf_counter = time.process_time; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_side(tree: Path, script: Path, args: list[str], clock: str = "wall") -> str:
    """One run; its own process group, so an interrupt here also ends the daemon it started."""
    launch = [sys.executable] if clock == "wall" else [sys.executable, "-c", _CPU_CLOCK]
    cmd = [*launch, str(script), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=tree,
        env=child_env(tree),
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
        "--compiled",
        choices=("none", "new", "both"),
        default="none",
        help="compile the core (mypyc) of the new side, or of both, before the runs "
        "(the working tree is copied first; needs mypy and a C compiler)",
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
            if ns.compiled == "both":
                print(f"old core: {compile_core(old_tree, scratch)}")
            with contextlib.ExitStack() as stack:
                if ns.new is not None:
                    new_tree = stack.enter_context(worktree(ns.new, scratch, "new"))
                elif ns.compiled != "none":
                    new_tree = copy_of_working_tree(scratch)
                else:
                    new_tree = REPO
                if ns.compiled != "none":
                    print(f"new core: {compile_core(new_tree, scratch)}")
                run_rounds(
                    old_tree,
                    new_tree,
                    script,
                    ns.script_from,
                    args,
                    metrics,
                    ns.repeat,
                    scratch,
                    ns.clock,
                )
    except KeyboardInterrupt:
        print("interrupted; worktrees removed", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_rounds(
    old_tree: Path,
    new_tree: Path,
    script: str,
    script_from: str,
    args: list[str],
    metrics: list[Metric],
    repeat: int,
    scratch: Path,
    clock: str = "wall",
) -> None:
    trees = {"old": old_tree, "new": new_tree}
    scripts: dict[str, Path] = {}
    for side, tree in trees.items():
        scripts[side] = (new_tree if script_from == "new" else tree) / "benchmarks" / script
        print(f"{side} imports {check_import(tree, scratch)}, runs {scripts[side]}")
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for n in range(repeat):
        order = ("old", "new") if n % 2 == 0 else ("new", "old")
        for side in order:
            started = time.perf_counter()
            values = parse(metrics, run_side(trees[side], scripts[side], args, clock))
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
