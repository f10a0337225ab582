"""The requests `engined bench` sends: prompts and output lengths, reproducible from a seed.

Apart from the running and the report because the sequence is the one part a test or another
load generator may want alone: the same seed and options give the same requests in the same
order, whatever the daemon does with them.
"""

from __future__ import annotations

import random

from engined.tools.distributions import Distribution
from engined.tools.submit import VOCAB_SIZE


class Workload:
    """The request sequence: prompt tokens and max_tokens, reproducible from the seed.

    A request's shared part is the first `round(ratio * prompt_len)` tokens of its group's
    prefix; groups are one long token sequence each, so prompts of different lengths in one
    group share the common start, as prompts sharing a system prompt do. The rest is random.
    """

    def __init__(
        self,
        prompt_len: Distribution,
        output_len: Distribution,
        shared_prefix_ratio: float,
        prefix_groups: int,
        seed: int,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        self._prompt_len = prompt_len
        self._output_len = output_len
        self._ratio = shared_prefix_ratio
        self._vocab = vocab_size
        self._rng = random.Random(f"engined-bench-{seed}")
        self._groups = [
            random.Random(f"engined-bench-{seed}-prefix-{g}") for g in range(prefix_groups)
        ]
        self._prefixes: list[list[int]] = [[] for _ in range(prefix_groups)]

    def next(self) -> tuple[list[int], int]:
        rng = self._rng
        length = self._prompt_len.sample(rng)
        max_tokens = self._output_len.sample(rng)
        shared = min(length, round(length * self._ratio))
        group = rng.randrange(len(self._groups))
        prefix = self._prefix(group, shared)
        return prefix + [rng.randrange(self._vocab) for _ in range(length - shared)], max_tokens

    def _prefix(self, group: int, length: int) -> list[int]:
        tokens = self._prefixes[group]
        grow = self._groups[group]
        while len(tokens) < length:
            tokens.append(grow.randrange(self._vocab))
        return tokens[:length]
