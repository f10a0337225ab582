"""Which core runs (engined/core/core_build.py): the extension modules load only when the build
record vouches for the sources on disk; otherwise every compiled module comes from its source.

The unit tests lay out a small install in a temporary directory (sources, empty files named
as extension modules, a record). The import tests run Python over a copy of the real package
whose "extension modules" are garbage: importing any of them fails, so a run that imports
cleanly proves they were never loaded, and a run over a record that vouches for them proves
the check is what decided.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engined.core
from engined.core import COMPILED_MODULES, core_build
from engined.core.core_build import GROUP_LIBRARY, CoreBuild, inspect

MODULES = ("engined.core.alpha", "engined.core.beta", "engined.wire.gamma")
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
REBUILD = "pip install -e . rebuilds it"
ENGINED = Path(engined.core.__file__).resolve().parents[1]


def lay_out(root: Path, *, compiled: tuple[str, ...] = MODULES, group: bool = True) -> None:
    for name in MODULES:
        source = core_build.source_path(root, name)
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(f"NAME = {name!r}\n")
    for name in compiled:
        core_build.source_path(root, name).with_suffix(SUFFIX).write_bytes(b"")
    if group:
        (root / f"{GROUP_LIBRARY}{SUFFIX}").write_bytes(b"")


def record_compiled(root: Path) -> None:
    core_build.write_record(root / "engined" / "core", core_build.digests(root, MODULES), "")


def test_a_compiled_build_of_the_sources_on_disk_runs_compiled(tmp_path: Path) -> None:
    lay_out(tmp_path)
    record_compiled(tmp_path)
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(True)
    assert str(inspect(tmp_path, MODULES, {"ENGINED_PURE": "0"})) == "compiled (mypyc)"


def test_an_edited_source_makes_the_whole_core_pure(tmp_path: Path) -> None:
    lay_out(tmp_path)
    record_compiled(tmp_path)
    with core_build.source_path(tmp_path, "engined.core.beta").open("a") as source:
        source.write("EDITED = True\n")
    reason = f"engined/core/beta.py changed since the build; {REBUILD}"
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(False, reason, refused=True)
    core_build.source_path(tmp_path, "engined.wire.gamma").write_text("")
    reason = f"engined/core/beta.py and 1 more changed since the build; {REBUILD}"
    assert str(inspect(tmp_path, MODULES, {})) == f"pure Python ({reason})"


def test_a_module_written_in_c_is_vouched_for_by_its_c_source(tmp_path: Path) -> None:
    """A compiled module with no `.py` is C: the record holds its `.c` digest, an edit to it
    makes the whole core pure, and the pure core's finder refuses to import it at all (its
    importer falls back to Python) rather than load the stale extension."""
    lay_out(tmp_path)
    c_module = "engined.core.delta"
    c_source = tmp_path / "engined" / "core" / "delta.c"
    c_source.write_text("/* C */\n")
    c_source.with_suffix(SUFFIX).write_bytes(b"")
    modules = (*MODULES, c_module)
    assert core_build.source_path(tmp_path, c_module) == c_source
    core_build.write_record(
        tmp_path / "engined" / "core", core_build.digests(tmp_path, modules), ""
    )
    assert inspect(tmp_path, modules, {}) == CoreBuild(True)
    c_source.write_text("/* C, edited */\n")
    reason = f"engined/core/delta.c changed since the build; {REBUILD}"
    assert inspect(tmp_path, modules, {}) == CoreBuild(False, reason, refused=True)
    finder = core_build.SourceFinder(tmp_path, modules)
    with pytest.raises(ModuleNotFoundError, match=r"engined\.core\.delta has no Python source"):
        finder.find_spec(c_module, None)
    spec = finder.find_spec("engined.core.alpha", None)
    assert spec is not None and spec.origin == str(tmp_path / "engined" / "core" / "alpha.py")


def test_an_install_without_a_source_runs_pure_instead_of_failing(tmp_path: Path) -> None:
    """A wheel that left a compiled module's source out (a `.c` is not package data unless
    pyproject.toml says so): the core is pure and says why, `import engined` does not fail."""
    lay_out(tmp_path)
    record_compiled(tmp_path)
    core_build.source_path(tmp_path, "engined.core.beta").unlink()
    reason = f"no source for engined.core.beta; {REBUILD}"
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(False, reason, refused=True)


def test_a_partial_build_runs_pure(tmp_path: Path) -> None:
    lay_out(tmp_path, compiled=MODULES[:1])
    record_compiled(tmp_path)
    reason = f"partly compiled (no extension module for engined.core.beta and 1 more); {REBUILD}"
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(False, reason, refused=True)
    (tmp_path / "group").mkdir()
    lay_out(tmp_path / "group", group=False)
    record_compiled(tmp_path / "group")
    reason = f"partly compiled (no extension module for {GROUP_LIBRARY}); {REBUILD}"
    assert inspect(tmp_path / "group", MODULES, {}).reason == reason


def test_engined_pure_refuses_a_good_compiled_build(tmp_path: Path) -> None:
    lay_out(tmp_path)
    record_compiled(tmp_path)
    assert inspect(tmp_path, MODULES, {"ENGINED_PURE": "1"}) == CoreBuild(
        False, "ENGINED_PURE=1", refused=True
    )
    assert inspect(tmp_path, MODULES, {"ENGINED_PURE": "yes"}).reason == "ENGINED_PURE=yes"


def test_a_pure_build_says_why(tmp_path: Path) -> None:
    lay_out(tmp_path, compiled=(), group=False)
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(False, "")
    assert str(inspect(tmp_path, MODULES, {})) == "pure Python"
    assert inspect(tmp_path, MODULES, {"ENGINED_PURE": "1"}) == CoreBuild(False, "ENGINED_PURE=1")
    reason = "compiling the core failed (command 'gcc' failed: No such file or directory)"
    core_build.write_record(tmp_path / "engined" / "core", None, reason)
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(False, f"built pure: {reason}")
    record_compiled(tmp_path)
    assert inspect(tmp_path, MODULES, {}).reason == f"the compiled modules are missing; {REBUILD}"


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (None, "no readable build record"),
        (b"{not json", "no readable build record"),
        (b"\xff\xfe\x00", "no readable build record"),
        (b"[1, 2]", "no readable build record"),
        (b'{"core": "pure", "reason": "ENGINED_PURE=1"}', "the record of a pure build"),
        (b'{"core": "compiled", "sources": ["a"]}', "a malformed build record"),
        (b'{"core": "compiled"}', "a malformed build record"),
    ],
)
def test_extension_modules_without_a_record_that_vouches_for_them_run_pure(
    tmp_path: Path, record: bytes | None, why: str
) -> None:
    lay_out(tmp_path)
    if record is not None:
        (tmp_path / "engined" / "core" / core_build.RECORD).write_bytes(record)
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(
        False, f"extension modules but {why}; {REBUILD}", refused=True
    )


def test_a_huge_record_is_read_for_the_modules_it_names(tmp_path: Path) -> None:
    lay_out(tmp_path)
    sources = core_build.digests(tmp_path, MODULES)
    sources.update({f"engined.core.junk{n}": "0" * 64 for n in range(200_000)})
    core_build.write_record(tmp_path / "engined" / "core", sources, "")
    assert (tmp_path / "engined" / "core" / core_build.RECORD).stat().st_size > 10_000_000
    assert inspect(tmp_path, MODULES, {}) == CoreBuild(True)


def test_the_build_opt_outs() -> None:
    assert core_build.build_opt_out({}) is None
    assert core_build.build_opt_out({"ENGINED_MYPYC": "1"}) is None
    assert core_build.build_opt_out({"ENGINED_PURE": ""}) is None
    assert core_build.build_opt_out({"ENGINED_PURE": "1"}) == "ENGINED_PURE=1"
    assert core_build.build_opt_out({"ENGINED_PURE": "1", "ENGINED_MYPYC": "1"}) == (
        "ENGINED_PURE=1"
    )
    assert core_build.build_opt_out({"ENGINED_MYPYC": "0"}) == "ENGINED_MYPYC=0"
    assert core_build.pure_requested({"ENGINED_MYPYC": "0"}) is None


# --- importing a copy of the real package over garbage extension modules ----------------------


def garbage_build(root: Path) -> None:
    """A copy of the package's sources, a garbage extension module for every compiled module
    and the group library, and a record of a compiled build of those sources."""
    shutil.copytree(
        ENGINED, root / "engined", ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__")
    )
    (root / "engined" / "core" / core_build.RECORD).unlink(missing_ok=True)
    for name in (*COMPILED_MODULES, GROUP_LIBRARY):
        root.joinpath(*name.split(".")).with_suffix(SUFFIX).write_bytes(b"not a shared object")
    core_build.write_record(
        root / "engined" / "core", core_build.digests(root, COMPILED_MODULES), ""
    )


def import_core(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import engined.core as c, engined.core.engine as e, engined.wire.convert as w\n"
        "print(c.build()); print(e.__file__); print(w.__file__); print(c.compiled_modules())"
    )
    environ = {k: v for k, v in os.environ.items() if k != "ENGINED_PURE"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env={**environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_edited_source_runs_instead_of_its_stale_extension(tmp_path: Path) -> None:
    garbage_build(tmp_path)
    engine = tmp_path / "engined" / "core" / "engine.py"
    engine.write_text(engine.read_text() + "\nEDITED = True\n")
    run = import_core(tmp_path)
    assert run.returncode == 0, run.stderr
    reason = f"engined/core/engine.py changed since the build; {REBUILD}"
    assert run.stdout.splitlines() == [
        f"pure Python ({reason})",
        str(engine),
        str(tmp_path / "engined" / "wire" / "convert.py"),
        "()",
    ]


def test_engined_pure_runs_the_sources_over_a_vouched_build(tmp_path: Path) -> None:
    garbage_build(tmp_path)
    run = import_core(tmp_path, ENGINED_PURE="1")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "pure Python (ENGINED_PURE=1)"
    assert run.stdout.splitlines()[3] == "()"


def test_a_vouched_build_loads_its_extension_modules(tmp_path: Path) -> None:
    """The counterpart of the two above: the same tree, unedited, imports the extensions
    (which, being garbage, fail to load)."""
    garbage_build(tmp_path)
    run = import_core(tmp_path)
    assert run.returncode == 1
    assert "ImportError" in run.stderr
    assert f"{SUFFIX}" in run.stderr
