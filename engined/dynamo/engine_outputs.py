"""What the worker answers per engine output: Dynamo's `LLMEngineOutput` chunks of a request's
choices, with the fields dynamo.vllm fills for `n`, `logprobs` and `prompt_logprobs`.

Dynamo 1.6.1's frontend hands the worker `sampling_options.n` / `best_of` and
`output_options.logprobs` / `prompt_logprobs` (an `echo` completion arrives as
`prompt_logprobs: 1`). dynamo.vllm passes them to vLLM and streams each sample's outputs under
its `index`, `log_probs` (the sampled tokens' logprobs) and `top_logprobs` (per token, the
sampled one and the top k as `{rank, token_id, token, logprob, bytes}`) on every chunk, and
`engine_data.prompt_logprobs` (per prompt position, None first, then `{token_id: {logprob,
rank}}`) on the last one. engined makes the values up with the one implementation its OpenAI
server uses (`engined.logprob_values`), keyed by the choice's index as there; the token text
is the frontend's (it decodes `token_id`). What engined cannot honour is a 400 naming the
field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from engined.logprob_values import PositionLogprobs, position_logprobs
from engined.wire.control import OutputEntry

Chunk = dict[str, Any]
# Dynamo's (and vLLM's) "every token of the vocabulary" for `logprobs` / `prompt_logprobs`.
FULL_VOCAB: Final = -1


class RequestFailed(Exception):
    """A request the worker or the daemon refused; `status` is the HTTP status the client
    should get."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def http_error(exc: RequestFailed) -> Exception:
    """The Dynamo exception that reaches the HTTP client with the daemon's message.

    Across the request plane Dynamo 1.6.1 keeps only an `HttpError`'s status, not its
    message; `InvalidArgument` keeps the message and answers 400, as dynamo.vllm raises
    for a request the engine refuses. Other statuses keep `HttpError`, so a 503 stays a 503.
    """
    try:
        from dynamo.llm.exceptions import HttpError, InvalidArgument
    except ImportError:  # pragma: no cover - the worker always runs with Dynamo
        return exc
    error: Exception = (
        InvalidArgument(exc.message)
        if 400 <= exc.status < 500
        else HttpError(exc.status, exc.message)
    )
    return error


def field_map(request: dict[str, Any], field: str) -> dict[str, Any]:
    """`request[field]` as a map (absent or null: empty); anything else is a 400."""
    value = request.get(field) or {}
    if not isinstance(value, dict):
        raise RequestFailed(400, f"{field}: expected a map, got {value!r}"[:200])
    return value


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How many samples the request wants and which logprobs come with them."""

    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None


def output_options(request: dict[str, Any]) -> OutputOptions:
    sampling = field_map(request, "sampling_options")
    output = field_map(request, "output_options")
    n = sampling.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise RequestFailed(400, f"sampling_options.n: expected an int >= 1, got {n!r}"[:200])
    best_of = sampling.get("best_of")
    if best_of is not None and best_of != n:
        # vLLM's V1 engine (the one dynamo.vllm drives) has no best_of either.
        raise RequestFailed(
            400, f"sampling_options.best_of: engined does not support best_of, got {best_of!r}"
        )
    if sampling.get("use_beam_search"):
        raise RequestFailed(400, "sampling_options.use_beam_search: engined has no beam search")
    return OutputOptions(n, _logprobs(output, "logprobs"), _logprobs(output, "prompt_logprobs"))


def _logprobs(output: dict[str, Any], name: str) -> int | None:
    value = output.get(name)
    if value is None:
        return None
    if not _is_int(value) or (value < 0 and value != FULL_VOCAB):
        raise RequestFailed(
            400, f"output_options.{name}: expected an int >= 0 or -1, got {value!r}"[:200]
        )
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Usage:
    """The request's `completion_usage`: its prompt once, the tokens of every choice."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens: int | None = None

    def add(self, entry: OutputEntry) -> None:
        self.completion_tokens += len(entry.token_ids)
        if self.cached_tokens is None and entry.cached_tokens is not None:
            self.cached_tokens = entry.cached_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0},
        }


def merge(batch: list[OutputEntry]) -> OutputEntry:
    """Entries that queued up while Dynamo had not asked for the next chunk, as one."""
    last = batch[-1]
    cached = next((e.cached_tokens for e in batch if e.cached_tokens is not None), None)
    delay = next(
        (e.handoff_delay_ms for e in reversed(batch) if e.handoff_delay_ms is not None), None
    )
    return OutputEntry(
        request_id=last.request_id,
        token_ids=[token for entry in batch for token in entry.token_ids],
        finished=last.finished,
        finish_reason=last.finish_reason,
        cached_tokens=cached,
        handoff_delay_ms=delay,
    )


class Choice:
    """One sample of a request on its way out: its index and how many tokens it has sent
    (the position of its next token's logprobs)."""

    def __init__(
        self,
        index: int,
        usage: Usage,
        options: OutputOptions,
        vocab_size: int,
        prompt: list[int],
    ) -> None:
        self.index = index
        self.usage = usage
        self.options = options
        self.vocab_size = vocab_size
        self.prompt = prompt
        self.sent = 0
        # The last `handoff_delay_ms` an entry carried: a prefill's `disaggregated_params`.
        self.handoff_delay_ms = 0.0

    def chunk(self, entry: OutputEntry) -> Chunk:
        self.usage.add(entry)
        if entry.handoff_delay_ms is not None:
            self.handoff_delay_ms = entry.handoff_delay_ms
        ids = entry.token_ids
        chunk: Chunk = {"token_ids": ids, "index": self.index}
        k = self.options.logprobs
        if k is not None and ids:
            positions = [self._position(t, self.sent + i, k) for i, t in enumerate(ids)]
            chunk["log_probs"] = [p.logprob for p in positions]
            chunk["top_logprobs"] = [_top(p) for p in positions]
        self.sent += len(ids)
        if entry.finished:
            if entry.finish_reason == "rejected":
                raise RequestFailed(
                    400, "engined rejected the request: it can never be scheduled on this engine"
                )
            chunk["finish_reason"] = entry.finish_reason
            chunk["completion_usage"] = self.usage.as_dict()
            if self.options.prompt_logprobs is not None:
                chunk["engine_data"] = {"prompt_logprobs": self._prompt_logprobs()}
        return chunk

    def _position(self, token_id: int, position: int, k: int) -> PositionLogprobs:
        width = self.vocab_size if k == FULL_VOCAB else k
        return position_logprobs(
            token_id, position, width, key=self.index, vocab_size=self.vocab_size
        )

    def _prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt logprobs: none for the first token (nothing precedes it), then the
        prompt token and the top k at each position (as an echoed prompt's in engined's
        OpenAI server: the positions before the output's first)."""
        k = self.options.prompt_logprobs
        assert k is not None
        prompt = self.prompt
        result: list[dict[str, dict[str, Any]] | None] = [None]
        for i in range(1, len(prompt)):
            at = self._position(prompt[i], i - len(prompt), k)
            result.append(
                {
                    str(token): {"logprob": lp, "rank": rank}
                    for (token, lp), rank in zip(at.entries, at.ranks, strict=True)
                }
            )
        return result


def _top(position: PositionLogprobs) -> list[dict[str, Any]]:
    """dynamo.vllm's `top_logprobs` entries of one token; `token` None: the frontend
    decodes the id."""
    return [
        {"rank": rank, "token_id": token, "token": None, "logprob": lp}
        for (token, lp), rank in zip(position.entries, position.ranks, strict=True)
    ]
