"""The abort parity scenarios: clients that go away (vLLM's `EngineCore.abort_requests`,
engined's `Cancel`) while others carry on.

An abort frees the request's blocks wherever it is (waiting, mid-prefill, decoding,
preempted, with drafts in flight, in a batch not yet resolved under async scheduling), so
what later evictions take, which block a twin prompt hits and what the next admissions fit
all depend on freeing as vLLM frees: the random mixes abort a third of their requests at a
random step after their arrival, some of them already finished (a no-op on both sides).
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from parity.random_mix import random_mix, random_tokens
from parity.scenario import Config, Control, Scenario, ScenarioRequest, asynchronous


def with_aborts(scenario: Scenario, seed: int, *, share: float = 1 / 3) -> Scenario:
    """`scenario` with `share` of its requests aborted 1-120 steps after they arrive (from
    their own `random.Random(seed)`, so the requests themselves are unchanged)."""
    rng = random.Random(seed)
    by_step: dict[int, list[str]] = {}
    for request in scenario.requests:
        if rng.random() < share:
            by_step.setdefault(request.arrival + rng.randrange(1, 121), []).append(request.id)
    controls = [
        Control(step=step, kind="abort", request_ids=ids) for step, ids in sorted(by_step.items())
    ]
    aborted = sum(len(ids) for ids in by_step.values())
    return msgspec.structs.replace(
        scenario,
        name=scenario.name + "-aborts",
        description=f"{scenario.description}; {aborted} aborted",
        controls=sorted([*scenario.controls, *controls], key=lambda c: c.step),
    )


def abort_shared_prefix() -> Scenario:
    """Eight requests over one 64-token prefix, chunked at 32 in 16 blocks. In engined's
    schedule (the trace shows it; vLLM's is the same): `a0` is aborted mid-prefill, `a2`
    mid-prefill and `a1` decoding at once (their private blocks freed in that order: the
    reverse frees them otherwise), `a5` once preempted and then again, `a4` decoding beside
    others that hold its prefix blocks, `a7` mid-prefill, `again0` finished, `again3`
    queued, and `nobody` never known. The first four prompts, sent again, hit what the
    aborts left cached, and the pool runs short enough to evict blocks they freed."""
    rng = random.Random(40)
    prefix = random_tokens(rng, 64)
    requests = [
        ScenarioRequest(
            id=f"a{i}", arrival=i, prompt=prefix + random_tokens(rng, 40), max_tokens=24
        )
        for i in range(8)
    ]
    requests += [
        ScenarioRequest(id=f"again{i}", arrival=30 + 2 * i, prompt=r.prompt, max_tokens=8)
        for i, r in enumerate(requests[:4])
    ]
    controls = [
        Control(step=2, kind="abort", request_ids=["a0"]),
        Control(step=4, kind="abort", request_ids=["a2", "a1"]),
        Control(step=20, kind="abort", request_ids=["a5", "nobody"]),
        Control(step=22, kind="abort", request_ids=["a4", "a5"]),
        Control(step=23, kind="abort", request_ids=["a7"]),
        Control(step=40, kind="abort", request_ids=["again0", "again3"]),
    ]
    return Scenario(
        name="abort-shared-prefix",
        description="8 requests over one 64-token prefix, chunked at 32 in 16 blocks: aborts "
        "mid-prefill, queued, decoding with shared blocks, twice, finished, unknown; "
        "4 prompts sent again",
        config=Config(num_gpu_blocks=16, max_num_batched_tokens=32, max_num_seqs=6),
        requests=requests,
        controls=controls,
    )


def _aborted_mix(seed: int, **settings: Any) -> Scenario:
    """A random mix of longer requests under a lighter load (arrivals over 400 steps, up
    to 160 tokens out), so that an abort finds many of them running, with aborts seeded
    `seed + 100`."""
    return with_aborts(random_mix(seed, spread=400, max_out=160, **settings), seed + 100)


def abort_scenarios() -> list[Scenario]:
    """Aborts synchronous, under async scheduling, with MTP, both, and prefix caching off."""
    shared = abort_shared_prefix()
    mixes = [
        _aborted_mix(30, num_blocks=192, budget=256),
        _aborted_mix(31, num_blocks=96, budget=128, block_size=32),
        _aborted_mix(32, num_blocks=160, budget=256, policy="priority"),
        _aborted_mix(33, num_blocks=192, budget=192, caching=False),
        _aborted_mix(34, num_blocks=160, budget=128, mtp=2),
        _aborted_mix(35, num_blocks=192, budget=256, adapters=3, max_loras=2),
    ]
    return [
        shared,
        *mixes,
        asynchronous(shared),
        asynchronous(mixes[0]),
        asynchronous(mixes[2]),
        asynchronous(mixes[4]),
    ]
