"""The small routes: health, version, tokenize, detokenize, metrics, KV event sources.

`/v1/models` is the served models' own (engined.openai.served_models).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engined.config import DaemonConfig
from engined.openai.api_errors import validation_error
from engined.openai.http.http_messages import HttpRequest, HttpResponse
from engined.openai.protocol import (
    TokenizeChatRequest,
    decode_detokenize_request,
    decode_tokenize_request,
)
from engined.openai.protocol_responses import (
    ENCODE,
    DetokenizeResponse,
    TokenizeResponse,
    VersionResponse,
)
from engined.openai.serving import ServingContext, check_template_trust

# The vLLM release whose API this server speaks (`GET /version`, as `vllm --version`).
VLLM_VERSION = "0.33.0"
HEALTH_TIMEOUT_S = 5.0


class MiscServer:
    def __init__(self, context: ServingContext, *, config: DaemonConfig, welcome: Any) -> None:
        self._context = context
        self._sources = _kv_event_sources(config, welcome)

    async def health(self, http: HttpRequest) -> HttpResponse:
        """200 while the daemon answers, 503 when it does not (vLLM: while the engine lives)."""
        try:
            await self._context.client.ping(timeout=HEALTH_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            return HttpResponse(503, b"", content_type="text/plain; charset=utf-8")
        return HttpResponse(200, b"", content_type="text/plain; charset=utf-8")

    async def version(self, http: HttpRequest) -> HttpResponse:
        return HttpResponse(200, ENCODE(VersionResponse(version=VLLM_VERSION)))

    async def tokenize(self, http: HttpRequest) -> HttpResponse:
        context = self._context
        request = decode_tokenize_request(http.body, http.headers.get("content-type"))
        # NOTE: an adapter's name is served here too; vLLM tokenizes with the base tokenizer.
        context.models.check(request.model)
        if isinstance(request, TokenizeChatRequest):
            if request.chat_template is not None:
                check_template_trust(request)  # type: ignore[arg-type]
            prompt = context.tokenizer.apply_chat_template(
                [msgspec.to_builtins(message) for message in request.messages],
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
            )
        else:
            prompt = request.prompt
        ids = context.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
        tokens = context.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        response = TokenizeResponse(
            count=len(ids), max_model_len=context.max_model_len, tokens=ids, token_strs=tokens
        )
        return HttpResponse(200, ENCODE(response))

    async def detokenize(self, http: HttpRequest) -> HttpResponse:
        context = self._context
        request = decode_detokenize_request(http.body, http.headers.get("content-type"))
        context.models.check(request.model)
        try:
            text = context.tokenizer.decode(request.tokens)
        except ValueError as error:
            raise validation_error(str(error)) from None
        return HttpResponse(200, ENCODE(DetokenizeResponse(prompt=text)))

    async def metrics(self, http: HttpRequest) -> HttpResponse:
        """The daemon's Prometheus exposition (every rank, vLLM's families and labels)."""
        reply = await self._context.client.metrics(accept=http.headers.get("accept"))
        return HttpResponse(200, reply.text.encode(), content_type=reply.content_type)

    async def kv_event_sources(self, http: HttpRequest) -> HttpResponse:
        return HttpResponse(200, self._sources)


def _kv_event_sources(config: DaemonConfig, welcome: Any) -> bytes:
    """vLLM's `GET /kv_event_sources`: each rank's KVEventsConfig, by dp rank.

    vLLM lists only enabled ZMQ publishers, so a daemon whose KV events are off
    (`kv_events_endpoint = ""`, no endpoint in `welcome`) answers `{}`, as vLLM does with
    `enable_kv_cache_events: false`.
    """
    replay = list(welcome.kv_replay_endpoints or [])
    sources = {
        str(rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay[rank] if rank < len(replay) else None,
            "buffer_steps": config.kv_replay_buffer,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": config.kv_events_topic,
        }
        for rank, endpoint in enumerate(welcome.kv_events_endpoints)
    }
    return msgspec.json.encode(sources)
