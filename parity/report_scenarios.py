"""The parity scenarios of vLLM's `kv_cache_report_mode: "full"`: requests whose prefix hits
are published again (`KVCacheManager.get_computed_blocks` -> `emit_cached_block_events`), so
a router mirroring the cache from events learns of blocks it dropped or never saw.

The hit's event comes where vLLM looks the hit up, before the admission allocates, evicts
and stores; an admission that fails for room looks it up, and publishes it, again.
"""

from __future__ import annotations

import random

import msgspec

from parity.random_mix import random_mix
from parity.scenario import Scenario, asynchronous


def with_full_reports(scenario: Scenario, seed: int, *, share: float = 1.0) -> Scenario:
    """`scenario` with `share` of its requests (drawn from their own `random.Random(seed)`)
    in `kv_cache_report_mode` "full" (`-full`)."""
    rng = random.Random(seed)
    requests = [
        msgspec.structs.replace(r, kv_cache_report_mode="full") if rng.random() < share else r
        for r in scenario.requests
    ]
    reporting = sum(r.kv_cache_report_mode == "full" for r in requests)
    return msgspec.structs.replace(
        scenario,
        name=scenario.name + "-full",
        description=f"{scenario.description}; {reporting} reporting hits in full",
        requests=requests,
    )


def report_scenarios(hand_made: list[Scenario]) -> list[Scenario]:
    """`hand_made` with every request reporting in full, random mixes with half of them,
    and some of both under async scheduling."""
    full = [with_full_reports(s, 140 + i) for i, s in enumerate(hand_made)]
    mixes = [
        with_full_reports(random_mix(40, num_blocks=64, budget=256), 150, share=0.5),
        with_full_reports(random_mix(41, num_blocks=96, budget=128, salted=True), 151, share=0.5),
        with_full_reports(random_mix(42, num_blocks=64, budget=256, mtp=2), 152, share=0.5),
        with_full_reports(
            random_mix(43, num_blocks=96, budget=256, adapters=3, max_loras=2, prefill_interval=3),
            153,
            share=0.5,
        ),
    ]
    return [*full, *mixes, *(asynchronous(s) for s in (full[0], mixes[0], mixes[2]))]
