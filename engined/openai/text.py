"""The text of one choice: incremental detokenization, and stop strings as vLLM applies them.

vLLM finishes a request whose text contains one of its `stop` strings, cuts the text before
it (after it with `include_stop_str_in_output`), and meanwhile holds back the tail of the text
that could still become the start of a stop string, so a client never receives text it would
have to take back. The output processor then aborts the request in the engine; here the
serving layer cancels it, which frees its KV on the next pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Detokenizer(Protocol):
    def push(self, new_ids: Sequence[int]) -> str: ...


@dataclass(slots=True)
class ChoiceText:
    """Turns a choice's token deltas into text deltas; `stopped` once a stop string matched."""

    detokenizer: Detokenizer
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    stopped: str | None = None
    _held: str = ""
    _hold: int = field(init=False)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(
        self, token_ids: Sequence[int], *, final: bool, stop_terminated: bool = False
    ) -> tuple[str, int]:
        """The text that may be sent now for `token_ids`, and how many of them count.

        Without stop strings every token counts. With them tokens are read one at a time,
        as vLLM's detokenizer does, and those after the one that completed a stop string
        are dropped: the request finished there. A request the engine ended on a stop token
        (`stop_terminated`) counts that token but, as vLLM's detokenizer, leaves its text out
        unless the stop is to be included.
        """
        shown = token_ids
        if stop_terminated and not self.include_stop and token_ids:
            shown = token_ids[:-1]
        if not self.stop:
            return (self.detokenizer.push(shown) if shown else ""), len(token_ids)
        if self.stopped is not None:
            return "", 0
        sent: list[str] = []
        for count, token in enumerate(shown, 1):
            pending = self._held + self.detokenizer.push((token,))
            cut = self._find_stop(pending)
            if cut is not None:
                self._held = ""
                sent.append(pending[:cut])
                return "".join(sent), count
            keep = min(self._hold, len(pending))
            self._held = pending[len(pending) - keep :]
            sent.append(pending[: len(pending) - keep])
        if final:
            sent.append(self._held)
            self._held = ""
        return "".join(sent), len(token_ids)

    def _find_stop(self, text: str) -> int | None:
        """Where the text sent must end when a stop string occurs in `text`, else None."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        self.stopped = best[1]
        return best[0] + len(best[1]) if self.include_stop else best[0]
