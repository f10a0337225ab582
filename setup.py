"""The build: the hot core compiled by mypyc by default, pure Python where it cannot be.

`pip install .` (or `-e .`) compiles `engined.core.COMPILED_MODULES` into extension modules
beside their unchanged sources (black's way of shipping typed Python; the few written in C,
`.c` sources with no `.py`, are plain C extensions); pyproject.toml's
[build-system] brings mypy, msgspec and xxhash into pip's build environment (mypyc
type-checks the modules it compiles). `ENGINED_PURE=1` (or `ENGINED_MYPYC=0`) opts out;
`ENGINED_MYPYC=1`, the old opt-in, asks for the default. Where the build cannot compile (not
CPython, no mypyc in a `--no-build-isolation` venv, a mypy error, no C compiler) it installs
the pure core and says why in one line (pip shows it with `-v`). Either way build_ext writes
the build record (engined/core/core_build.py), which `engined --version`, the daemon's
start-up log and /metrics read. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def load_core_build() -> ModuleType:
    """engined/core/core_build.py by path: the record's one definition, without `engined`."""
    spec = importlib.util.spec_from_file_location(
        "engined_core_build", ROOT / "engined" / "core" / "core_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


core_build = load_core_build()


def one_line(text: str) -> str:
    return " ".join(text.split())


def say_pure(reason: str) -> None:
    print(f"engined: building the pure-Python core: {reason}", file=sys.stderr)


def compiled_module_names() -> tuple[str, ...]:
    """`COMPILED_MODULES`, read from engined/core/__init__.py without importing it."""
    tree = ast.parse((ROOT / "engined" / "core" / "__init__.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "COMPILED_MODULES"
            and node.value is not None
        ):
            names: tuple[str, ...] = ast.literal_eval(node.value)
            return names
    raise RuntimeError("engined/core/__init__.py defines no COMPILED_MODULES")


class RecordingBuildExt(build_ext):
    """build_ext that records which core it built, and falls back to pure Python, whole,
    when the C compiler fails."""

    pure_reason = ""  # why there is nothing to compile (set below)
    sources: dict[str, str] = {}  # the digests of what mypyc compiled

    def run(self) -> None:
        reason = self.pure_reason
        inplace = self.inplace  # setuptools clears it while compiling, and a failure keeps it so
        if self.extensions:
            try:
                super().run()
            except Exception as error:  # any compiler failure (none installed, ...)
                for output in self.get_outputs():  # never a partly compiled core
                    Path(output).unlink(missing_ok=True)
                reason = one_line(f"compiling the core failed ({error})")
        if reason:
            say_pure(reason)
        targets = [Path(self.build_lib) / "engined" / "core"]
        if inplace:
            targets.append(ROOT / "engined" / "core")
            if reason:  # what an earlier build left beside the sources would shadow them
                for name in (*compiled_module_names(), core_build.GROUP_LIBRARY):
                    for path in core_build.extension_paths(ROOT, name):
                        path.unlink()
        for target in targets:
            core_build.write_record(target, None if reason else self.sources, reason)


class RecordingBuild(build):
    """build that runs build_ext even with nothing to compile: it writes the record."""

    sub_commands = [
        (name, (lambda _command: True) if name == "build_ext" else test)
        for name, test in build.sub_commands
    ]


def mypyc_extensions() -> tuple[list[Extension], str]:
    """The extension modules to build, or none and why the core stays pure."""
    if opt_out := core_build.build_opt_out(os.environ):
        return [], opt_out
    if sys.implementation.name != "cpython":
        return [], f"mypyc compiles for CPython only, not {sys.implementation.name}"
    try:
        from mypyc.build import mypycify
    except ImportError:
        return [], "mypyc is not installed (a build without isolation: pip install mypy)"
    if "egg_info" in sys.argv[1:] or "dist_info" in sys.argv[1:]:
        return [], ""  # metadata only: nothing is compiled or recorded
    names = compiled_module_names()
    cwd = Path.cwd()
    os.chdir(ROOT)  # mypyc reads [tool.mypy] of pyproject.toml and writes build/ here
    try:
        RecordingBuildExt.sources = core_build.digests(ROOT, names)
        sources = {name: core_build.source_path(Path(), name) for name in names}
        python = [str(path) for path in sources.values() if path.suffix == ".py"]
        extensions: list[Extension] = mypycify(python, opt_level="3", group_name="engined_core")
        # The modules written in C build beside them, and fall back with them.
        extensions += [
            Extension(name, [str(path)]) for name, path in sources.items() if path.suffix == ".c"
        ]
    except (Exception, SystemExit) as error:  # mypy errors exit: stay pure Python instead
        return [], one_line(f"mypyc failed ({error})")
    finally:
        os.chdir(cwd)
    return extensions, ""


# setuptools runs this file as __main__ (`python setup.py` and PEP 517 builds alike); the tests
# import it to call the functions above.
if __name__ == "__main__":
    ext_modules, RecordingBuildExt.pure_reason = mypyc_extensions()
    options: dict[str, Any] = {
        "ext_modules": ext_modules,
        "cmdclass": {"build": RecordingBuild, "build_ext": RecordingBuildExt},
    }
    setup(**options)
