"""The MTP parity scenarios: vLLM's speculative decoding (`--speculative-config` method
`mtp`) against engined's `--nextn` (engined/core/paged/spec_decode.py), with prefix caching
(vLLM's lookahead block hashes) and without.

engined draws how many drafts each step accepts; vLLM's model output accepts as many
(`VllmJob.bursts`), so what is compared is everything the scheduler decides around them:
drafts scheduled within the budget and `max_model_len`, lookahead slots and the
preemptions they cause, rejected drafts rolled back, admissions padded to the decode shape.
"""

from __future__ import annotations

import random

import msgspec

from parity.random_mix import random_mix, random_tokens
from parity.scenario import Config, Scenario, ScenarioRequest, asynchronous


def with_mtp(scenario: Scenario, num_spec: int, *, caching: bool = True) -> Scenario:
    """`scenario` with MTP drafting `num_spec` tokens a step (`caching` False: prefix
    caching off)."""
    caching = caching and scenario.config.enable_prefix_caching
    return msgspec.structs.replace(
        scenario,
        name=f"{scenario.name}-mtp{num_spec}" + ("" if caching else "-nocache"),
        description=f"{scenario.description}; MTP {num_spec}"
        + ("" if caching else ", prefix caching off"),
        config=msgspec.structs.replace(
            scenario.config, num_speculative_tokens=num_spec, enable_prefix_caching=caching
        ),
    )


def with_draft_model(scenario: Scenario) -> Scenario:
    """An MTP scenario under vLLM's `draft_model` method (`-mtpN` becomes `-draftN`): the
    same drafts and lookahead slots, plain block hashes."""
    num_spec = scenario.config.num_speculative_tokens
    return msgspec.structs.replace(
        scenario,
        name=scenario.name.replace(f"-mtp{num_spec}", f"-draft{num_spec}"),
        description=scenario.description.replace(
            f"MTP {num_spec}", f"draft model, {num_spec} drafts"
        ),
        config=msgspec.structs.replace(scenario.config, speculative_method="draft_model"),
    )


def with_block_drop(scenario: Scenario) -> Scenario:
    """An MTP scenario with vLLM's `disable_lookahead_block_hashes` (`-mtpN` becomes
    `-mtpN-blockdrop`): plain hashes, and a prefix hit drops its last block."""
    return msgspec.structs.replace(
        scenario,
        name=scenario.name + "-blockdrop",
        description=scenario.description + ", plain hashes and the trailing-block drop",
        config=msgspec.structs.replace(scenario.config, disable_lookahead_block_hashes=True),
    )


def one_token_prompts(*, caching: bool = True) -> Scenario:
    """Prompts left one token to compute while others decode: one-token prompts, and, with
    caching, prompts whose cached blocks leave one (a block and one token, sent twice). vLLM
    pads each such admission to the uniform decode shape (1 + drafts, placeholders never
    accepted)."""
    rng = random.Random(21)
    requests = [
        ScenarioRequest(id=f"d{i}", arrival=0, prompt=random_tokens(rng, 40), max_tokens=24)
        for i in range(3)
    ]
    requests += [
        ScenarioRequest(id=f"o{i}", arrival=2 + 3 * i, prompt=random_tokens(rng, 1), max_tokens=9)
        for i in range(5)
    ]
    repeated = random_tokens(rng, 17)
    requests += [
        ScenarioRequest(id=f"h{i}", arrival=3 + 4 * i, prompt=list(repeated), max_tokens=7)
        for i in range(3)
    ]
    requests.sort(key=lambda r: r.arrival)
    return Scenario(
        name="one-token-prompts-mtp2" + ("" if caching else "-nocache"),
        description="prompts left one token to compute, admitted while 3 requests decode; "
        "MTP 2" + ("" if caching else ", prefix caching off"),
        config=Config(
            num_gpu_blocks=64,
            max_num_batched_tokens=128,
            max_num_seqs=16,
            enable_prefix_caching=caching,
            num_speculative_tokens=2,
        ),
        requests=requests,
    )


def draft_budget() -> Scenario:
    """A budget of 20 for 8 decoding requests: the drafts of the later ones are cut."""
    rng = random.Random(22)
    return Scenario(
        name="draft-budget-mtp3",
        description="8 requests decoding under a budget of 20: drafts cut by the budget; MTP 3",
        config=Config(
            num_gpu_blocks=96,
            max_num_batched_tokens=20,
            max_num_seqs=16,
            num_speculative_tokens=3,
        ),
        requests=[
            ScenarioRequest(id=f"b{i}", arrival=i, prompt=random_tokens(rng, 18), max_tokens=40)
            for i in range(8)
        ],
    )


# The MTP scenarios run again under vLLM's AsyncScheduler (`-async`).
_ASYNC = (
    "chunked-300-mtp2",
    "pressure-mtp2",
    "stop-min-tokens-pressure-mtp2",
    "cache-salt-shared-prefix-mtp2",
    "one-token-prompts-mtp2",
    "draft-budget-mtp3",
    "random-s21-b64-t128-bs16-mtp2",
    "random-s23-b64-t64-bs16-nocache-mtp2",
    "random-s25-b64-t256-bs16-priority-mtp2",
)


# The MTP scenarios run again under vLLM's `draft_model` method (`-draftN`) and with its
# `disable_lookahead_block_hashes` (`-blockdrop`), the first two of each also asynchronously.
_DRAFT_MODEL = (
    "pressure-mtp2",
    "random-s21-b64-t128-bs16-mtp2",
    "repeated-prompts-mtp2",
    "cache-salt-shared-prefix-mtp2",
    "one-token-prompts-mtp2",
    "random-s22-b48-t512-bs32-mtp3",
)


def mtp_scenarios(plain: list[tuple[Scenario, int, bool]]) -> list[Scenario]:
    """The MTP scenarios: each of `plain` with its number of drafts and prefix caching,
    then MTP's own, then some of them under async scheduling, then some under vLLM's
    `draft_model` method."""
    synchronous = _synchronous(plain)
    drafted = [with_draft_model(s) for s in synchronous if s.name in _DRAFT_MODEL]
    dropping = [with_block_drop(s) for s in synchronous if s.name in _DRAFT_MODEL]
    return (
        synchronous
        + [asynchronous(s) for s in synchronous if s.name in _ASYNC]
        + drafted
        + [asynchronous(s) for s in drafted[:2]]
        + dropping
        + [asynchronous(s) for s in dropping[:2]]
    )


def _synchronous(plain: list[tuple[Scenario, int, bool]]) -> list[Scenario]:
    return [
        *(with_mtp(scenario, num_spec, caching=on) for scenario, num_spec, on in plain),
        one_token_prompts(),
        one_token_prompts(caching=False),
        draft_budget(),
        random_mix(20, num_blocks=80, budget=256, mtp=1),
        random_mix(21, num_blocks=64, budget=128, mtp=2),
        random_mix(22, num_blocks=48, budget=512, block_size=32, mtp=3),
        random_mix(23, num_blocks=64, budget=64, max_num_seqs=16, caching=False, mtp=2),
        random_mix(24, num_blocks=96, budget=256, caching=False, mtp=1),
        random_mix(25, num_blocks=64, budget=256, policy="priority", mtp=2),
        random_mix(26, num_blocks=96, budget=256, long_prefill=24, adaptive=True, mtp=3),
        random_mix(27, num_blocks=64, budget=256, scheduled=64, prefill_interval=3, mtp=2),
    ]
