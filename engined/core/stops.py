"""vLLM's early stop of one request: `stop_token_ids` and `min_tokens`.

vLLM ends a request as soon as the token just appended to its output is one of its
`stop_token_ids` (`check_stop`: finish reason "stop", the token counted, emitted and reported
as `stop_reason`), and frees it in that same step. Until the output holds `min_tokens` tokens
its sampler cannot pick a stop id at all: `MinTokensLogitsProcessor` masks them. engined draws
tokens rather than sampling them, so it keeps both rules:

* before `min_tokens`, an unplanned token that comes out as a stop id is drawn again from the
  request's own stream (rejection, as the vocabulary's exclusions are drawn), so the tokens
  stay a function of the request alone; when every drawable id is a stop id there is nothing
  else to draw and the draw stands (a masked vLLM sampler has no valid choice either);
* a stop id ends the request only once the output holds `min_tokens` tokens. For drawn tokens
  this changes nothing; it is what keeps a planned output (`output_token_ids`), which no mask
  shapes, from stopping earlier than vLLM could.

A request without stop ids has no `StopRule`, so the decode path pays one `is None` test.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from engined.core.token_stream import TokenBits
from engined.core.vocab import Vocabulary

# The most stop ids a request may name. A model's EOS ids number one to a handful (Llama 3:
# three) and a client's own stop ids a few more; the bound keeps each request's set small.
STOP_TOKEN_IDS_MAX: Final = 256


class StopRule:
    """A request's stop ids and `min_tokens` (only for a request that has stop ids)."""

    __slots__ = ("ids", "min_tokens")

    def __init__(self, ids: Iterable[int], min_tokens: int) -> None:
        self.ids = frozenset(ids)
        self.min_tokens = min_tokens

    def stops_at(self, token: int, num_output: int) -> bool:
        """Whether `token`, the request's `num_output`-th output token, ends it."""
        return num_output >= self.min_tokens and token in self.ids

    def draw(self, vocab: Vocabulary | None, bits: TokenBits) -> int:
        """An unplanned token drawn before `min_tokens`: no stop id while another id is
        drawable."""
        ids = self.ids
        token = bits(32) if vocab is None else vocab.next_token(bits)
        if token not in ids or not self._can_avoid(vocab):
            return token
        while token in ids:
            token = bits(32) if vocab is None else vocab.next_token(bits)
        return token

    def _can_avoid(self, vocab: Vocabulary | None) -> bool:
        """Some drawable id is no stop id (asked only when a draw hit one; the vocabulary may
        have changed since the request arrived)."""
        if vocab is None:
            return True
        drawable_stops = sum(1 for token in self.ids if vocab.allows(token))
        return drawable_stops < vocab.num_drawable()
