"""The parity scenarios (issue 25): generated deterministically, so the table reproduces.

Every random choice comes from a `random.Random` seeded by the scenario's own seed. Token
ids stay below 32000 (the tiny Llama's vocabulary) and differ between unrelated prompts, so
prefix hits happen only where a scenario shares a prefix on purpose.
"""

from __future__ import annotations

import random

from parity.abort_scenarios import abort_scenarios
from parity.lora_scenarios import lora_pressure, lora_shared_prefix
from parity.mtp_scenarios import mtp_scenarios
from parity.pause_scenarios import pause_scenarios
from parity.random_mix import random_mix, random_tokens
from parity.report_scenarios import report_scenarios
from parity.scenario import Config, Scenario, ScenarioRequest, asynchronous


def chunked_prompt() -> Scenario:
    return Scenario(
        name="chunked-300",
        description="one 300-token prompt chunked at budget 64, 8 tokens out",
        config=Config(num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=64),
        requests=[ScenarioRequest(id="r0", arrival=0, prompt=list(range(1, 301)), max_tokens=8)],
    )


def shared_prefix(*, staggered: bool, caching: bool = True) -> Scenario:
    rng = random.Random(8)
    prefix = random_tokens(rng, 64)
    requests = [
        ScenarioRequest(
            id=f"s{i}",
            arrival=2 * i if staggered else 0,
            prompt=prefix + random_tokens(rng, 32),
            max_tokens=8,
        )
        for i in range(8)
    ]
    name = "shared-prefix-" + ("staggered" if staggered else "burst")
    when = "every 2 steps" if staggered else "at one step"
    if not caching:
        name += "-nocache"
    return Scenario(
        name=name,
        description=f"8 requests sharing a 64-token prefix {when}"
        + ("" if caching else ", prefix caching off"),
        config=Config(
            num_gpu_blocks=128,
            max_num_batched_tokens=256,
            max_num_seqs=64,
            enable_prefix_caching=caching,
        ),
        requests=requests,
    )


def pressure(watermark: float = 0.0) -> Scenario:
    rng = random.Random(12)
    return Scenario(
        name="pressure" + (f"-watermark{watermark}" if watermark else ""),
        description="12 x (64 prompt + 48 out) in 24 blocks: preemption and re-admission"
        + (f"; watermark {watermark}" if watermark else ""),
        config=Config(num_gpu_blocks=24, max_num_batched_tokens=8192, watermark=watermark),
        requests=[
            ScenarioRequest(id=f"p{i}", arrival=0, prompt=random_tokens(rng, 64), max_tokens=48)
            for i in range(12)
        ],
    )


def repeated_prompts(length: int = 100) -> Scenario:
    """A 96-token prompt is whole blocks: fully cached, its last token is recomputed."""
    rng = random.Random(5)
    prompt = random_tokens(rng, length)
    return Scenario(
        name="repeated-prompts" + ("-whole-blocks" if length % 16 == 0 else ""),
        description=f"one {length}-token prompt sent 8 times, 5 steps apart (the prefix-hit rule)",
        config=Config(num_gpu_blocks=64, max_num_batched_tokens=128, max_num_seqs=16),
        requests=[
            ScenarioRequest(id=f"x{i}", arrival=5 * i, prompt=list(prompt), max_tokens=4)
            for i in range(8)
        ],
    )


def priority_pressure() -> Scenario:
    """The pressure scenario under the priority policy, priorities 0-3 at random."""
    rng = random.Random(13)
    return Scenario(
        name="pressure-priority",
        description="12 x (64 prompt + 48 out) in 24 blocks, priority policy, priorities 0-3",
        config=Config(
            num_gpu_blocks=24,
            max_num_batched_tokens=8192,
            max_num_seqs=256,
            scheduling_policy="priority",
        ),
        requests=[
            ScenarioRequest(
                id=f"q{i}",
                arrival=i // 3,
                prompt=random_tokens(rng, 64),
                max_tokens=48,
                priority=rng.randrange(4),
            )
            for i in range(12)
        ],
    )


def max_num_seqs_limit(active: int | None = None) -> Scenario:
    """With `active`, vLLM's max_num_active_seqs under max_num_seqs 8 admits instead."""
    rng = random.Random(4)
    return Scenario(
        name="max-num-seqs" if active is None else f"max-num-active-seqs-{active}",
        description="10 requests at once, "
        + ("max_num_seqs 4" if active is None else f"max_num_seqs 8, max_num_active_seqs {active}"),
        config=Config(
            num_gpu_blocks=128,
            max_num_batched_tokens=256,
            max_num_seqs=4 if active is None else 8,
            max_num_active_seqs=active,
        ),
        requests=[
            ScenarioRequest(id=f"q{i}", arrival=0, prompt=random_tokens(rng, 40), max_tokens=12)
            for i in range(10)
        ],
    )


def max_model_len_limit() -> Scenario:
    rng = random.Random(6)
    return Scenario(
        name="max-model-len",
        description="prompts of 100 asking 64 tokens under max_model_len 128",
        config=Config(
            num_gpu_blocks=64, max_num_batched_tokens=128, max_num_seqs=8, max_model_len=128
        ),
        requests=[
            ScenarioRequest(id=f"l{i}", arrival=i, prompt=random_tokens(rng, 100), max_tokens=64)
            for i in range(4)
        ],
    )


def no_chunked_prefill() -> Scenario:
    rng = random.Random(9)
    return Scenario(
        name="no-chunked-prefill",
        description="chunked prefill off: 6 prompts of 150-400 tokens at budget 512",
        config=Config(
            num_gpu_blocks=128,
            max_num_batched_tokens=512,
            max_num_seqs=16,
            max_model_len=512,
            enable_chunked_prefill=False,
        ),
        requests=[
            ScenarioRequest(
                id=f"n{i}",
                arrival=i,
                prompt=random_tokens(rng, rng.randrange(150, 401)),
                max_tokens=6,
            )
            for i in range(6)
        ],
    )


def stop_pressure() -> Scenario:
    """Stop ids and min_tokens under preemption: engined draws from 16 ids, 2 of them stop
    ids (one token in 8 after min_tokens), so requests stop early, and never before their
    min_tokens, while 24 blocks hold at most 5 of 12 requests. One planned output stops on
    its 30th token (past its min_tokens of 20); two requests have no stop ids."""
    rng = random.Random(14)
    stops = [3, 11]
    requests = []
    for i in range(12):
        min_tokens = [0, 4, 16, 40, 64, 80][i % 6]
        requests.append(
            ScenarioRequest(
                id=f"t{i}",
                arrival=i // 4,
                prompt=random_tokens(rng, 64),
                max_tokens=80,
                stop_token_ids=stops if i not in (5, 9) else [],
                min_tokens=min_tokens if i not in (5, 9) else 0,
            )
        )
    planned = [rng.choice([t for t in range(1, 16) if t not in stops]) for _ in range(60)]
    planned[29] = stops[1]
    requests.append(
        ScenarioRequest(
            id="t-planned",
            arrival=1,
            prompt=random_tokens(rng, 64),
            max_tokens=len(planned),
            stop_token_ids=stops,
            min_tokens=20,
            output_token_ids=planned,
        )
    )
    return Scenario(
        name="stop-min-tokens-pressure",
        description="13 x (64 prompt + up to 80 out) in 24 blocks, stop ids with min_tokens "
        "0-80, engined drawing from 16 ids",
        config=Config(
            num_gpu_blocks=24, max_num_batched_tokens=8192, max_num_seqs=256, vocab_size=16
        ),
        requests=requests,
    )


def cache_salt(hash_algo: str = "sha256") -> Scenario:
    """Salted requests over one shared 64-token prefix, every 2 steps, in a pool small enough
    to evict: salts a, b, none and "" (no salt, as vLLM), so only equal salts hit. A 6-token
    salted prompt fills its first block with its planned output; later prompts of those 16
    tokens and more hit that block under its salt only."""
    rng = random.Random(15)
    prefix = random_tokens(rng, 64)
    salts: list[str | None] = ["a", "b", None, "a", "", "b", "a", None, "b", "a", "", "b"]
    requests = [
        ScenarioRequest(
            id=f"c{i}",
            arrival=2 * i,
            prompt=prefix + random_tokens(rng, rng.randrange(8, 49)),
            max_tokens=8,
            cache_salt=salt,
        )
        for i, salt in enumerate(salts)
    ]
    short = random_tokens(rng, 6)
    planned = random_tokens(rng, 20)
    requests.append(
        ScenarioRequest(
            id="c-short",
            arrival=24,
            prompt=short,
            max_tokens=len(planned),
            cache_salt="a",
            output_token_ids=planned,
        )
    )
    grown = short + planned[:10]
    for i, salt in enumerate(["a", "b", "a"]):
        requests.append(
            ScenarioRequest(
                id=f"c-grown{i}",
                arrival=44 + 2 * i,
                prompt=grown + random_tokens(rng, 5),
                max_tokens=4,
                cache_salt=salt,
            )
        )
    requests.sort(key=lambda r: r.arrival)
    extra = "" if hash_algo == "sha256" else f"-{hash_algo}"
    return Scenario(
        name="cache-salt-shared-prefix" + extra,
        description='12 requests sharing a 64-token prefix under salts a, b, none and "", '
        "every 2 steps, in 20 blocks; a short salted prompt's generated first block"
        + ("" if hash_algo == "sha256" else f"; {hash_algo}"),
        config=Config(
            num_gpu_blocks=20,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            prefix_caching_hash_algo=hash_algo,
        ),
        requests=requests,
    )


def all_scenarios() -> list[Scenario]:
    return [
        chunked_prompt(),
        shared_prefix(staggered=False),
        shared_prefix(staggered=True),
        shared_prefix(staggered=False, caching=False),
        pressure(),
        repeated_prompts(),
        repeated_prompts(96),
        max_num_seqs_limit(),
        max_num_seqs_limit(active=3),
        max_model_len_limit(),
        no_chunked_prefill(),
        random_mix(1, num_blocks=160, budget=256),
        random_mix(2, num_blocks=64, budget=256),
        random_mix(3, num_blocks=96, budget=128),
        random_mix(4, num_blocks=48, budget=512, block_size=32),
        priority_pressure(),
        random_mix(5, num_blocks=64, budget=256, policy="priority"),
        random_mix(6, num_blocks=96, budget=128, block_size=32, policy="priority"),
        random_mix(7, num_blocks=64, budget=256, full_isl=False),
        random_mix(8, num_blocks=80, budget=192, caching=False),
        random_mix(9, num_blocks=96, budget=256, hash_algo="sha256_cbor"),
        random_mix(10, num_blocks=96, budget=256, long_prefill=48),
        random_mix(11, num_blocks=64, budget=256, long_prefill=24, adaptive=True),
        random_mix(12, num_blocks=96, budget=256, prefill_interval=4),
        random_mix(13, num_blocks=48, budget=128, prefill_interval=3),
        random_mix(14, num_blocks=96, budget=256, scheduled=96),
        random_mix(15, num_blocks=64, budget=256, scheduled=64, long_prefill=24, adaptive=True),
        pressure(watermark=0.1),
        stop_pressure(),
        cache_salt(),
        cache_salt("sha256_cbor"),
        lora_pressure(),
        lora_pressure(max_loras=1),
        lora_shared_prefix(),
        random_mix(16, num_blocks=64, budget=256, adapters=4, max_loras=2),
        random_mix(17, num_blocks=96, budget=128, adapters=3, max_loras=1, salted=True),
        random_mix(18, num_blocks=64, budget=256, policy="priority", adapters=4, max_loras=2),
        random_mix(19, num_blocks=96, budget=256, prefill_interval=3, adapters=3, max_loras=2),
        *async_scenarios(),
        *pause_scenarios(),
        *mtp_scenarios(
            [
                (chunked_prompt(), 2, True),
                (shared_prefix(staggered=True), 2, True),
                (pressure(), 2, True),
                (pressure(), 2, False),
                (repeated_prompts(), 2, True),
                (repeated_prompts(96), 1, True),
                (max_model_len_limit(), 3, True),
                (no_chunked_prefill(), 1, False),
                (stop_pressure(), 2, True),
                (cache_salt(), 2, True),
            ]
        ),
        *abort_scenarios(),
        *report_scenarios(
            [repeated_prompts(), shared_prefix(staggered=True), pressure(), cache_salt()]
        ),
    ]


def async_scenarios() -> list[Scenario]:
    """The same streams under vLLM's AsyncScheduler (issue 25: `--async-scheduling`)."""
    return [
        asynchronous(scenario)
        for scenario in (
            chunked_prompt(),
            shared_prefix(staggered=True),
            pressure(),
            repeated_prompts(),
            repeated_prompts(96),
            max_num_seqs_limit(),
            max_model_len_limit(),
            random_mix(1, num_blocks=160, budget=256),
            random_mix(2, num_blocks=64, budget=256),
            random_mix(4, num_blocks=48, budget=512, block_size=32),
            priority_pressure(),
            random_mix(5, num_blocks=64, budget=256, policy="priority"),
            random_mix(10, num_blocks=96, budget=256, long_prefill=48),
            random_mix(12, num_blocks=96, budget=256, prefill_interval=4),
            random_mix(14, num_blocks=96, budget=256, scheduled=96),
            pressure(watermark=0.1),
            stop_pressure(),
            cache_salt(),
            lora_pressure(),
            lora_shared_prefix(),
            random_mix(16, num_blocks=64, budget=256, adapters=4, max_loras=2),
            random_mix(18, num_blocks=64, budget=256, policy="priority", adapters=4, max_loras=2),
        )
    ]
