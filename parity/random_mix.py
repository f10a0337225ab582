"""The random parity scenarios: hundreds of requests over shared prefixes, one seed each.

Every choice comes from a `random.Random` seeded by the scenario's own seed, so the table
reproduces; the name says every setting that is not the default.
"""

from __future__ import annotations

import random

from parity.scenario import Adapter, Config, Scenario, ScenarioRequest

VOCAB = 32000


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """`n` token ids below the tiny Llama's vocabulary."""
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def random_mix(
    seed: int,
    *,
    num_blocks: int,
    budget: int,
    count: int = 200,
    block_size: int = 16,
    max_num_seqs: int = 64,
    policy: str = "fcfs",
    full_isl: bool = True,
    caching: bool = True,
    hash_algo: str = "sha256",
    long_prefill: int = 0,
    adaptive: bool = False,
    prefill_interval: int = 1,
    scheduled: int | None = None,
    adapters: int = 0,
    max_loras: int = 1,
    salted: bool = False,
    mtp: int = 0,
    spread: int | None = None,
    max_out: int = 64,
) -> Scenario:
    """`count` requests over 8 shared prefixes (16-128 tokens) with their own suffixes,
    arriving over about `count / 2` steps; under the priority policy each has a priority in
    0-3. With `adapters`, LoRA is on (`max_loras`) and two requests in three run one of
    that many adapters (the rest the base model); `salted` gives two in three a cache salt
    of two; `mtp` drafts that many tokens a step (MTP); `spread` steps of arrivals (None:
    `count / 2`) and `max_out` tokens at most make a lighter load of longer requests. The
    name says every setting that is not the default."""
    rng = random.Random(seed)
    loras = [Adapter(f"adapter-{n}", n + 1, f"/adapters/{n}") for n in range(adapters)]
    prefixes = [random_tokens(rng, rng.randrange(16, 129)) for _ in range(8)]
    requests = []
    for i in range(count):
        shared = rng.random() < 0.8
        prompt = (rng.choice(prefixes) if shared else []) + random_tokens(rng, rng.randrange(1, 97))
        requests.append(
            ScenarioRequest(
                id=f"m{i}",
                arrival=rng.randrange(0, spread or count // 2),
                prompt=prompt,
                max_tokens=rng.randrange(1, max_out + 1),
                priority=rng.randrange(4) if policy == "priority" else 0,
                lora=(None if rng.random() < 1 / 3 else rng.choice(loras)) if loras else None,
                cache_salt=rng.choice([None, "a", "b"]) if salted else None,
            )
        )
    requests.sort(key=lambda r: r.arrival)
    extras = [
        label
        for label, on in (
            (policy, policy != "fcfs"),
            ("no-full-isl", not full_isl),
            ("nocache", not caching),
            (hash_algo, hash_algo != "sha256"),
            (f"long{long_prefill}" + ("-adaptive" if adaptive else ""), long_prefill > 0),
            (f"interval{prefill_interval}", prefill_interval > 1),
            (f"scheduled{scheduled}", scheduled is not None),
            (f"lora{adapters}-max{max_loras}", adapters > 0),
            ("salted", salted),
            (f"mtp{mtp}", mtp > 0),
            (f"spread{spread}", spread is not None),
            (f"out{max_out}", max_out != 64),
        )
        if on
    ]
    return Scenario(
        name="-".join([f"random-s{seed}-b{num_blocks}-t{budget}-bs{block_size}", *extras]),
        description=(
            f"{count} random requests, shared prefixes; {num_blocks} blocks of {block_size}, "
            f"budget {budget}, seed {seed}" + "".join(f"; {label}" for label in extras)
        ),
        config=Config(
            block_size=block_size,
            num_gpu_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            scheduling_policy=policy,
            scheduler_reserve_full_isl=full_isl,
            enable_prefix_caching=caching,
            prefix_caching_hash_algo=hash_algo,
            long_prefill_token_threshold=long_prefill,
            long_prefill_token_threshold_adaptive=adaptive,
            prefill_schedule_interval=prefill_interval,
            max_num_scheduled_tokens=scheduled,
            enable_lora=adapters > 0,
            max_loras=max_loras,
            num_speculative_tokens=mtp,
        ),
        requests=requests,
    )
