"""How compare.py builds each side's core: as a default install would, pure, or compiled.

A side is a tree whose `engined` its children import through `PYTHONPATH`. Its core is what
`pip install` of that revision would give unless told otherwise (`default`): setup.py's own
default, run in place as `setup.py build_ext --inplace` under this interpreter (which has
mypy: the dev venv), with no `ENGINED_*` build variable. That is the compiled core from
issue 24 on, and pure Python before (the release `3a10a4f` has no compiled build at all).
`pure` builds nothing and, for a revision from issue 24 on, sets `ENGINED_PURE=1` for the
side's processes, which it honours even over extension modules; `compiled` asks for mypyc
(`ENGINED_MYPYC=1`) and fails when the revision has the compiled build and it does not
compile. The working tree is built in a copy of itself (tracked and unignored files, as a
fresh clone plus the uncommitted changes), so the checkout keeps its own build, unless it
already runs the core the side asks for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("default", "pure", "compiled")
BUILD_VARIABLES = ("ENGINED_PURE", "ENGINED_MYPYC")
# Which core a side's children run, in the words of the revision's own `engined.core.build()`.
_WHICH = (
    "import engined.core as c\n"
    "f = getattr(c, 'build', None)\n"
    "print(f() if f else 'pure Python (the revision has no compiled build)')"
)


@dataclass
class Side:
    tree: Path
    env: dict[str, str] = field(default_factory=dict)  # beyond child_env's
    core: str = ""


def child_env(tree: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in BUILD_VARIABLES}
    env["PYTHONPATH"] = str(tree)  # the tree's engined, not the editable install's
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONHOME", None)
    return {**env, **(extra or {})}


def side_python(side: Side, scratch: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` as the side's children run (away from the tree: PYTHONPATH alone)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=scratch,
        env=child_env(side.tree, side.env),
        capture_output=True,
        text=True,
    )


def which_core(side: Side, scratch: Path) -> str:
    proc = side_python(side, scratch, _WHICH)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"{side.tree}: `import engined.core` fails: {last}")
    return proc.stdout.strip()


def copy_of_working_tree(repo: Path, scratch: Path) -> Path:
    """The working tree's tracked and unignored files, as a fresh clone would have them plus
    the uncommitted changes, in `scratch` (so building it leaves the checkout as it is)."""
    dest = scratch / "new-working-tree"
    dest.mkdir()
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    for name in files.decode().split("\0"):
        source = repo / name
        if name and source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def build_in_place(tree: Path, mode: str) -> None:
    """`setup.py build_ext --inplace` as `pip install` would build the tree's core in `mode`
    ("default" or "compiled"); nothing for a revision without setup.py."""
    if not (tree / "setup.py").exists():
        return
    env = {k: v for k, v in os.environ.items() if k not in BUILD_VARIABLES}
    if mode == "compiled":
        env["ENGINED_MYPYC"] = "1"
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"{tree}: building the core failed: {last}")


def prepare(tree: Path, mode: str, scratch: Path, *, working_tree: bool) -> Side:
    """The side for `tree` with its core built as `mode` asks; `core` says which it runs."""
    if mode == "pure":
        # Only a revision that knows ENGINED_PURE gets it: older daemons refuse unknown
        # ENGINED_* variables (and build nothing unasked, so a fresh checkout is pure).
        knows = (tree / "engined" / "core" / "core_build.py").exists()
        side = Side(tree, {"ENGINED_PURE": "1"} if knows else {})
    else:
        side = Side(tree)
        wanted = "compiled (mypyc)"
        if working_tree and which_core(side, scratch) != wanted:
            side.tree = copy_of_working_tree(tree, scratch)
        if not working_tree or side.tree != tree:
            build_in_place(side.tree, mode)
    side.core = which_core(side, scratch)
    if mode == "compiled" and (tree / "setup.py").exists() and side.core != "compiled (mypyc)":
        raise SystemExit(f"{tree}: the core did not compile (mypy and a C compiler?): {side.core}")
    return side
