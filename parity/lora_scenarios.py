"""The LoRA parity scenarios: vLLM's `max_loras` bound on admission, and blocks keyed by
adapter (and salt) in hashes and KV events.

vLLM skips a waiting request whose adapter would make the running requests' adapters exceed
`max_loras` and admits the ones behind it; a LoRA request's blocks are hashed with the
adapter's name and path, and published with its id and name. The random mixes with adapters
are `parity.random_mix` scenarios (`adapters`, `max_loras`, `salted`).
"""

from __future__ import annotations

import random

from parity.random_mix import random_tokens
from parity.scenario import Adapter, Config, Scenario, ScenarioRequest

SQL = Adapter("sql", 1, "/adapters/sql")
CHAT = Adapter("chat", 2, "/adapters/chat")
MATH = Adapter("math", 3, "/adapters/math")
# The name of SQL at another path, under another id: vLLM's hashes share nothing with SQL's.
SQL_V2 = Adapter("sql", 4, "/adapters/sql-v2")


def lora_pressure(max_loras: int = 2) -> Scenario:
    """The pressure scenario's 12 requests over the base model and three adapters: under
    max_loras a request for a third adapter waits while those behind it run, and preempted
    requests come back under the same bound."""
    rng = random.Random(16)
    adapters = [SQL, CHAT, None, MATH, SQL, CHAT, MATH, None, SQL, MATH, CHAT, None]
    return Scenario(
        name=f"lora-max{max_loras}",
        description="12 x (64 prompt + 48 out) in 24 blocks over the base model and 3 "
        f"adapters, max_loras {max_loras}",
        config=Config(
            num_gpu_blocks=24,
            max_num_batched_tokens=8192,
            enable_lora=True,
            max_loras=max_loras,
        ),
        requests=[
            ScenarioRequest(
                id=f"l{i}", arrival=i // 4, prompt=random_tokens(rng, 64), max_tokens=48, lora=lora
            )
            for i, lora in enumerate(adapters)
        ],
    )


def lora_shared_prefix() -> Scenario:
    """One 64-token prefix under two adapters, the same adapter name at another path and the
    base model, salted or not, every 2 steps, chunked at 32 tokens in 20 blocks: only equal
    adapter, path and salt hit. A 6-token prompt for sql fills its first block with its
    planned output; later prompts of those 16 tokens and more hit it under sql only."""
    rng = random.Random(17)
    prefix = random_tokens(rng, 64)
    keyed: list[tuple[Adapter | None, str | None]] = [
        (SQL, None),
        (CHAT, None),
        (None, None),
        (SQL, None),
        (SQL, "s"),
        (CHAT, None),
        (SQL_V2, None),
        (None, "s"),
        (SQL, "s"),
        (CHAT, "s"),
        (SQL, None),
        (None, None),
    ]
    requests = [
        ScenarioRequest(
            id=f"k{i}",
            arrival=2 * i,
            prompt=prefix + random_tokens(rng, rng.randrange(8, 49)),
            max_tokens=8,
            lora=lora,
            cache_salt=salt,
        )
        for i, (lora, salt) in enumerate(keyed)
    ]
    short = random_tokens(rng, 6)
    planned = random_tokens(rng, 20)
    requests.append(
        ScenarioRequest(
            id="k-short",
            arrival=24,
            prompt=short,
            max_tokens=len(planned),
            lora=SQL,
            output_token_ids=planned,
        )
    )
    grown = short + planned[:10]
    for i, lora in enumerate([SQL, CHAT, SQL_V2, SQL]):
        requests.append(
            ScenarioRequest(
                id=f"k-grown{i}",
                arrival=58 + 2 * i,
                prompt=grown + random_tokens(rng, 5),
                max_tokens=4,
                lora=lora,
            )
        )
    requests.sort(key=lambda r: r.arrival)
    return Scenario(
        name="lora-salt-shared-prefix",
        description="12 requests sharing a 64-token prefix under adapters sql, chat, sql at "
        "another path and none, salted or not, every 2 steps, chunked at 32 in 20 blocks, "
        "max_loras 2; a short sql prompt's generated first block",
        config=Config(
            num_gpu_blocks=20,
            max_num_batched_tokens=32,
            max_num_seqs=8,
            enable_lora=True,
            max_loras=2,
        ),
        requests=requests,
    )
