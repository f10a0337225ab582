"""Length distributions of `engined bench`: a three-word syntax, seeded sampling.

    fixed:N          always N (a bare `N` means the same)
    uniform:LO:HI    an integer in [LO, HI], both ends included
    normal:MEAN:STD  round(gauss(MEAN, STD)), clamped to at least 1

Lengths are at least 1: a prompt must have a token, and a zero-token output has no first
token to time. The syntax is deliberately small: these three cover fixed-shape regressions,
spread workloads and "around N" workloads, and a spec fits in one shell word.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final, Literal

SYNTAX = "fixed:N, uniform:LO:HI or normal:MEAN:STD (N, LO, HI >= 1; STD >= 0)"


@dataclass(frozen=True, slots=True)
class Distribution:
    kind: Literal["fixed", "uniform", "normal"]
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"normal:{self.a:g}:{self.b:g}"


def parse_distribution(text: str) -> Distribution:
    """Parse a spec (see the module docstring).

    Raises:
        ValueError: the message quotes the spec and restates the syntax.
    """
    parts = text.strip().split(":")
    kind = parts[0].lower()
    try:
        if len(parts) == 1:
            return Distribution("fixed", _count(parts[0]))
        if kind == "fixed" and len(parts) == 2:
            return Distribution("fixed", _count(parts[1]))
        if kind == "uniform" and len(parts) == 3:
            low, high = _count(parts[1]), _count(parts[2])
            if low > high:
                raise ValueError(f"LO {low} is above HI {high}")
            return Distribution("uniform", low, high)
        if kind == "normal" and len(parts) == 3:
            mean, std = float(parts[1]), float(parts[2])
            if not mean >= 1 or not std >= 0 or std == float("inf"):
                raise ValueError("needs MEAN >= 1 and a finite STD >= 0")
            return Distribution("normal", mean, std)
    except ValueError as error:
        raise ValueError(f"{text!r}: {error}; expected {SYNTAX}") from None
    raise ValueError(f"{text!r} is not a length distribution; expected {SYNTAX}")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{value} is below 1")
    return value


# `engined bench` defaults: a mid-size chat turn.
DEFAULT_PROMPT_LEN: Final = Distribution("fixed", 512)
DEFAULT_OUTPUT_LEN: Final = Distribution("fixed", 128)
