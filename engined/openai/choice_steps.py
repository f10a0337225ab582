"""One rule for how a choice advances, shared by completions and chat.

A delta from the engine becomes the choice's text (through its detokenizer and stop
strings), the token ids that count, and, once the choice ends, vLLM's finish reason and stop
reason: a matched stop string is `stop` with the string (and its engine request is cancelled
at once, as vLLM's output processor aborts it), the engine's `stop` keeps the stop token's id,
`length` stays, a request the daemon cancelled is vLLM's `abort`, and one it rejected is
vLLM's generation error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engined.openai.api_errors import generation_error
from engined.openai.generation import Delta, Generation
from engined.openai.text import ChoiceText
from engined.openai.weight_versions import VersionSpans, WeightVersionSpan

FINISH_REASONS: Mapping[str, str] = {"length": "length", "stop": "stop", "cancelled": "abort"}


@dataclass(slots=True)
class Choice:
    index: int
    text: ChoiceText
    tokens: int = 0
    done: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    all_text: list[str] = field(default_factory=list)
    all_ids: list[int] = field(default_factory=list)
    versions: VersionSpans = field(default_factory=VersionSpans)

    def advance(self, delta: Delta) -> tuple[str, list[int], int] | None:
        """(text, counted token ids, position of the first) of a delta; None once done."""
        if self.done:
            return None
        text, counted = self.text.push(
            delta.token_ids,
            final=delta.finished,
            stop_terminated=delta.finished and delta.finish_reason == "stop",
        )
        ids = delta.token_ids if counted == len(delta.token_ids) else delta.token_ids[:counted]
        first = self.tokens
        self.versions.track(delta.versions, first, counted)
        self.tokens += counted
        if self.text.stopped is not None:
            self.done = True
            self.finish_reason, self.stop_reason = "stop", self.text.stopped
        elif delta.finished:
            self.done = True
            if delta.finish_reason == "rejected":
                raise generation_error()
            self.finish_reason = FINISH_REASONS.get(delta.finish_reason or "", "length")
            self.stop_reason = delta.stop_reason
        return text, ids, first

    def weight_versions(self) -> list[WeightVersionSpan] | None:
        """vLLM's spans of the finished choice's tokens by weight version."""
        return self.versions.spans(self.tokens)


C = TypeVar("C", bound=Choice)


@dataclass(frozen=True, slots=True)
class Step(Generic[C]):
    choice: C
    text: str
    ids: list[int]
    first: int


async def steps(generation: Generation, choices: Sequence[C]) -> AsyncGenerator[Step[C], None]:
    """Every choice's steps as the engine's passes produce them, until all are done."""
    deltas = generation.deltas()
    async with contextlib.aclosing(deltas):
        async for batch in deltas:
            for delta in batch:
                choice = choices[delta.choice_index]
                advanced = choice.advance(delta)
                if advanced is None:
                    continue
                if choice.text.stopped is not None:
                    generation.stop(choice.index)
                yield Step(choice, *advanced)
            if all(choice.done for choice in choices):
                return
