"""The routes of vLLM 0.33's OpenAI-compatible server, over one daemon connection.

`ApiApp.handle` is the HTTP server's handler: it checks the API key where vLLM does, routes,
and turns every `ApiError` into vLLM's JSON error body and status; anything else a handler
raises is a 500 with the same shape (logged once), so no request can end the process.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import unquote

import structlog

from engined.admission_counters import AdmissionCounters
from engined.client import EngineClient, EngineError
from engined.config import DaemonConfig
from engined.config.api_keys import BearerKeys
from engined.openai.api_errors import (
    ApiError,
    engine_dead,
    http_error,
    method_not_allowed,
    route_not_found,
)
from engined.openai.cors import CorsPolicy
from engined.openai.http.http_messages import HttpRequest, HttpResponse, StreamingResponse
from engined.openai.server_load import ServerLoad
from engined.openai.serving import ServingContext, engine_refusal
from engined.openai.serving_chat import ChatServer
from engined.openai.serving_completion import CompletionServer
from engined.openai.serving_dev import DevServer
from engined.openai.serving_misc import MiscServer
from engined.openai.tokenizer import Tokenizer
from engined.wire.control import Welcome

log = structlog.get_logger(__name__)

Reply = HttpResponse | StreamingResponse
Route = Callable[[HttpRequest], Awaitable[Reply]]

_NOT_FOUND = route_not_found()
_NOT_ALLOWED = method_not_allowed()
# vLLM's refusal, byte for byte (engined.server.ops.http_endpoint sends the same).
_UNAUTHORIZED = HttpResponse(401, b'{"error":"Unauthorized"}')


class ApiApp:
    def __init__(
        self,
        *,
        config: DaemonConfig,
        client: EngineClient,
        welcome: Welcome,
        tokenizer: Tokenizer,
        counters: AdmissionCounters,
        operator: EngineClient | None = None,
    ) -> None:
        """`operator`: the daemon connection with the operator role that vLLM's development
        routes need; None leaves them out (`VLLM_SERVER_DEV_MODE` unset)."""
        context = ServingContext.build(
            config=config, client=client, welcome=welcome, tokenizer=tokenizer, counters=counters
        )
        models = context.models
        self.model_names = models.names
        self._context = context
        self._keys = BearerKeys(tuple(config.api_key or ()), guard_metrics=config.api_key_metrics)
        self._request_id_headers = config.enable_request_id_headers
        self._cors = CorsPolicy(
            config.allowed_origins,
            config.allowed_methods,
            config.allowed_headers,
            config.allow_credentials,
        )
        completions = CompletionServer(context)
        chat = ChatServer(context)
        misc = MiscServer(context, config=config, welcome=welcome)
        load = ServerLoad(config.enable_server_load_tracking)
        self._routes: dict[str, dict[str, Route]] = {
            "/v1/completions": {"POST": load.track(completions.create)},
            "/v1/chat/completions": {"POST": load.track(chat.create)},
            "/load": {"GET": load.load},
            "/v1/models": {"GET": models.models_route},
            "/health": {"GET": misc.health},
            "/ping": {"GET": misc.health, "POST": misc.health},
            "/version": {"GET": misc.version},
            "/tokenize": {"POST": misc.tokenize},
            "/detokenize": {"POST": misc.detokenize},
            "/metrics": {"GET": misc.metrics},
            "/kv_event_sources": {"GET": misc.kv_event_sources},
        }
        if operator is not None:
            for path, methods in DevServer(operator, context.in_flight).routes().items():
                self._routes[path] = {method: route for method, route in methods.items()}
        for adapter in models.adapters():
            log.info(
                "LoRA adapter loaded",
                lora_name=adapter.lora_name,
                lora_path=adapter.lora_path,
                lora_int_id=adapter.lora_int_id,
            )
        if models.runtime_updating:
            # vLLM attaches these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING (else 404).
            self._routes["/v1/load_lora_adapter"] = {"POST": models.load_route}
            self._routes["/v1/unload_lora_adapter"] = {"POST": models.unload_route}
            log.warning(
                "LoRA dynamic loading & unloading is enabled in the API server. "
                "This should ONLY be used for local development!"
            )

    async def handle(self, request: HttpRequest) -> Reply:
        reply = await self._handle(request)
        if not self._request_id_headers:
            return reply
        # vLLM's XRequestIdMiddleware, outside its authentication: every answer of the app,
        # refusals included, carries the request's id, or a fresh one.
        request_id = request.headers.get("x-request-id")
        if request_id is None:
            request_id = uuid.uuid4().hex
        return dataclasses.replace(reply, headers=(*reply.headers, ("x-request-id", request_id)))

    async def _handle(self, request: HttpRequest) -> Reply:
        path = unquote(request.path)
        if not self._keys.authorized(
            request.method, path, request.headers.get("authorization", "")
        ):
            return _UNAUTHORIZED
        # vLLM's CORS middleware, inside its authentication (which lets OPTIONS through).
        answer = self._cors.preflight(request)
        if answer is not None:
            return answer
        return self._cors.answer(request, await self._route(request, path))

    async def _route(self, request: HttpRequest, path: str) -> Reply:
        methods = self._routes.get(path)
        if methods is None:
            return _answer(_NOT_FOUND)
        route = methods.get(request.method)
        if route is None:
            # Starlette's 405 names the route's methods (FastAPI adds no HEAD to a GET).
            allow = (("allow", ", ".join(sorted(methods))),)
            return HttpResponse(_NOT_ALLOWED.status, _NOT_ALLOWED.body(), headers=allow)
        try:
            return await route(request)
        except ApiError as error:
            return _answer(error)
        except EngineError as error:
            return _answer(engine_refusal(error))
        except (TimeoutError, ConnectionError):
            log.warning("daemon did not answer", path=path)
            return _answer(engine_dead())

    async def close(self) -> None:
        """Close the connections to prefill daemons this server pulled KV from."""
        await self._context.disagg.handoffs.close()

    def error_response(self, status: int, message: str) -> HttpResponse:
        """vLLM's error body for `status`: the HTTP server's own refusals (its ErrorFactory)."""
        return _answer(http_error(status, message))


def _answer(error: ApiError) -> HttpResponse:
    return HttpResponse(error.status, error.body())
