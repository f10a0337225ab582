"""The build: pure Python, or with `ENGINED_MYPYC=1` the hot core compiled by mypyc.

`ENGINED_MYPYC=1 pip install .` (or `-e .`) compiles `engined.core.COMPILED_MODULES` into
extension modules beside their unchanged sources (black's way of shipping typed Python).
Pip's isolated build environment gets mypy, msgspec and xxhash for it (mypyc type-checks
the modules it compiles). Without mypyc (`--no-build-isolation` in a venv lacking mypy), or
when mypy or the C compiler fails, the build warns in one line and stays pure Python;
`engined --version` says which core is installed. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# What mypyc needs in the build environment: itself, and the core's typed imports.
MYPYC_REQUIRES = ["mypy>=1.8", "msgspec>=0.18", "xxhash>=3"]


def warn(reason: str) -> None:
    print(f"warning: engined: {reason}; building the pure-Python core", file=sys.stderr)


def compiled_module_paths() -> list[str]:
    """The files of `COMPILED_MODULES`, read from engined/core/__init__.py without importing it."""
    tree = ast.parse((ROOT / "engined" / "core" / "__init__.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "COMPILED_MODULES"
            and node.value is not None
        ):
            names: tuple[str, ...] = ast.literal_eval(node.value)
            return [name.replace(".", "/") + ".py" for name in names]
    raise RuntimeError("engined/core/__init__.py defines no COMPILED_MODULES")


class OptionalBuildExt(build_ext):
    """build_ext that falls back to pure Python, whole, when the C compiler fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # any compiler failure (none installed, ...): pure Python
            for output in self.get_outputs():  # never a partly compiled core
                Path(output).unlink(missing_ok=True)
            warn(f"compiling the core failed ({error})")


def mypyc_extensions() -> tuple[list[Extension], list[str]]:
    """The extension modules to build and the build requirements to ask for first."""
    if os.environ.get("ENGINED_MYPYC", "0") in ("", "0"):
        return [], []
    try:
        from mypyc.build import mypycify
    except ImportError:
        # setuptools asks for build requirements by running `setup.py egg_info` first
        # (get_requires_for_build_*): ask for mypy then; pip installs it and builds again.
        if "egg_info" in sys.argv[1:]:
            return [], MYPYC_REQUIRES
        warn("ENGINED_MYPYC=1 but mypyc is not installed (pip install mypy)")
        return [], []
    if "egg_info" in sys.argv[1:] or "dist_info" in sys.argv[1:]:
        return [], []  # metadata only: nothing to compile yet
    cwd = Path.cwd()
    os.chdir(ROOT)  # mypyc reads [tool.mypy] of pyproject.toml and writes build/ here
    try:
        extensions: list[Extension] = mypycify(
            compiled_module_paths(), opt_level="3", group_name="engined_core"
        )
    except (Exception, SystemExit) as error:  # mypy errors exit: stay pure Python instead
        warn(f"mypyc failed ({error})")
        return [], []
    finally:
        os.chdir(cwd)
    return extensions, []


ext_modules, setup_requires = mypyc_extensions()
options: dict[str, Any] = {"ext_modules": ext_modules, "cmdclass": {"build_ext": OptionalBuildExt}}
if setup_requires:
    options["setup_requires"] = setup_requires
setup(**options)
