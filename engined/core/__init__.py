"""The scheduler core: pure, deterministic, typed Python, optionally compiled with mypyc.

The Python source is the only source of truth. `ENGINED_MYPYC=1 pip install .` (or `-e .`)
compiles the modules of `COMPILED_MODULES` (setup.py reads this tuple) into extension
modules beside their sources, which Python imports in preference to them; `build()` says
which of the two runs. The rest stay interpreted: msgspec Structs (`types`, `views`, `args`)
gain nothing from mypyc, and its compiled annotations break `msgspec.convert` of `args`.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util

# Every module the hot path runs, by measurement (benchmarks/core_throughput.py --profile).
COMPILED_MODULES: tuple[str, ...] = (
    "engined.core.assembly",
    "engined.core.block_pool",
    "engined.core.capacity",
    "engined.core.commands",
    "engined.core.emission",
    "engined.core.engine",
    "engined.core.finish",
    "engined.core.fpm",
    "engined.core.handoff",
    "engined.core.hashing",
    "engined.core.intake",
    "engined.core.kv_event_log",
    "engined.core.kv_manager",
    "engined.core.kv_registry",
    "engined.core.pass_context",
    "engined.core.perf_model",
    "engined.core.policy",
    "engined.core.preemption",
    "engined.core.prefix_hit",
    "engined.core.queued",
    "engined.core.scheduling",
    "engined.core.sequence",
    "engined.core.speculative",
    "engined.core.state",
    "engined.core.paged.block_pool",
    "engined.core.paged.kv_cache_manager",
    "engined.core.paged.scheduler",
    "engined.core.offload.g1_glue",
    "engined.core.offload.lanes",
    "engined.core.offload.link",
    "engined.core.offload.parking",
    "engined.core.offload.pipeline",
    "engined.core.offload.tier",
    "engined.core.offload.tier_engine",
    "engined.core.offload.tier_onboard",
    "engined.core.offload.types",
    # The daemon's per-token conversion of a pass's outputs (`route_outputs`).
    "engined.wire.convert",
)


def compiled_modules() -> tuple[str, ...]:
    """The modules of `COMPILED_MODULES` that import from an extension module (a `.so`)."""
    found: list[str] = []
    for name in COMPILED_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            found.append(name)
    return tuple(found)


def compiled() -> bool:
    """Whether the whole of `COMPILED_MODULES` runs compiled."""
    return len(compiled_modules()) == len(COMPILED_MODULES)


def build() -> str:
    """Which core runs: "compiled (mypyc)", "pure Python", or a partial build, named."""
    count = len(compiled_modules())
    if count == len(COMPILED_MODULES):
        return "compiled (mypyc)"
    if count == 0:
        return "pure Python"
    return f"partly compiled ({count} of {len(COMPILED_MODULES)} modules; rebuild or remove)"
