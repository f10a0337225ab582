"""The build (setup.py): the compiled core by default, the pure one on request or where it
cannot compile, said in one line, and recorded for `engined --version`, the start-up log and
/metrics (engined/core/core_build.py reads the record).

The builds run `setup.py` over a copy of the tree, so this checkout's own build is untouched.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from engined.core import COMPILED_MODULES, core_build

ROOT = Path(__file__).resolve().parents[1]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
SAID = "engined: building the pure-Python core: "
BUILD_TIMEOUT_S = 600.0


@pytest.fixture
def setup_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """setup.py imported under another name than __main__: its functions, no build."""
    for name in ("ENGINED_PURE", "ENGINED_MYPYC"):
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("engined_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_compiles_unless_told_or_unable(
    setup_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["setup.py", "egg_info"])
    assert setup_module.mypyc_extensions() == ([], "")  # metadata: nothing to compile yet
    monkeypatch.setenv("ENGINED_MYPYC", "0")
    assert setup_module.mypyc_extensions() == ([], "ENGINED_MYPYC=0")
    monkeypatch.setenv("ENGINED_MYPYC", "1")
    monkeypatch.setenv("ENGINED_PURE", "1")
    assert setup_module.mypyc_extensions() == ([], "ENGINED_PURE=1")
    monkeypatch.delenv("ENGINED_PURE")
    monkeypatch.setattr(sys.implementation, "name", "pypy")
    assert setup_module.mypyc_extensions() == ([], "mypyc compiles for CPython only, not pypy")
    monkeypatch.setattr(sys.implementation, "name", "cpython")
    monkeypatch.setitem(sys.modules, "mypyc.build", None)
    assert setup_module.mypyc_extensions() == (
        [],
        "mypyc is not installed (a build without isolation: pip install mypy)",
    )


def copy_tree(dest: Path) -> Path:
    """What setup.py needs of the tree (a checkout's sources, no build products)."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "engined",
        dest / "engined",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", core_build.RECORD),
    )
    return dest


def run_setup(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("ENGINED_PURE", "ENGINED_MYPYC")}
    return subprocess.run(
        [sys.executable, "setup.py", "-q", *args],
        cwd=tree,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )


def said(run: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith(SAID)]


def record(directory: Path) -> object:
    return json.loads((directory / "engined" / "core" / core_build.RECORD).read_text())


def which_core(tree: Path) -> str:
    code = "import engined.core as c; print(c.build())"
    environ = {k: v for k, v in os.environ.items() if k != "ENGINED_PURE"}
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={**environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return run.stdout.strip()


def extension_modules(tree: Path) -> list[Path]:
    return sorted(tree.rglob(f"*{SUFFIX}"))


def test_a_pure_build_in_place_records_why_and_removes_stale_extensions(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path)
    for name in (*COMPILED_MODULES, core_build.GROUP_LIBRARY):
        tree.joinpath(*name.split(".")).with_suffix(SUFFIX).write_bytes(b"an earlier build")
    run = run_setup(tree, "build_ext", "--inplace", ENGINED_PURE="1")
    assert run.returncode == 0, run.stderr
    assert said(run) == [f"{SAID}ENGINED_PURE=1"]
    assert extension_modules(tree) == []
    assert record(tree) == {"core": "pure", "reason": "ENGINED_PURE=1"}
    assert which_core(tree) == "pure Python (built pure: ENGINED_PURE=1)"


def test_a_wheel_build_records_its_core_in_the_wheel_tree(tmp_path: Path) -> None:
    """`build` (what a wheel is made of) runs build_ext with nothing to compile, for the record."""
    tree = copy_tree(tmp_path)
    run = run_setup(tree, "build", ENGINED_MYPYC="0")
    assert run.returncode == 0, run.stderr
    assert said(run) == [f"{SAID}ENGINED_MYPYC=0"]
    assert record(tree / "build" / "lib") == {"core": "pure", "reason": "ENGINED_MYPYC=0"}
    assert not (tree / "engined" / "core" / core_build.RECORD).exists()


def test_without_a_c_compiler_the_core_stays_pure_whole(tmp_path: Path) -> None:
    """mypyc runs, the C compiler cannot: pure Python, said in one line, and no extension."""
    tree = copy_tree(tmp_path)
    compiler = shutil.which("false")
    assert compiler is not None
    run = run_setup(tree, "build_ext", "--inplace", CC=compiler)
    assert run.returncode == 0, run.stderr
    reason = f"compiling the core failed (command '{compiler}' failed with exit code 1)"
    assert said(run) == [f"{SAID}{reason}"]
    assert extension_modules(tree) == []
    assert record(tree) == {"core": "pure", "reason": reason}
    assert which_core(tree) == f"pure Python (built pure: {reason})"


def test_every_c_source_ships_as_package_data() -> None:
    """An install checks each compiled module against its source; setuptools ships `.py`
    files but a `.c` only as package data, so each C module must be listed there."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    c_modules = [n for n in COMPILED_MODULES if core_build.source_path(ROOT, n).suffix == ".c"]
    assert c_modules == ["engined.core._block_hash"]
    for name in c_modules:
        package, _, module = name.rpartition(".")
        assert f"{module}.c" in package_data[package], name
