"""The scheduler core: pure, deterministic, typed Python, compiled with mypyc where it can be.

The Python source is the source of truth (one module is C: `_block_hash`, vLLM's default block
hash, an accelerator of `vllm_hashing` held to it by tests; the pure core runs without it).
`pip install .` (or `-e .`) compiles the
modules of `COMPILED_MODULES` (setup.py reads this tuple) into extension modules beside their
sources, unless `ENGINED_PURE=1` or the build cannot. Python would import those in preference
to the sources, so `engined`, when imported, first has `core_build.activate` decide: the
extensions load only if the build record vouches for the sources on disk. `build()` says
which core runs, and why the pure one. The rest stay interpreted: msgspec Structs (`types`,
`views`, `args`) gain nothing from mypyc, and its compiled annotations break
`msgspec.convert` of `args`.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util

from engined.core import core_build
from engined.core.core_build import CoreBuild

# Every module the hot path runs, by measurement (benchmarks/core_throughput.py --profile).
COMPILED_MODULES: tuple[str, ...] = (
    "engined.core.assembly",
    "engined.core.block_moves",
    "engined.core.burst_emission",
    "engined.core.capacity",
    "engined.core.commands",
    "engined.core.emission",
    "engined.core.engine",
    "engined.core.finish",
    "engined.core.fpm",
    "engined.core.handoff_book",
    "engined.core.hashing",
    "engined.core.intake",
    "engined.core.kv_event_log",
    "engined.core.kv_manager",
    "engined.core.kv_registry",
    "engined.core.lineage_pool",
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
    "engined.core.stops",
    "engined.core.token_stream",
    "engined.core.vllm_hashing",
    "engined.core.paged.admission",
    "engined.core.paged.async_batches",
    "engined.core.paged.block_pool",
    "engined.core.paged.kv_cache_manager",
    "engined.core.paged.pass_limits",
    "engined.core.paged.residency",
    "engined.core.paged.scheduler",
    "engined.core.paged.spec_decode",
    "engined.core.offload.g1_glue",
    "engined.core.offload.lanes",
    "engined.core.offload.link",
    "engined.core.offload.parking",
    "engined.core.offload.pipeline",
    "engined.core.offload.tier",
    "engined.core.offload.tier_engine",
    "engined.core.offload.tier_onboard",
    "engined.core.offload.tier_values",
    # The daemon's per-token conversions: a pass's outputs routed as `output` messages
    # written as bytes (`OutputWriter`), and its KV events as bytes.
    "engined.wire.convert",
    "engined.wire.kv_event_bytes",
    "engined.wire.output_bytes",
    # C (engined/core/_block_hash.c): vLLM's sha256 block hash, a tenth of a token's work.
    "engined.core._block_hash",
)


def running() -> CoreBuild:
    """The core this process runs, as decided when it first imported `engined`."""
    return core_build.running()


def compiled_modules() -> tuple[str, ...]:
    """The modules of `COMPILED_MODULES` that import from an extension module (a `.so`)."""
    found: list[str] = []
    for name in COMPILED_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:  # a C module, which the pure core runs without
            continue
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            found.append(name)
    return tuple(found)


def compiled() -> bool:
    """Whether the whole of `COMPILED_MODULES` runs compiled."""
    return len(compiled_modules()) == len(COMPILED_MODULES)


def build() -> str:
    """Which core runs: "compiled (mypyc)", or "pure Python" and why (`CoreBuild.reason`)."""
    return str(core_build.running())
