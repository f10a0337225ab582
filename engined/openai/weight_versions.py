"""vLLM's `weight_versions` of a choice: which weight version sampled which output tokens.

An RL trainer labels the weights it loads (`POST /update_weight_version`, the daemon's
`set_weight_version`); every engine step's outputs carry the label in force, and vLLM's output
processor starts a span at a choice's token count whenever the label of its new tokens differs
from the last (vllm/v1/engine/output_processor.py, `track_weight_version`). A finished choice
asked with `return_weight_versions` gets the spans as `[{"version", "start", "end"}]`, half-open
ranges over its output tokens. The daemon leaves vLLM's "default" out of its entries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from engined.wire.control import DEFAULT_WEIGHT_VERSION

# (label, tokens) runs of one delta's tokens, in order.
Runs = list[tuple[str, int]]


class WeightVersionSpan(msgspec.Struct):
    """Output tokens `[start, end)` were sampled by weights labelled `version`."""

    version: str
    start: int
    end: int


def add_run(runs: Runs, label: str | None, tokens: int) -> None:
    """Append `tokens` sampled under `label` (None: "default") to `runs`."""
    if not tokens:
        return
    version = DEFAULT_WEIGHT_VERSION if label is None else label
    if runs and runs[-1][0] == version:
        runs[-1] = (version, runs[-1][1] + tokens)
    else:
        runs.append((version, tokens))


def joined(first: Runs, then: Iterable[tuple[str, int]]) -> Runs:
    """`first` followed by `then` (a delta held back, then the next one)."""
    for version, tokens in then:
        add_run(first, version, tokens)
    return first


@dataclass(slots=True)
class VersionSpans:
    """A choice's span starts, as vLLM's request state keeps them."""

    starts: list[tuple[str, int]] = field(default_factory=list)

    def track(self, runs: Runs, first: int, counted: int) -> None:
        """A delta's runs, its tokens from position `first`, `counted` of them kept (a stop
        string drops the rest)."""
        position = first
        for version, tokens in runs:
            if position >= first + counted:
                return
            starts = self.starts
            if not starts or starts[-1][0] != version:
                starts.append((version, position))
            position += tokens

    def spans(self, num_tokens: int) -> list[WeightVersionSpan] | None:
        """vLLM's `_weight_version_spans`: None when tokens came without a label."""
        starts = self.starts
        if not starts and num_tokens:
            return None
        ends = [start for _, start in starts[1:]] + [num_tokens]
        return [
            WeightVersionSpan(version, start, end)
            for (version, start), end in zip(starts, ends, strict=True)
        ]
