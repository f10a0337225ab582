"""LEGACY: the daemon's pre-restructure per-token output (engined/core/legacy.py).

`PassResult.output_signals` rebuilds these from the per-request `RequestOutput`s. Removed
when the shell consumes `PassResult.outputs` directly (issue 11, phase B). Nothing here
imports the rest of the core, so `types.py` can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec


class _Output(Protocol):
    """The fields of a `RequestOutput` (engined/core/types.py) the conversion reads."""

    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def handoff_delay_ms(self) -> float | None: ...


class OutputSignal(msgspec.Struct, frozen=True, gc=False):
    """One emitted token (or a token-less terminal) of one request (legacy).

    `cached_tokens` rides only on a request's first signal; `handoff_delay_ms` only on its
    terminal signal.
    """

    request_id: str
    token_id: int | None
    completed: bool
    rejected: bool = False
    handoff_delay_ms: float | None = None
    cached_tokens: int | None = None


def signals_of(outputs: Sequence[_Output]) -> list[OutputSignal]:
    """Per-token signals of per-request outputs (legacy), in the same order."""
    signals: list[OutputSignal] = []
    append = signals.append
    for out in outputs:
        tokens = out.new_token_ids
        reason = out.finish_reason
        if len(tokens) == 1 and reason is None and out.cached_tokens is None:
            append(OutputSignal(out.request_id, tokens[0], False))
            continue
        completed = reason is not None
        rejected = reason == "rejected"
        if not tokens:
            append(
                OutputSignal(
                    out.request_id,
                    None,
                    completed,
                    rejected,
                    out.handoff_delay_ms,
                    out.cached_tokens,
                )
            )
            continue
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            end = i == last
            append(
                OutputSignal(
                    out.request_id,
                    token,
                    completed and end,
                    rejected and end,
                    out.handoff_delay_ms if end else None,
                    out.cached_tokens if i == 0 else None,
                )
            )
    return signals
