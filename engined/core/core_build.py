"""Which core a process runs, and the build record that vouches for the compiled one.

The compiled core is extension modules beside their sources (setup.py, mypyc), and Python
imports an extension in preference to its source: a source edited after the build, in an
editable install, would silently not run. So a process loads the extensions only when the
build record (`build.json` beside this module, written by setup.py) says they were compiled
from exactly the sources now on disk (sha256 of each) and all of them are there. Otherwise,
or under `ENGINED_PURE=1`, a finder imports every compiled module from its source instead,
and `CoreBuild.reason` says why. All or none: compiled modules call each other's native
classes directly, so a compiled caller next to an interpreted copy of its callee would run
two versions of one class.

Standard library only: setup.py loads this file by path to write the record, so the build
and the check share one definition of it.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

RECORD = "build.json"
# mypyc's shared library of the whole group (setup.py: `group_name="engined_core"`), at the
# top level of the install, beside the `engined` package.
GROUP_LIBRARY = "engined_core__mypyc"
PURE_VARIABLE = "ENGINED_PURE"
REBUILD = "pip install -e . rebuilds it"


@dataclass(frozen=True)
class CoreBuild:
    """The core this process runs. `reason` says why it is the pure one ("" when compiled);
    `refused` is true when extension modules were there but not loaded."""

    compiled: bool
    reason: str = ""
    refused: bool = False

    @property
    def core(self) -> str:
        return "compiled" if self.compiled else "pure"

    def __str__(self) -> str:
        if self.compiled:
            return "compiled (mypyc)"
        return f"pure Python ({self.reason})" if self.reason else "pure Python"


def pure_requested(env: Mapping[str, str]) -> str | None:
    """Why the environment asks for the pure core at run time, or None."""
    value = env.get(PURE_VARIABLE, "")
    return None if value in ("", "0") else f"{PURE_VARIABLE}={value}"


def build_opt_out(env: Mapping[str, str]) -> str | None:
    """Why the environment asks the build for the pure core, or None (compile, the default).
    `ENGINED_MYPYC=0` is the opt-out in the spelling of the old opt-in `ENGINED_MYPYC=1`."""
    if reason := pure_requested(env):
        return reason
    return "ENGINED_MYPYC=0" if env.get("ENGINED_MYPYC") == "0" else None


def source_path(root: Path, name: str) -> Path:
    """The source of module `name` (dotted) under `root`, the directory holding `engined/`:
    its `.py`, or its `.c` for a module written in C (one with no `.py`)."""
    base = root.joinpath(*name.split("."))
    c_source = base.with_suffix(".c")
    if c_source.exists() and not base.with_suffix(".py").exists():
        return c_source
    return base.with_suffix(".py")


def extension_paths(root: Path, name: str) -> list[Path]:
    """The extension modules on disk that Python would import for `name` instead of its source
    (`name` may also be the top-level `GROUP_LIBRARY`)."""
    base = root.joinpath(*name.split("."))
    found = (
        base.with_name(base.name + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )
    return [path for path in found if path.exists()]


def digests(root: Path, modules: Iterable[str]) -> dict[str, str]:
    """sha256 of each module's source: what the record says was compiled."""
    return {
        name: hashlib.sha256(source_path(root, name).read_bytes()).hexdigest() for name in modules
    }


def write_record(directory: Path, compiled: dict[str, str] | None, reason: str) -> Path:
    """Record a build in `directory` (engined/core of the tree or of the wheel being built):
    the digests of the compiled sources, or `None` and why the core is pure."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RECORD
    body: dict[str, object] = {"core": "pure", "reason": reason}
    if compiled is not None:
        body = {"core": "compiled", "sources": compiled}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return path


def read_record(root: Path) -> dict[str, object] | None:
    """The record of the build in `root`, or None when there is none or it is unreadable."""
    try:
        body = json.loads((root / "engined" / "core" / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def inspect(root: Path, modules: Sequence[str], env: Mapping[str, str]) -> CoreBuild:
    """Which core a process started with `env` may run from the install at `root`."""
    present = [name for name in modules if extension_paths(root, name)]
    record = read_record(root)
    kind = record.get("core") if record is not None else None
    if not present:
        reason = record.get("reason") if record is not None else None
        if kind == "pure" and isinstance(reason, str) and reason:
            return CoreBuild(False, f"built pure: {reason}")
        if kind == "compiled":
            return CoreBuild(False, f"the compiled modules are missing; {REBUILD}")
        return CoreBuild(False, pure_requested(env) or "")
    if requested := pure_requested(env):
        return CoreBuild(False, requested, refused=True)
    sources = record.get("sources") if record is not None else None
    if not isinstance(sources, dict) or kind != "compiled":
        why = "no readable build record"
        if record is not None:
            why = "the record of a pure build" if kind != "compiled" else "a malformed build record"
        return CoreBuild(False, f"extension modules but {why}; {REBUILD}", refused=True)
    missing = [name for name in (*modules, GROUP_LIBRARY) if not extension_paths(root, name)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        why = f"partly compiled (no extension module for {missing[0]}{more})"
        return CoreBuild(False, f"{why}; {REBUILD}", refused=True)
    missing = [name for name in modules if not source_path(root, name).exists()]
    if missing:  # an install that left a source out: nothing vouches for its extension
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        why = f"no source for {missing[0]}{more}"
        return CoreBuild(False, f"{why}; {REBUILD}", refused=True)
    changed = [
        name for name, digest in digests(root, modules).items() if sources.get(name) != digest
    ]
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        where = source_path(root, changed[0]).relative_to(root)
        return CoreBuild(False, f"{where}{more} changed since the build; {REBUILD}", refused=True)
    return CoreBuild(True)


class SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the compiled modules from their sources, ahead of their extension modules; a
    module written in C has no Python source, so the pure core runs without it (its importer
    falls back to Python on the ImportError)."""

    def __init__(self, root: Path, modules: Iterable[str]) -> None:
        self._root = root
        self._modules = frozenset(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._modules:
            return None
        source = source_path(self._root, fullname)
        if source.suffix != ".py" or not source.exists():
            why = f"{fullname} has no Python source: the pure core runs without it"
            raise ModuleNotFoundError(why, name=fullname)
        return importlib.util.spec_from_file_location(fullname, source)


_running: CoreBuild | None = None


def activate(modules: Sequence[str], env: Mapping[str, str]) -> CoreBuild:
    """Decide which core this process runs, before any compiled module is imported (`engined`
    calls this first); when that is the pure one over extension modules on disk, make the
    sources win the import. Once per process: later calls return the first decision."""
    global _running
    if _running is None:
        root = Path(__file__).resolve().parents[2]  # the directory holding `engined/`
        _running = inspect(root, modules, env)
        if _running.refused:
            sys.meta_path.insert(0, SourceFinder(root, modules))
    return _running


def running() -> CoreBuild:
    """The core this process runs (`activate`'s decision)."""
    if _running is None:
        raise RuntimeError("engined.core.core_build.activate has not run (import engined first)")
    return _running
