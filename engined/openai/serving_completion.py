"""`POST /v1/completions`, streaming and not, as vLLM 0.33 serves it.

Each prompt (a string, token ids, or a list of either) runs as its own engine request, n
times; choice `i * n + j` is sample j of prompt i. Text comes from the model's incremental
detokenizer, `stop` strings finish a choice as vLLM's output processor does, and usage
counts each prompt once and every sample's tokens. A streamed request that fails after its
200 ends with vLLM's error event, then `[DONE]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from engined.openai.api_errors import ApiError
from engined.openai.choice_steps import Choice, Step, steps
from engined.openai.generation import Generation
from engined.openai.http.http_messages import (
    HttpRequest,
    HttpResponse,
    StreamingResponse,
)
from engined.openai.logprobs import completion_logprobs
from engined.openai.protocol import CompletionRequest, decode_completion_request
from engined.openai.protocol_responses import (
    ENCODE,
    SSE_DONE,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    completion_usage_chunk,
    continuous_usage,
    final_stream_usage,
    sse,
    usage,
)
from engined.openai.protocol_sampling import check_completion_prompt, echo_only, sample_logprobs
from engined.openai.serving import (
    ServingContext,
    base_request_id,
    created_now,
    refused_stream,
    samples,
    stop_strings,
)
from engined.openai.text import ChoiceText


@dataclass(slots=True)
class _Choice(Choice):
    prompt: int = 0
    text_offset: int = 0
    echoed: bool = False


class CompletionServer:
    def __init__(self, context: ServingContext) -> None:
        self._context = context

    async def create(self, http: HttpRequest) -> HttpResponse | StreamingResponse:
        context = self._context
        request = decode_completion_request(http.body, http.headers.get("content-type"))
        served = context.models.check(request.model)
        context.admission.check(request.n or 1)
        check_completion_prompt(request)
        tokenizer = context.tokenizer
        prompts: list[tuple[str | None, list[int]]] = []
        for prompt in _prompt_list(request):
            if isinstance(prompt, str):
                ids = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
                prompts.append((prompt, ids))
            else:
                prompts.append((None, list(prompt)))
        request_id = f"cmpl-{base_request_id(http.headers, request.request_id)}"
        n = request.n
        runs = []
        for i, (text, whole) in enumerate(prompts):
            ids = context.truncate(request, whole)
            prompts[i] = (text if ids is whole else None, ids)
            max_tokens = context.check_prompt(request, ids, from_text=text is not None)
            runs.extend(
                samples(
                    request,
                    request_id,
                    prompt_index=i,
                    ids=ids,
                    max_tokens=1 if echo_only(request) else max_tokens,
                    first_choice=i * n,
                    lora=served.lora,
                )
            )
        try:
            generation = await context.generate(request, runs, [ids for _, ids in prompts])
        except ApiError as error:
            return refused_stream(request, error, chat=False)
        stop = stop_strings(request)
        choices = [
            _Choice(
                index=sample.choice_index,
                prompt=sample.choice_index // n,
                text=ChoiceText(
                    tokenizer.detokenizer(sample.prompt_ids),
                    stop=stop,
                    include_stop=request.include_stop_str_in_output,
                ),
            )
            for sample in runs
        ]
        run = _Run(context, request, request_id, created_now(), served.name, prompts, choices)
        if request.stream:
            return context.event_stream(run.stream(generation), generation.close)
        return await run.collect(generation)


@dataclass(slots=True)
class _Run:
    """One request's choices on their way to the client."""

    context: ServingContext
    request: CompletionRequest
    request_id: str
    created: int
    model: str
    prompts: list[tuple[str | None, list[int]]]
    choices: list[_Choice]

    def _prompt_text(self, index: int) -> str:
        text, ids = self.prompts[index]
        return text if text is not None else self.context.tokenizer.decode(ids)

    def _chunk(
        self, step: Step[_Choice]
    ) -> tuple[str, list[int], CompletionLogProbs | None] | None:
        """What a step sends: text, token ids (with the echoed prompt first) and their
        logprobs; None when it adds nothing (vLLM sends no empty chunk)."""
        choice, text, ids = step.choice, step.text, step.ids
        if echo_only(self.request):
            text, ids = "", []
        echoed: list[int] = []
        if self.request.echo and not choice.echoed:
            choice.echoed = True
            echoed = self.prompts[choice.prompt][1]
            text = self._prompt_text(choice.prompt) + text
        elif not text and not ids and choice.finish_reason is None:
            return None
        return text, [*echoed, *ids], self._logprobs(choice, echoed, ids, step.first)

    def _logprobs(
        self, choice: _Choice, echoed: list[int], ids: list[int], first: int
    ) -> CompletionLogProbs | None:
        k = sample_logprobs(self.request)
        if k is None:
            return None
        tokenizer = self.context.tokenizer
        logprobs = completion_logprobs(
            [*echoed, *ids],
            first - len(echoed),
            k,
            key=choice.index,
            vocab_size=tokenizer.vocab_size,
            decode=tokenizer.logprob_tokens,
            text_offset=choice.text_offset,
            first_is_none=bool(echoed),
            as_token_ids=self.context.logprob_tokens_as_ids(self.request),
        )
        if logprobs.tokens:
            choice.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return logprobs

    def _counts(self) -> tuple[int, int]:
        return sum(len(ids) for _, ids in self.prompts), sum(c.tokens for c in self.choices)

    def _cached(self, generation: Generation) -> int | None:
        """vLLM reports the first result's cached tokens, with --enable-prompt-tokens-details."""
        if not self.context.prompt_tokens_details:
            return None
        cached = generation.cached_tokens
        return cached[0] if cached else None

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        include_usage, continuous = self.context.usage_in_stream(self.request)
        token_ids = bool(self.request.return_token_ids)
        versions = self.request.return_weight_versions
        try:
            progress = steps(generation, self.choices)
            async with contextlib.aclosing(progress):
                async for step in progress:
                    sent = self._chunk(step)
                    if sent is None:
                        continue
                    choice, (text, ids, logprobs) = step.choice, sent
                    chunk = CompletionStreamResponse(
                        id=self.request_id,
                        created=self.created,
                        model=self.model,
                        choices=[
                            CompletionResponseStreamChoice(
                                index=choice.index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=choice.finish_reason,
                                stop_reason=choice.stop_reason,
                                token_ids=ids if token_ids else None,
                                weight_versions=choice.weight_versions()
                                if versions and choice.finish_reason is not None
                                else None,
                            )
                        ],
                        kv_transfer_params=generation.kv_transfer_params
                        if choice.finish_reason is not None
                        else None,
                    )
                    if continuous:
                        chunk.usage = continuous_usage(
                            len(self.prompts[choice.prompt][1]), choice.tokens, chat=False
                        )
                    yield sse(ENCODE(chunk))
            if include_usage:
                prompt_tokens, completion_tokens = self._counts()
                final = final_stream_usage(
                    prompt_tokens, completion_tokens, self._cached(generation)
                )
                yield sse(
                    ENCODE(
                        completion_usage_chunk(
                            self.request_id, self.created, self.model, final, None
                        )
                    )
                )
        except ApiError as error:
            yield error.stream_event(chat=False)
        finally:
            await generation.close()
        yield SSE_DONE

    async def collect(self, generation: Generation) -> HttpResponse:
        logprobs: list[list[CompletionLogProbs]] = [[] for _ in self.choices]
        try:
            progress = steps(generation, self.choices)
            async with contextlib.aclosing(progress):
                async for step in progress:
                    sent = self._chunk(step)
                    if sent is None:
                        continue
                    text, ids, chunk_logprobs = sent
                    step.choice.all_text.append(text)
                    step.choice.all_ids.extend(ids)
                    if chunk_logprobs is not None:
                        logprobs[step.choice.index].append(chunk_logprobs)
        finally:
            await generation.close()
        prompt_tokens, completion_tokens = self._counts()
        token_ids = bool(self.request.return_token_ids)
        response = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionResponseChoice(
                    index=choice.index,
                    text="".join(choice.all_text),
                    logprobs=_joined(logprobs[choice.index])
                    if sample_logprobs(self.request) is not None
                    else None,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    token_ids=choice.all_ids if token_ids else None,
                    weight_versions=choice.weight_versions()
                    if self.request.return_weight_versions
                    else None,
                )
                for choice in self.choices
            ],
            usage=usage(prompt_tokens, completion_tokens, self._cached(generation)),
            kv_transfer_params=generation.kv_transfer_params,
        )
        return HttpResponse(200, ENCODE(response))


def _joined(parts: list[CompletionLogProbs]) -> CompletionLogProbs:
    return CompletionLogProbs(
        text_offset=[o for part in parts for o in part.text_offset],
        token_logprobs=[lp for part in parts for lp in part.token_logprobs],
        tokens=[t for part in parts for t in part.tokens],
        top_logprobs=[t for part in parts for t in part.top_logprobs],
    )


def _prompt_list(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a request: one string or id list, or a list of either."""
    prompt = request.prompt
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(item, int) for item in prompt):
        return [[item for item in prompt if isinstance(item, int)]]
    return [item if isinstance(item, str) else list(item) for item in prompt]  # type: ignore[arg-type]
