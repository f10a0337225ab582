"""Requests entering an engine: validation, id minting, and the record each one gets.

Every request, plain or a handoff's, becomes a `RequestState` here: its prompt checked, its
output length clamped by the admission policy, its `Sequence` cut into blocks with the
engine's shared RNG (block ids without prefix caching), partial-block ids and vocabulary, and
given its own token stream (engined/core/token_stream.py). A request without an id gets one from
a counter (`req-<n>`, skipping ids already taken), never from a clock or `uuid4`, so the same
commands always give the same ids.

A LoRA request is checked as vLLM checks one, in its order and words: its `LoRARequest`
(id at least 1, a path), then its engine (`enable_lora`, `_validate_lora`); the mocker's
pool, which cannot enable LoRA, refuses it as it refuses a salt.
"""

from __future__ import annotations

import itertools
import random
from _random import Random
from collections.abc import Callable

from engined.core.errors import InvalidRequestError, UnsupportedError
from engined.core.policy import AdmissionPolicy
from engined.core.sequence import Sequence
from engined.core.state import RequestState
from engined.core.stops import StopRule
from engined.core.token_stream import SEED_MAX, SEED_MIN, acceptance, stream_key
from engined.core.types import LoraRequest, Request, RequestStatus
from engined.core.vocab import Vocabulary


class RequestIntake:
    __slots__ = (
        "_arrivals",
        "_block_size",
        "_caching",
        "_lora",
        "_minted",
        "_mtp_seed",
        "_paged",
        "_partial_ids",
        "_policy",
        "_rng",
        "_seed",
        "_vocab",
    )

    def __init__(
        self,
        policy: AdmissionPolicy,
        *,
        block_size: int,
        caching: bool,
        rng: random.Random,
        vocab: Vocabulary,
        seed: int,
        paged: bool = False,
        lora: bool = False,
        mtp_seed: int | None = None,
    ) -> None:
        """`lora`: `enable_lora`, LoRA requests are accepted (vLLM semantics only);
        `mtp_seed`: MTP under vLLM semantics, each request gets its acceptance stream."""
        self._policy = policy
        self._mtp_seed = mtp_seed
        self._lora = lora
        self._seed = seed
        self._paged = paged
        self._block_size = block_size
        self._caching = caching
        self._rng = rng
        self._vocab = vocab
        self._partial_ids = itertools.count().__next__
        self._minted = itertools.count()
        # Arrival order, vLLM's tie-break between equal priorities.
        self._arrivals = itertools.count()

    def request_id(self, request: Request, taken: Callable[[str], bool]) -> str:
        """The request's own id, or the next minted one that `taken` does not claim."""
        if request.request_id is not None:
            return request.request_id
        while True:
            minted = f"req-{next(self._minted)}"
            if not taken(minted):
                return minted

    def build(self, request: Request, request_id: str, status: RequestStatus) -> RequestState:
        """The record of a new request. Raises InvalidRequestError, having changed nothing."""
        if not request.token_ids:
            raise InvalidRequestError("request.token_ids must not be empty")
        if request.max_tokens < 0:
            raise InvalidRequestError("request.max_tokens must be >= 0")
        if request.seed is not None and not SEED_MIN <= request.seed <= SEED_MAX:
            raise InvalidRequestError(
                f"request.seed must be in [{SEED_MIN}, {SEED_MAX}] (vLLM's int64), "
                f"got {request.seed}"
            )
        planned = request.output_token_ids
        max_out = len(planned) if planned is not None else request.max_tokens
        # vLLM's `SamplingParams` words, with the field's path.
        if request.min_tokens < 0:
            raise InvalidRequestError(
                f"request.min_tokens must be greater than or equal to 0, got {request.min_tokens}."
            )
        if request.min_tokens > max_out:
            raise InvalidRequestError(
                "request.min_tokens must be less than or equal to "
                f"max_tokens={max_out}, got {request.min_tokens}."
            )
        # vLLM salts only with a non-empty salt (`if request.cache_salt`).
        salt = request.cache_salt or None
        if salt is not None and not self._paged:
            raise _needs_vllm("cache_salt", "whose block hashes are the router's and take no salt")
        lora = request.lora_request
        if lora is not None:
            self._check_lora(lora)
        stop_ids = request.stop_token_ids
        max_out = self._policy.clamp_max_output(len(request.token_ids), max_out)
        key = stream_key(
            self._seed,
            request_id if request.stream_name is None else request.stream_name,
            request.seed,
            request.token_ids,
        )
        seq = Sequence(
            request.token_ids,
            max_out,
            self._block_size,
            caching=self._caching,
            rng=self._rng,
            token_bits=Random(key).getrandbits,
            next_partial_id=self._partial_ids,
            planned=planned,
            vocab=self._vocab,
            paged=self._paged,
            stops=StopRule(stop_ids, request.min_tokens) if stop_ids else None,
            cache_salt=salt,
            lora=lora,
        )
        state = RequestState(request_id, seq, status)
        if request.kv_cache_report_mode == "full":
            if not self._paged:
                raise _needs_vllm("kv_cache_report_mode", "whose KV events report no hit")
            state.report_hits = True
        if self._mtp_seed is not None:
            state.acceptance = acceptance(key, self._mtp_seed)
        state.priority = request.priority
        state.arrival = next(self._arrivals)
        return state

    def _check_lora(self, lora: LoraRequest) -> None:
        """vLLM's checks of a request's adapter. Raises InvalidRequestError (vLLM's
        ValueError, AssertionError and VLLMValidationError) or, on the mocker's pool,
        UnsupportedError."""
        if lora.lora_int_id < 1:
            raise InvalidRequestError(f"id must be > 0, got {lora.lora_int_id}")
        if not lora.lora_path:
            raise InvalidRequestError("lora_path cannot be empty")
        if not self._paged:
            raise _needs_vllm("lora_request", "which has no LoRA adapters")
        if not self._lora:
            raise InvalidRequestError(
                f"Got lora_request {vllm_repr(lora)} but LoRA is not enabled!"
            )


def _needs_vllm(field: str, why: str) -> UnsupportedError:
    """The refusal of a request field the mocker's KV cache cannot honour."""
    return UnsupportedError(
        f"request.{field} needs vLLM semantics: this engine keeps Dynamo mocker 1.3.0's KV "
        f"cache (semantics, prefix_hit_rule, MTP, TRT-LLM or offload tiers), {why}"
    )


def vllm_repr(lora: LoraRequest) -> str:
    """The adapter as vLLM prints its `LoRARequest` (msgspec's repr, every field): the
    fields vLLM has beyond engined's at their defaults, as a request naming only these
    three gets them."""
    return (
        f"LoRARequest(lora_name={lora.lora_name!r}, lora_int_id={lora.lora_int_id!r}, "
        f"lora_path={lora.lora_path!r}, base_model_name=None, load_inplace=False, "
        "is_3d_lora_weight=False)"
    )
