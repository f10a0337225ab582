"""vLLM 0.33's checks of a decoded request once its prompt is tokenized, in vLLM's order.

The serving layer runs, for a completion or chat request, after `decode_*_request`, the model
check (`errors.model_not_found`) and admission (`errors.engine_overloaded`):

1. `check_completion_prompt(request)` (completions): the prompts this engine cannot render;
2. `errors.context_length_error(max_model_len, prompt_tokens, budget, max_tokens_param=field,
   truncate_prompt_tokens=..., from_text=...)` with `budget, field = requested_max_tokens(
   request)`: the output budget and truncation size, then the tokenized prompt;
3. `check_sampling(request, effective_max_tokens(...))`: what vLLM's `SamplingParams` refuses
   while the request is built, before any response starts (always an HTTP 400);
4. `check_engine(request, prompt_token_ids, ...)`: what vLLM's engine refuses when the request
   reaches it. vLLM adds a request lazily, on the stream's first read, so for a streamed
   request these come after the 200, as the stream's last event (`ApiError.stream_event`)
   before `[DONE]`.

Messages are vLLM's, parameter suffixes included. Sampling values are checked as vLLM checks
them although the simulated engine never samples. Left out: vLLM's checks of structured-output
grammars and schemas against its backends (no constrained decoding here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from engined.openai.api_errors import ApiError, validation_error
from engined.openai.protocol import ChatCompletionRequest, CompletionRequest

MAX_N_SEQUENCES: Final = 16384
MAX_LOGPROBS: Final = 20
MAX_LOGPROB_TOKEN_IDS: Final = 128
_SAMPLING_EPS: Final = 1e-5
_MAX_TEMP: Final = 1e-2

Request = CompletionRequest | ChatCompletionRequest


def requested_max_tokens(request: Request) -> tuple[int | None, str]:
    """The output budget a request asks for, and the field it asked in (for the messages)."""
    if isinstance(request, CompletionRequest):
        return request.max_tokens or 0, "max_tokens"
    if request.max_completion_tokens is not None:
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens, "max_tokens"


def effective_max_tokens(max_model_len: int, prompt_tokens: int, request: Request) -> int:
    """What the request may generate: its budget, cut to what the context leaves after the prompt
    (vLLM's `get_max_tokens`; no budget in a chat request means all that is left)."""
    requested = requested_max_tokens(request)[0]
    left = max_model_len - prompt_tokens
    return left if requested is None else min(left, requested)


def echo_only(request: Request) -> bool:
    """A completion that echoes its prompt with `max_tokens: 0`: vLLM generates one token for
    it, which the response leaves out."""
    return isinstance(request, CompletionRequest) and bool(request.echo) and request.max_tokens == 0


def _logit_bias_ids(request: Request) -> list[int]:
    if not request.logit_bias:
        return []
    ids: list[int] = []
    invalid: list[str] = []
    for key in request.logit_bias:
        try:
            ids.append(int(key))
        except ValueError:
            invalid.append(key)
    if invalid:
        message = (
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}"
        )
        raise validation_error(message, param="logit_bias", value=invalid)
    return ids


def _extra_args_in_range(request: Request) -> None:
    pending: list[object] = [
        request.vllm_xargs,
        request.kv_transfer_params,
        request.ec_transfer_params,
    ]
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            message = "extra_args integers must be between -2**63 and 2**64 - 1."
            raise validation_error(message, param="extra_args")
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


def _n(request: Request) -> int:
    return 1 if request.n is None else request.n


def _temperature(request: Request) -> float:
    temperature = 1.0 if request.temperature is None else request.temperature
    return max(temperature, _MAX_TEMP) if 0 < temperature < _MAX_TEMP else temperature


def _check_penalties(request: Request) -> None:
    presence = 0.0 if request.presence_penalty is None else request.presence_penalty
    if not -2.0 <= presence <= 2.0:
        raise validation_error(f"presence_penalty must be in [-2, 2], got {presence}.")
    frequency = 0.0 if request.frequency_penalty is None else request.frequency_penalty
    if not -2.0 <= frequency <= 2.0:
        raise validation_error(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    repetition = 1.0 if request.repetition_penalty is None else request.repetition_penalty
    if not math.isfinite(repetition):
        raise validation_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise validation_error(f"repetition_penalty must be greater than zero, got {repetition}.")


def _check_distribution(request: Request, temperature: float) -> None:
    if not math.isfinite(temperature):
        message = f"temperature must be a finite number, got {temperature}."
        raise validation_error(message, param="temperature", value=temperature)
    if temperature < 0.0:
        message = f"temperature must be non-negative, got {temperature}."
        raise validation_error(message, param="temperature", value=temperature)
    if temperature > 2.0:
        message = f"temperature must be in [0, 2], got {temperature}."
        raise validation_error(message, param="temperature", value=temperature)
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 < top_p <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {top_p}.", param="top_p", value=top_p)
    top_k = 0 if request.top_k is None else request.top_k
    if top_k < -1:
        raise validation_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if request.min_p is None else request.min_p
    if not 0.0 <= min_p <= 1.0:
        raise validation_error(f"min_p must be in [0, 1], got {min_p}.")


def _check_lengths(request: Request, max_tokens: int) -> None:
    if max_tokens < 1:
        message = f"max_tokens must be at least 1, got {max_tokens}."
        raise validation_error(message, param="max_tokens", value=max_tokens)
    if request.min_tokens < 0:
        message = f"min_tokens must be greater than or equal to 0, got {request.min_tokens}."
        raise validation_error(message)
    if request.min_tokens > max_tokens:
        message = (
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {request.min_tokens}."
        )
        raise validation_error(message)


def check_sampling(request: Request, max_tokens: int) -> None:
    """vLLM's `SamplingParams` checks, with `max_tokens` from `effective_max_tokens`."""
    if echo_only(request):
        max_tokens = 1
    _logit_bias_ids(request)
    n = _n(request)
    if n < 1:
        raise validation_error(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        message = (
            f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
        raise validation_error(message)
    _extra_args_in_range(request)
    _check_penalties(request)
    temperature = _temperature(request)
    _check_distribution(request, temperature)
    _check_lengths(request, max_tokens)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if any(not s for s in stop):
        raise validation_error("stop cannot contain an empty string.")
    bad_words = list(dict.fromkeys(request.bad_words))
    if any(not word for word in bad_words):
        message = f"bad_words cannot contain an empty string. Got bad_words={bad_words}"
        raise validation_error(message)
    if temperature < _SAMPLING_EPS and n > 1:
        raise validation_error(f"n must be 1 when using greedy sampling, got {n}.")


def sample_logprobs(request: Request) -> int | None:
    """How many top logprobs each generated token carries (vLLM's `SamplingParams.logprobs`)."""
    if isinstance(request, CompletionRequest):
        return None if request.logprob_token_ids else request.logprobs
    if request.logprobs and not request.logprob_token_ids:
        return request.top_logprobs
    return None


def _prompt_logprobs(request: Request) -> int | None:
    if request.prompt_logprobs is not None or not request.echo:
        return request.prompt_logprobs
    if isinstance(request, CompletionRequest):
        return request.logprobs
    return request.top_logprobs


def _check_logprobs(request: Request, vocab_size: int, max_logprobs: int) -> None:
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    count = sample_logprobs(request)
    if count:
        count = vocab_size if count == -1 else count
        if count > limit:
            message = (
                f"Requested sample logprobs of {count}, which is greater than max allowed: {limit}"
            )
            raise validation_error(message, param="logprobs", value=count)
    ids = request.logprob_token_ids
    if ids:
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            message = (
                f"Requested logprob_token_ids of length {len(ids)}, which is greater than max "
                f"allowed: {MAX_LOGPROB_TOKEN_IDS}"
            )
            raise validation_error(message, param="logprob_token_ids", value=len(ids))
        _check_vocab(ids, "logprob_token_ids", vocab_size)
    prompt = _prompt_logprobs(request)
    if prompt:
        prompt = vocab_size if prompt == -1 else prompt
        if prompt > limit:
            message = (
                f"Requested prompt logprobs of {prompt}, which is greater than max allowed: {limit}"
            )
            raise validation_error(message, param="prompt_logprobs", value=prompt)


def _check_vocab(ids: Sequence[int], field: str, vocab_size: int) -> None:
    invalid = [i for i in ids if i < 0 or i >= vocab_size]
    if invalid:
        message = (
            f"token_id(s) {invalid} in {field} contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}"
        )
        raise validation_error(message, param=field, value=invalid)


def _check_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    length = len(prompt_token_ids)
    if length == 0:
        raise validation_error("The decoder prompt cannot be empty")
    if length > max_model_len:
        message = (
            f"The decoder prompt (length {length}) is longer than the maximum model length of "
            f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of "
            "text tokens."
        )
        raise validation_error(message)
    if length == max_model_len:
        message = (
            f"The decoder prompt (length {length}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {max_model_len}. Make sure "
            "that `max_model_len` is no smaller than the number of text tokens (prompt + "
            "requested output tokens)."
        )
        raise validation_error(message)
    lowest, highest = min(prompt_token_ids), max(prompt_token_ids)
    if lowest < 0:
        raise validation_error(f"Token id {lowest} is out of vocabulary")
    if highest >= vocab_size:
        raise validation_error(f"Token id {highest} is out of vocabulary")


def check_engine(
    request: Request,
    prompt_token_ids: Sequence[int],
    *,
    max_model_len: int,
    vocab_size: int,
    max_logprobs: int = MAX_LOGPROBS,
    speculative: bool = False,
) -> None:
    """What vLLM's engine refuses as it adds the request (one prompt of it)."""
    _check_logprobs(request, vocab_size, max_logprobs)
    _check_vocab(_logit_bias_ids(request), "logit_bias", vocab_size)
    _check_vocab(list(dict.fromkeys(request.stop_token_ids or [])), "stop_token_ids", vocab_size)
    allowed = request.allowed_token_ids
    if allowed is not None:
        if not allowed:
            message = "allowed_token_ids is not None and empty!"
            raise validation_error(message, param="allowed_token_ids", value=allowed)
        invalid = [i for i in allowed if i < 0 or i >= vocab_size]
        if invalid:
            message = "allowed_token_ids contains out-of-vocab token id!"
            raise validation_error(message, param="allowed_token_ids", value=invalid)
    min_p = 0.0 if request.min_p is None or _temperature(request) < _SAMPLING_EPS else request.min_p
    if speculative and (min_p > _SAMPLING_EPS or request.logit_bias):
        raise validation_error(
            "The min_p and logit_bias sampling parameters are not yet supported with "
            "speculative decoding."
        )
    if request.thinking_token_budget is not None:
        raise validation_error(
            "thinking_token_budget is set but reasoning_config is not configured. Please set "
            "--reasoning-parser and/or --reasoning-config to use thinking_token_budget."
        )
    _check_prompt(prompt_token_ids, max_model_len, vocab_size)


def _bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def check_completion_prompt(request: CompletionRequest) -> None:
    """What vLLM refuses of a completion's prompt before tokenizing it, this engine being a
    model without fill-in-the-middle rendering and without prompt embeddings enabled.

    (A streamed beam search is refused earlier still, before the model check:
    `errors.beam_search_stream`.)
    """
    if request.suffix is not None:
        if request.echo:
            raise _bad_request("Echo is unsupported with suffix.", "suffix")
        if request.prompt_embeds is not None:
            raise _bad_request("suffix is not supported with prompt_embeds", "suffix")
        if request.truncate_prompt_tokens is not None:
            raise _bad_request("suffix is not supported with truncate_prompt_tokens", "suffix")
        prompt = request.prompt
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
        ):
            message = "suffix is only supported for models with FIM completion rendering"
            raise _bad_request(message, "suffix")
        raise _bad_request(
            "suffix requires text prompt input for FIM completion rendering", "suffix"
        )
    if request.prompt_embeds is not None:
        if request.echo:
            raise _bad_request("Echo is unsupported with prompt embeds.")
        if request.prompt_logprobs is not None:
            raise _bad_request("prompt_logprobs is not compatible with prompt embeds.")
        message = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
        raise validation_error(message, param="prompt_embeds")
