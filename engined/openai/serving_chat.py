"""`POST /v1/chat/completions`, streaming and not, as vLLM 0.33 serves it.

The messages become one prompt through the model's chat template (rendered as transformers
renders it), tokenized without special tokens since the template writes them; then one
engine request per sample. A stream opens each choice with a `role` delta, as vLLM does,
`echo` repeats the last message when it has the answering role, and each choice closes
with its finish reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import msgspec

from engined.openai.api_errors import ApiError
from engined.openai.choice_steps import Choice, steps
from engined.openai.generation import Generation
from engined.openai.http.http_messages import (
    HttpRequest,
    HttpResponse,
    StreamingResponse,
)
from engined.openai.logprobs import chat_logprobs
from engined.openai.protocol import ChatCompletionRequest, decode_chat_request
from engined.openai.protocol_responses import (
    ENCODE,
    SSE_DONE,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    chat_echo_chunk,
    chat_finish_choice,
    chat_role_chunk,
    chat_usage_chunk,
    continuous_usage,
    final_stream_usage,
    sse,
    usage,
)
from engined.openai.protocol_sampling import sample_logprobs
from engined.openai.serving import (
    ServingContext,
    base_request_id,
    check_template_trust,
    created_now,
    refused_stream,
    samples,
    stop_strings,
)
from engined.openai.text import ChoiceText
from engined.openai.tokenizer import ChatTemplateError


@dataclass(slots=True)
class _Choice(Choice):
    logprobs: list[ChatCompletionLogProbsContent] = field(default_factory=list)


class ChatServer:
    def __init__(self, context: ServingContext) -> None:
        self._context = context

    async def create(self, http: HttpRequest) -> HttpResponse | StreamingResponse:
        context = self._context
        request = decode_chat_request(http.body, http.headers.get("content-type"))
        served = context.models.check(request.model)
        context.admission.check(request.n or 1)
        check_template_trust(request)
        messages = [msgspec.to_builtins(message) for message in request.messages]
        tools = None if request.tools is None else msgspec.to_builtins(request.tools)
        try:
            prompt = context.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=tools,
                documents=request.documents,
                chat_template_kwargs=request.chat_template_kwargs,
            )
        except ChatTemplateError as error:
            raise ApiError(400, str(error), "BadRequestError") from None
        ids = context.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
        ids = context.truncate(request, ids)
        max_tokens = context.check_prompt(request, ids, from_text=True)
        request_id = f"chatcmpl-{base_request_id(http.headers, request.request_id)}"
        runs = samples(
            request,
            request_id,
            prompt_index=None,
            ids=ids,
            max_tokens=max_tokens,
            first_choice=0,
            lora=served.lora,
        )
        try:
            generation = await context.generate(request, runs, [ids])
        except ApiError as error:
            return refused_stream(request, error, chat=True)
        stop = stop_strings(request)
        choices = [
            _Choice(
                index=sample.choice_index,
                text=ChoiceText(
                    context.tokenizer.detokenizer(ids),
                    stop=stop,
                    include_stop=request.include_stop_str_in_output,
                ),
            )
            for sample in runs
        ]
        # vLLM's `get_chat_request_role`.
        role = context.response_role if request.add_generation_prompt else messages[-1]["role"]
        echo = ""
        if request.echo and messages and messages[-1].get("role") == role:
            echo = _content_text(messages[-1].get("content"))
        run = _Run(
            context, request, request_id, created_now(), served.name, ids, choices, role, echo
        )
        if request.stream:
            return context.event_stream(run.stream(generation), generation.close)
        return await run.collect(generation)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part if isinstance(part, str) else str(part.get("text", ""))
            for part in content
            if isinstance(part, str | dict)
        )
    return ""


@dataclass(slots=True)
class _Run:
    context: ServingContext
    request: ChatCompletionRequest
    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    choices: list[_Choice]
    role: str
    echo: str

    def _logprobs(
        self, choice: _Choice, ids: list[int], first: int
    ) -> ChatCompletionLogProbs | None:
        k = sample_logprobs(self.request)
        if k is None:
            return None
        tokenizer = self.context.tokenizer
        return chat_logprobs(
            ids,
            first,
            k,
            key=choice.index,
            vocab_size=tokenizer.vocab_size,
            decode=tokenizer.logprob_tokens,
            as_token_ids=self.context.logprob_tokens_as_ids(self.request),
        )

    def _cached(self, generation: Generation) -> tuple[int | None, int | None]:
        if not self.context.prompt_tokens_details:
            return None, None
        cached = generation.cached_tokens[0] if generation.cached_tokens else None
        return cached, self.context.created_cache_tokens(len(self.prompt_ids), cached)

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        include_usage, continuous = self.context.usage_in_stream(self.request)
        token_ids = bool(self.request.return_token_ids)
        prompt_tokens = len(self.prompt_ids)
        try:
            for choice in self.choices:
                opening = chat_role_chunk(
                    self.request_id,
                    self.created,
                    self.model,
                    choice.index,
                    self.role,
                    prompt_token_ids=self.prompt_ids if token_ids else None,
                )
                if continuous:
                    opening.usage = continuous_usage(prompt_tokens, 0, chat=True)
                yield sse(ENCODE(opening))
            if self.echo:
                for choice in self.choices:
                    echoed = chat_echo_chunk(
                        self.request_id, self.created, self.model, choice.index, self.echo
                    )
                    if continuous:
                        echoed.usage = continuous_usage(prompt_tokens, 0, chat=True)
                    yield sse(ENCODE(echoed))
            progress = steps(generation, self.choices)
            async with contextlib.aclosing(progress):
                async for step in progress:
                    choice, text, ids, first = step.choice, step.text, step.ids, step.first
                    logprobs = self._logprobs(choice, ids, first)
                    message = DeltaMessage(content=text) if text else DeltaMessage()
                    if choice.finish_reason is not None:
                        streamed = chat_finish_choice(
                            choice.index,
                            message,
                            choice.finish_reason,
                            logprobs=logprobs,
                            stop_reason=choice.stop_reason,
                            token_ids=ids if token_ids else None,
                            weight_versions=choice.weight_versions()
                            if self.request.return_weight_versions
                            else None,
                        )
                    elif not text and logprobs is None and not token_ids:
                        continue
                    else:
                        streamed = ChatCompletionResponseStreamChoice(
                            index=choice.index,
                            delta=message,
                            logprobs=logprobs,
                            token_ids=ids if token_ids else None,
                        )
                    chunk = ChatCompletionStreamResponse(
                        id=self.request_id,
                        created=self.created,
                        model=self.model,
                        choices=[streamed],
                        kv_transfer_params=generation.kv_transfer_params
                        if choice.finish_reason is not None
                        else None,
                    )
                    if continuous:
                        chunk.usage = continuous_usage(prompt_tokens, choice.tokens, chat=True)
                    yield sse(ENCODE(chunk))
            if include_usage:
                completion = sum(choice.tokens for choice in self.choices)
                cached, created = self._cached(generation)
                final = final_stream_usage(prompt_tokens, completion, cached, created)
                yield sse(
                    ENCODE(chat_usage_chunk(self.request_id, self.created, self.model, final, None))
                )
        except ApiError as error:
            yield error.stream_event(chat=True)
        finally:
            await generation.close()
        yield SSE_DONE

    async def collect(self, generation: Generation) -> HttpResponse:
        try:
            progress = steps(generation, self.choices)
            async with contextlib.aclosing(progress):
                async for step in progress:
                    choice, text, ids, first = step.choice, step.text, step.ids, step.first
                    choice.all_text.append(text)
                    choice.all_ids.extend(ids)
                    logprobs = self._logprobs(choice, ids, first)
                    if logprobs is not None and logprobs.content:
                        choice.logprobs.extend(logprobs.content)
        finally:
            await generation.close()
        completion = sum(choice.tokens for choice in self.choices)
        cached, created = self._cached(generation)
        token_ids = bool(self.request.return_token_ids)
        wants_logprobs = sample_logprobs(self.request) is not None
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                ChatCompletionResponseChoice(
                    index=choice.index,
                    message=ChatMessage(
                        role=self.role, content=self.echo + "".join(choice.all_text)
                    ),
                    logprobs=ChatCompletionLogProbs(content=choice.logprobs)
                    if wants_logprobs
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
            usage=usage(len(self.prompt_ids), completion, cached, created),
            prompt_token_ids=self.prompt_ids if token_ids else None,
            kv_transfer_params=generation.kv_transfer_params,
        )
        return HttpResponse(200, ENCODE(response))
