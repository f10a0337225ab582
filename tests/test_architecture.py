"""The shape of the code: the import graph of `engined/`, the purity of the core, module sizes.

The graph counts every import of an `engined` module wherever it is written: at module level,
inside functions, and under `if TYPE_CHECKING:` (a cycle there is still a cycle for a
reader). Packages are layered:

    core < wire < server < cli        core < config < client < tools < cli
    wire < client, config < server    client < dynamo < cli (dynamo may use tools)
    client < openai (the OpenAI API server: a control client; nothing below imports it)

A module may import its own package and the packages below it, never one above or beside
it (inside `engined/server/`, the same holds for its sub-packages, `SERVER_LAYERS`);
`engined` itself imports the core, to check its build first. Beside the layers sit the
neutral modules (`NEUTRAL`: the ZeroMQ socket factory and its `ipc://` path checks, the
logging set-up, the reading of a model directory and the made-up logprob values that the
Dynamo worker and the API server share, the map between modelled and wall time, the
event loop every process runs on, and the admission counters the daemon shares with its API
server processes), plumbing
that every layer above the core may import and that imports no `engined` module but another
neutral one; the core may not (it does no I/O). There is no allow-list: every upward import
and every cycle fails.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "engined"

# Top-level modules every layer above the core may import; they import no `engined` module.
NEUTRAL = frozenset(
    {
        "engined.zmq_sockets",
        "engined.ipc_paths",
        "engined.logs",
        "engined.model_dir",
        "engined.logprob_values",
        "engined.model_clock",
        "engined.event_loop",
        "engined.admission_counters",
    }
)

# Package -> the packages its modules may import (besides its own).
MAY_IMPORT: dict[str, frozenset[str]] = {
    # `engined` itself: the core's build check, which must run before any compiled module.
    "engined": frozenset({"core"}),
    "neutral": frozenset(),
    "core": frozenset(),
    "wire": frozenset({"neutral", "core"}),
    "config": frozenset({"neutral", "core"}),
    "server": frozenset({"engined", "neutral", "core", "wire", "config"}),
    "client": frozenset({"engined", "neutral", "core", "wire", "config"}),
    "tools": frozenset({"engined", "neutral", "core", "wire", "config", "client"}),
    "dynamo": frozenset({"engined", "neutral", "core", "wire", "config", "client", "tools"}),
    "openai": frozenset({"engined", "neutral", "core", "wire", "config", "client"}),
    "cli": frozenset(
        {
            "engined",
            "neutral",
            "core",
            "wire",
            "config",
            "server",
            "client",
            "tools",
            "dynamo",
            "openai",
        }
    ),
}

# engined/server/'s sub-packages, lowest first: a module may import its own sub-package and
# those before it. The modules directly in engined/server/ (the daemon and what it assembles)
# may import every sub-package and are imported by none.
SERVER_LAYERS = ("security", "publish", "ranks", "ops", "control")

# What the core may not import: clocks, I/O, randomness outside its seeded RNGs, the shell.
BANNED_IN_CORE = ("time", "asyncio", "zmq", "os", "socket", "uuid", "threading", "subprocess")
MAX_MODULE_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imported_names(path: Path) -> list[str]:
    """Every module name an import statement of `path` names (`from a import b`: a.b and a)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
            names.append(node.module)
    return names


def resolve(name: str) -> str | None:
    """The `engined` module an imported name lives in (the longest matching module)."""
    known = modules()
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.cache
def graph() -> dict[str, frozenset[str]]:
    edges: dict[str, frozenset[str]] = {}
    for module, path in modules().items():
        targets = {resolve(name) for name in imported_names(path) if name.startswith("engined")}
        edges[module] = frozenset(t for t in targets if t is not None and t != module)
    return edges


def package(module: str) -> str:
    if module in NEUTRAL:
        return "neutral"
    if module == "engined.__main__":
        return "cli"  # `python -m engined`: the entry point, beside engined.cli
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "engined"


def cycles() -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for module in sorted(edges):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_graph_sees_every_module() -> None:
    assert "engined.core.engine" in graph()
    assert "engined.core.scheduling" in graph()["engined.core.assembly"]
    assert package("engined.cli") == "cli"
    assert package("engined") == "engined"


def test_no_import_cycle() -> None:
    assert cycles() == set(), "import cycles (TYPE_CHECKING imports count)"


def test_no_upward_import() -> None:
    upward = {
        (module, target)
        for module, targets in graph().items()
        for target in targets
        if package(target) != package(module) and package(target) not in MAY_IMPORT[package(module)]
    }
    assert upward == set(), "imports of a package above or beside"


def server_layer(module: str) -> int | None:
    """The index in `SERVER_LAYERS` of a server module's sub-package; `len` for the top."""
    parts = module.split(".")
    if parts[:2] != ["engined", "server"] or len(parts) < 3:
        return None
    if len(parts) == 3 and parts[2] not in SERVER_LAYERS:
        return len(SERVER_LAYERS)
    return SERVER_LAYERS.index(parts[2])


def test_server_sub_packages_are_layered() -> None:
    assert {p.name for p in (ROOT / "server").iterdir() if (p / "__init__.py").exists()} == set(
        SERVER_LAYERS
    ), "every sub-package of engined/server/ has its place in SERVER_LAYERS"
    assert server_layer("engined.server.daemon") == len(SERVER_LAYERS)
    assert server_layer("engined.server.ranks.engine_loop") == SERVER_LAYERS.index("ranks")
    upward = {
        (module, target)
        for module, targets in graph().items()
        for target in targets
        if (layer := server_layer(module)) is not None
        and (target_layer := server_layer(target)) is not None
        and target_layer > layer
    }
    assert upward == set(), "server sub-package imports of one above it"


def test_the_neutral_modules_exist() -> None:
    """`NEUTRAL` names real modules, each its own package (a typo would exempt nothing)."""
    assert graph().keys() >= NEUTRAL
    assert "engined.zmq_sockets" in graph()["engined.client.dealer_connection"]


def test_the_core_is_pure() -> None:
    """No clock, I/O, uuid or shell in engined/core: time is the caller's `now_ms`."""
    for module, path in modules().items():
        if package(module) != "core":
            continue
        for name in imported_names(path):
            top = name.split(".")[0]
            assert top not in BANNED_IN_CORE, f"{module} imports {name}"
            if top == "engined":
                assert name.startswith("engined.core"), f"{module} imports {name}"


def test_modules_stay_small() -> None:
    """Issue 23: no module, core included, is over 400 lines; past that it holds more than
    one concern, and the split says which."""
    too_long = {
        module: lines
        for module, path in modules().items()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert too_long == {}


def test_module_basenames_are_unique() -> None:
    """Issue 23: a module's file name alone says which module it is (in a traceback, a
    profile, a grep), so no two modules under engined/ share one; a package's `__init__.py`
    and `__main__.py` are named by their package."""
    by_name: dict[str, list[str]] = {}
    for module, path in modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(module)
    assert {name: found for name, found in by_name.items() if len(found) > 1} == {}
