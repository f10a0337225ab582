"""What every OpenAI endpoint shares: the served model, the tokenizer, vLLM's checks, the ids.

One `ServingContext` per API server process, built from the daemon's `welcome` and the
configuration; the endpoints get it at construction and never reach past it. The checks run
in vLLM 0.33's order (engined/openai/protocol_sampling.py says which): the model, the prompt,
the context, the sampling parameters, then what vLLM's engine refuses as it adds a request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from engined.admission_counters import AdmissionCounters
from engined.client import EngineClient, EngineError
from engined.client.handoff_coordinator import Coordinator
from engined.config import DaemonConfig
from engined.openai.api_errors import (
    ApiError,
    GenerationFailure,
    context_length_error,
    engine_overloaded,
    generation_paused,
    http_error,
    validation_error,
)
from engined.openai.disagg import Disaggregation, advertised, parse_role
from engined.openai.generation import CALL_TIMEOUT_S, Generation, Sample, Transfer
from engined.openai.http.http_messages import ClosingBody, StreamingResponse
from engined.openai.in_flight import InFlight
from engined.openai.protocol import ChatCompletionRequest, CompletionRequest
from engined.openai.protocol_responses import SSE_DONE
from engined.openai.protocol_sampling import (
    check_engine,
    check_sampling,
    effective_max_tokens,
    requested_max_tokens,
)
from engined.openai.queue_admission import Admission
from engined.openai.served_models import ServedModels
from engined.openai.sse_keep_alive import with_keep_alive
from engined.openai.tokenizer import Tokenizer
from engined.wire.constraints import KvCacheReportMode
from engined.wire.control import Welcome, WireLoraRequest

Request = CompletionRequest | ChatCompletionRequest

# vLLM's refusal of a request that brings its own chat template (`--trust-request-chat-
# template` is off by default): a template is code, run on the server.
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def engine_refusal(error: EngineError) -> ApiError:
    """A refusal by the daemon, as the error a vLLM client meets for the same condition."""
    if error.code in ("overloaded", "shutting_down"):
        return engine_overloaded()
    if error.code == "paused":
        # The daemon's message is vLLM's ("Generation is paused. Please retry after it resumes.").
        return generation_paused(error.message)
    if error.code in ("invalid_request", "capacity", "duplicate_request", "unsupported"):
        return validation_error(error.message)
    return http_error(500, error.message)


def refused_stream(request: Request, error: ApiError, *, chat: bool) -> StreamingResponse:
    """The answer to a streamed request whose generation the engine refused (paused).

    vLLM adds the request, and its engine answers with an error output, which the stream
    generator meets at its first step: the client gets the 200, then the error event and
    `[DONE]`. Anything else refused before the stream starts is raised again.
    """
    if not (request.stream and isinstance(error, GenerationFailure)):
        raise error

    async def events() -> AsyncGenerator[bytes, None]:
        yield error.stream_event(chat=chat)
        yield SSE_DONE

    return StreamingResponse(200, events())


@dataclass(frozen=True, slots=True)
class ServingContext:
    client: EngineClient
    tokenizer: Tokenizer
    # The served names and this process's LoRA adapters: what a request's `model` names.
    models: ServedModels
    max_model_len: int
    block_size: int
    prefix_caching: bool
    prompt_tokens_details: bool
    max_logprobs: int
    stream_interval: int
    speculative: bool
    disagg: Disaggregation
    admission: Admission
    # The running requests, by vLLM's external ids (`/abort_requests`).
    in_flight: InFlight
    # vLLM's --enable-force-include-usage.
    force_include_usage: bool
    # vLLM's --return-tokens-as-token-ids: a request's field overrides it.
    tokens_as_ids: bool
    # vLLM's --response-role.
    response_role: str
    # vLLM's --sse-keep-alive-interval (seconds; 0 = none).
    keep_alive_s: int

    @classmethod
    def build(
        cls,
        *,
        config: DaemonConfig,
        client: EngineClient,
        welcome: Welcome,
        tokenizer: Tokenizer,
        counters: AdmissionCounters,
    ) -> ServingContext:
        """Raises ApiError: a static LoRA adapter vLLM would not load (`engined serve`
        refuses it before the daemon starts)."""
        max_model_len = welcome.max_model_len or config.engine.max_model_len or 0
        return cls(
            client=client,
            tokenizer=tokenizer,
            # `root`: the model as the server was started with it, as vLLM's cards give it.
            models=ServedModels.of(
                config, root=config.model or tokenizer.name, max_model_len=max_model_len
            ),
            max_model_len=max_model_len,
            block_size=welcome.block_size,
            prefix_caching=bool(welcome.enable_prefix_caching),
            prompt_tokens_details=config.enable_prompt_tokens_details,
            max_logprobs=config.max_logprobs,
            stream_interval=config.stream_interval,
            speculative=config.engine.aic_nextn is not None,
            disagg=Disaggregation(
                handoffs=Coordinator(client, EngineClient.connect),
                advertised=advertised(config.control_endpoint),
                block_size=welcome.block_size,
                speedup_ratio=welcome.speedup_ratio or config.engine.speedup_ratio,
            ),
            admission=Admission(
                max_requests=config.max_num_queued_reqs,
                max_tokens=config.max_num_queued_tokens,
                counters=counters,
            ),
            in_flight=InFlight(client, timeout=CALL_TIMEOUT_S),
            force_include_usage=config.enable_force_include_usage,
            tokens_as_ids=config.return_tokens_as_token_ids,
            response_role=config.response_role,
            keep_alive_s=config.sse_keep_alive_interval,
        )

    def usage_in_stream(self, request: Request) -> tuple[bool, bool]:
        """vLLM's `should_include_usage`: whether a stream ends with a usage chunk, and
        whether every chunk carries usage too (both with `--enable-force-include-usage`)."""
        if self.force_include_usage:
            return True, True
        options = request.stream_options
        include = options is not None and bool(options.include_usage)
        return include, include and options is not None and bool(options.continuous_usage_stats)

    def logprob_tokens_as_ids(self, request: Request) -> bool:
        """Whether logprobs name tokens by id: the request's `return_tokens_as_token_ids`,
        else the server's flag."""
        asked = request.return_tokens_as_token_ids
        return self.tokens_as_ids if asked is None else asked

    def event_stream(
        self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
    ) -> StreamingResponse:
        """A generation's SSE response: its events, with vLLM's keep-alive comments while
        idle, `on_close` run however it ends."""
        return StreamingResponse(
            200, ClosingBody(with_keep_alive(events, self.keep_alive_s), on_close)
        )

    def stream_interval_of(self, request: Request) -> int:
        """vLLM's: the request's `stream_interval`, never below the server's."""
        asked = request.stream_interval
        return self.stream_interval if asked is None else max(asked, self.stream_interval)

    def truncate(self, request: Request, ids: list[int]) -> list[int]:
        """`truncate_prompt_tokens` as vLLM applies it: the first or last N tokens
        (`truncation_side`, else the tokenizer's side), -1 for the context less one token."""
        keep = request.truncate_prompt_tokens
        if keep is None or keep > self.max_model_len:
            return ids  # the second one is refused by check_prompt, with vLLM's message
        if keep < 0:
            keep = self.max_model_len - 1
        if keep >= len(ids):
            return ids
        side = request.truncation_side or self.tokenizer.truncation_side
        return ids[len(ids) - keep :] if side == "left" else ids[:keep]

    def check_prompt(self, request: Request, ids: Sequence[int], *, from_text: bool) -> int:
        """vLLM's checks of one tokenized prompt; returns the max_tokens it runs with."""
        requested, field = requested_max_tokens(request)
        error = context_length_error(
            self.max_model_len,
            len(ids),
            requested,
            max_tokens_param=field,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            from_text=from_text,
        )
        if error is not None:
            raise error
        max_tokens = effective_max_tokens(self.max_model_len, len(ids), request)
        check_sampling(request, max_tokens)
        check_engine(
            request,
            ids,
            max_model_len=self.max_model_len,
            vocab_size=self.tokenizer.vocab_size,
            max_logprobs=self.max_logprobs,
            speculative=self.speculative,
        )
        return max_tokens

    def transfer(self, request: Request, prompts: int) -> Transfer | None:
        """The request's part in a handoff (`kv_transfer_params`), if any: one prompt, one
        sample, as a handoff moves one sequence."""
        role = parse_role(request.kv_transfer_params)
        if role is None:
            return None
        if (request.n or 1) != 1:
            raise validation_error(
                "n must be 1 for a request with kv_transfer_params", param="n", value=request.n
            )
        if prompts != 1:
            raise validation_error(
                "a request with kv_transfer_params takes exactly one prompt", param="prompt"
            )
        return Transfer(self.disagg, role)

    async def generate(
        self, request: Request, runs: list[Sample], prompts: Sequence[list[int]]
    ) -> Generation:
        """The request's engine requests (`runs`, `n` for each of `prompts`), admitted as
        vLLM adds them (its second admission check) and submitted.

        Raises:
            ApiError: what vLLM answers for a refusal by the admission or the engine.
        """
        transfer = self.transfer(request, len(prompts))
        tickets = self.admission.admit([len(ids) for ids in prompts], request.n or 1)
        generation = Generation(
            self.client,
            runs,
            transfer,
            stream_interval=self.stream_interval_of(request),
            tickets=tickets,
            in_flight=self.in_flight,
        )
        try:
            await generation.start()
        except EngineError as error:
            raise engine_refusal(error) from None
        return generation

    def created_cache_tokens(self, prompt_tokens: int, cached: int | None) -> int | None:
        """vLLM's `num_cache_creation_tokens`: the prompt's full blocks it cached itself."""
        if cached is None:
            return None
        if not self.prefix_caching:
            return 0
        full = prompt_tokens // self.block_size * self.block_size
        return max(0, min(full, prompt_tokens) - cached)


def check_template_trust(request: ChatCompletionRequest) -> None:
    kwargs = request.chat_template_kwargs or {}
    if request.chat_template is not None or kwargs.get("chat_template") is not None:
        raise validation_error(UNTRUSTED_TEMPLATE)


def base_request_id(headers: Mapping[str, str], given: str | None) -> str:
    """vLLM's: the `X-Request-Id` header, else the body's `request_id`, else a fresh uuid."""
    header = headers.get("x-request-id")
    if header:
        return header
    return given or uuid.uuid4().hex


def samples(
    request: Request,
    request_id: str,
    *,
    prompt_index: int | None,
    ids: list[int],
    max_tokens: int,
    first_choice: int,
    lora: WireLoraRequest | None = None,
) -> list[Sample]:
    """The engine requests of one prompt: vLLM's `{request}-{prompt}` id for completions, its
    ParentRequest's `{j}_{...}` child ids when n > 1, and seed + j for sample j; each runs
    with the adapter the request's `model` names (`lora`), as vLLM's `lora_request`."""
    n = request.n or 1
    item = request_id if prompt_index is None else f"{request_id}-{prompt_index}"
    stop_ids = tuple(dict.fromkeys(request.stop_token_ids or ()))
    # vLLM reads the key from `extra_args` and reports in full only for "full".
    xargs = request.vllm_xargs or {}
    full = xargs.get("kv_cache_report_mode") == "full"
    report: KvCacheReportMode = "full" if full else "incremental"
    return [
        Sample(
            request_id=item if n == 1 else f"{j}_{item}",
            choice_index=first_choice + j,
            prompt_ids=ids,
            max_tokens=max_tokens,
            seed=None if request.seed is None else request.seed + j,
            priority=request.priority,
            stop_token_ids=stop_ids,
            min_tokens=request.min_tokens,
            cache_salt=request.cache_salt,
            lora_request=lora,
            kv_cache_report_mode=report,
            external_id=None if n == 1 else item,
            parallel=n > 1,
        )
        for j in range(n)
    ]


def stop_strings(request: Request) -> tuple[str, ...]:
    stop = request.stop
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop or ())


def created_now() -> int:
    return int(time.time())
