"""vLLM 0.33's development routes for RL loops: pause, resume, sleep, wake up, reset the cache.

`vllm serve` attaches them only when `VLLM_SERVER_DEV_MODE` is set to a non-zero integer
(vllm/entrypoints/launchers/api_server/routers.py); without it they are FastAPI's 404. They
are vLLM's `/pause`, `/resume`, `/is_paused` (vllm/entrypoints/rl/online/api_router.py),
`/sleep`, `/release_kv_cache_memory`, `/wake_up`, `/is_sleeping`
(entrypoints/serve/dev/sleep/api_router.py), `/reset_prefix_cache`, `/reset_mm_cache` and
`/reset_encoder_cache` (entrypoints/serve/dev/cache/api_router.py; engined has no multimodal
or encoder cache, so the last two reset nothing, as vLLM's do for a text-only model), and
the RL router's `/update_weight_version`, `/weight_info` and `/get_world_size`
(vllm/entrypoints/rl/online/api_router.py; engined has one GPU per rank: no tensor or
pipeline parallelism), carried out by the daemon's engine-wide control messages, which need
the operator role: the API server sends them on its operator connection
(engined.openai.process). The RL router's `/abort_requests`
cancels this process's own requests (engined.openai.in_flight) on its ordinary connection.

Their query parameters are validated as FastAPI does (the last value of a repeated one
counts, pydantic's lax rules) and a refusal is vLLM's 400 for a `RequestValidationError`.
`is_paused` and `is_sleeping` are vLLM's DP client's consensus over the ranks: ranks that
disagree (a pause not yet applied everywhere) are vLLM's `RuntimeError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Final, TypeVar
from urllib.parse import parse_qsl

import msgspec
import msgspec.inspect as mi
import structlog

from engined.client import EngineClient, EngineError
from engined.openai.api_errors import (
    BAD_REQUEST,
    ApiError,
    Errors,
    http_error,
    request_validation_error,
)
from engined.openai.http.http_messages import HttpRequest, HttpResponse
from engined.openai.in_flight import InFlight
from engined.openai.protocol_json import read_body
from engined.openai.protocol_lax import FAIL, register_literals, validate_struct
from engined.wire.constraints import PauseModeStr
from engined.wire.messages import RankStats

log = structlog.get_logger(__name__)

DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"

T = TypeVar("T", bound=msgspec.Struct)


def dev_mode(env: Mapping[str, str]) -> bool:
    """vLLM's reading of `VLLM_SERVER_DEV_MODE`: `bool(int(value))`. vLLM fails at start on
    a value that is no integer; here such a value leaves the routes off, with a warning."""
    value = env.get(DEV_MODE_ENV, "0")
    try:
        return bool(int(value))
    except ValueError:
        log.warning("not an integer: development routes stay off", variable=DEV_MODE_ENV)
        return False


def dev_mode_from_environment() -> bool:
    return dev_mode(os.environ)


class PauseQuery(msgspec.Struct):
    mode: PauseModeStr = "abort"
    clear_cache: bool = True


class SleepQuery(msgspec.Struct):
    level: Annotated[int, msgspec.Meta(ge=0, le=2)] = 1
    mode: PauseModeStr = "abort"


class ResetQuery(msgspec.Struct):
    reset_running_requests: bool = False
    reset_external: bool = False


class WorldSizeQuery(msgspec.Struct):
    include_dp: bool = True


for _query_type in (PauseQuery, SleepQuery, ResetQuery, WorldSizeQuery):
    register_literals(_query_type)


def parse_query(query: str, t: type[T]) -> T:
    """The query parameters of `t`, as FastAPI reads them.

    Raises:
        ApiError: vLLM's 400 for the parameters pydantic refuses.
    """
    # Starlette's QueryParams: blank values kept, the last of a repeated name wins.
    raw: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
    info = mi.type_info(t)
    assert isinstance(info, mi.StructType)
    errors = Errors()
    result = validate_struct(raw, info, ("query",), errors)
    if result is FAIL:
        raise request_validation_error(errors)
    assert isinstance(result, t)
    return result


def _json(content: object, status: int = 200) -> HttpResponse:
    return HttpResponse(status, msgspec.json.encode(content))


def _consensus(ranks: list[RankStats], method: str, of: Callable[[RankStats], bool]) -> bool:
    """vLLM's `call_utility_consensus_async`: every rank's answer, which must agree.

    Raises:
        RuntimeError: vLLM's, for ranks that answered differently.
    """
    results = [of(rank) for rank in ranks]
    if any(result != results[0] for result in results):
        raise RuntimeError(f"Engines returned different {method} results: {results}")
    return results[0]


def _paused(rank: RankStats) -> bool:
    """EngineCore.is_scheduler_paused: any pause state."""
    return rank.pause_state != 0


def _sleeping(rank: RankStats) -> bool:
    """EngineCore.is_sleeping: paused, or a pool asleep."""
    return _paused(rank) or bool(rank.sleeping_tags)


def _failed_call(method: str, error: EngineError) -> ApiError:
    """vLLM's 500 for an engine utility call that raised (EngineCore's failure message)."""
    return ApiError(500, f"Call to {method} method failed: {error.message}", "InternalServerError")


class DevServer:
    """The routes, over the API server's operator connection (and its own requests)."""

    def __init__(self, operator: EngineClient, in_flight: InFlight) -> None:
        self._operator = operator
        self._in_flight = in_flight

    def routes(self) -> dict[str, dict[str, Callable[[HttpRequest], Awaitable[HttpResponse]]]]:
        return {
            "/pause": {"POST": self.pause},
            "/resume": {"POST": self.resume},
            "/is_paused": {"GET": self.is_paused},
            "/abort_requests": {"POST": self.abort_requests},
            "/sleep": {"POST": self.sleep},
            "/release_kv_cache_memory": {"POST": self.release_kv_cache_memory},
            "/wake_up": {"POST": self.wake_up},
            "/is_sleeping": {"GET": self.is_sleeping},
            "/reset_prefix_cache": {"POST": self.reset_prefix_cache},
            "/reset_mm_cache": {"POST": _nothing_to_reset},
            "/reset_encoder_cache": {"POST": _nothing_to_reset},
            "/update_weight_version": {"POST": self.update_weight_version},
            "/weight_info": {"GET": self.weight_info},
            "/get_world_size": {"GET": self.get_world_size},
        }

    async def pause(self, request: HttpRequest) -> HttpResponse:
        query = parse_query(request.query, PauseQuery)
        try:
            # No deadline: vLLM's call returns once every rank's pause completed.
            await self._operator.pause(query.mode, query.clear_cache, timeout=None)
        except EngineError as error:
            log.error("failed to pause generation", code=error.code, message=error.message)
            return _json({"error": f"Failed to pause generation: {error.message}"}, 500)
        return _json({"status": "paused"})

    async def resume(self, request: HttpRequest) -> HttpResponse:
        try:
            await self._operator.resume()
        except EngineError as error:
            log.error("failed to resume generation", code=error.code, message=error.message)
            return _json({"error": f"Failed to resume generation: {error.message}"}, 500)
        return _json({"status": "resumed"})

    async def is_paused(self, request: HttpRequest) -> HttpResponse:
        stats = await self._operator.stats()
        try:
            paused = _consensus(stats.ranks, "is_scheduler_paused", _paused)
        except RuntimeError as error:
            return _json({"error": f"Failed to fetch pause status: {error}"}, 500)
        return _json({"is_paused": paused})

    async def abort_requests(self, request: HttpRequest) -> HttpResponse:
        """vLLM's abort without a pause: the requests `request_ids` names (vLLM's external
        ids), or every request of this process when it names none; their streams end with
        `abort`. The count is vLLM's: the ids given (a string's characters, as vLLM's
        `len` counts them), else what it aborted."""
        ids = _abort_body(request.body).get("request_ids")
        try:
            if not ids:
                count = await self._in_flight.abort(None)
            elif isinstance(ids, (str, list, dict)):
                # vLLM's AsyncLLM.abort takes a string as one id and lists any other iterable;
                # an id that is no string names no request.
                named = [ids] if isinstance(ids, str) else [i for i in ids if isinstance(i, str)]
                await self._in_flight.abort(frozenset(named))
                count = len(ids)
            else:
                # A truthy number: vLLM's `list(request_ids)` fails.
                failure = f"'{type(ids).__name__}' object is not iterable"
                return _json({"error": f"Failed to abort requests: {failure}"}, 500)
        except EngineError as error:
            log.error("failed to abort requests", code=error.code, message=error.message)
            return _json({"error": f"Failed to abort requests: {error.message}"}, 500)
        return _json({"status": "aborted", "aborted": count})

    async def sleep(self, request: HttpRequest) -> HttpResponse:
        query = parse_query(request.query, SleepQuery)
        await self._operator.sleep(query.level, query.mode, timeout=None)
        return _json({"status": "sleeping", "level": query.level})

    async def release_kv_cache_memory(self, request: HttpRequest) -> HttpResponse:
        try:
            await self._operator.release_kv_cache_memory()
        except EngineError as error:
            # vLLM's RuntimeError (no completed pause, a pool asleep), as its engine client
            # raises a failed utility call, through its handler of any other exception.
            raise _failed_call("release_kv_cache_memory", error) from None
        return _json({"status": "kv_cache_released"})

    async def wake_up(self, request: HttpRequest) -> HttpResponse:
        pairs = parse_qsl(request.query, keep_blank_values=True)
        tags = [value for name, value in pairs if name == "tags"] or None
        stats = await self._operator.wake_up(tags)
        # vLLM's `all(...)` of every engine's `not model_executor.is_sleeping`.
        awake = all(not rank.sleeping_tags for rank in stats.ranks)
        return _json({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(self, request: HttpRequest) -> HttpResponse:
        stats = await self._operator.stats()
        try:
            sleeping = _consensus(stats.ranks, "is_sleeping", _sleeping)
        except RuntimeError as error:
            # vLLM's handler of any other exception.
            raise ApiError(500, str(error), "InternalServerError") from None
        return _json({"is_sleeping": sleeping})

    async def reset_prefix_cache(self, request: HttpRequest) -> HttpResponse:
        # `reset_external` resets a KV connector's cache; with none, vLLM's reset of it is a
        # success that changes nothing.
        query = parse_query(request.query, ResetQuery)
        reset_running = query.reset_running_requests
        try:
            await self._operator.reset_prefix_cache(reset_running_requests=reset_running)
        except EngineError as error:
            if error.code != "invalid_request":
                raise
            if reset_running:
                # vLLM's scheduler raises instead (blocks a P/D hold keeps).
                raise _failed_call("reset_prefix_cache", error) from None
            return _json({"success": False})
        return _json({"success": True})

    async def update_weight_version(self, request: HttpRequest) -> HttpResponse:
        version = _new_version(request.body, request.headers.get("content-type"))
        try:
            await self._operator.set_weight_version(version)
        except EngineError as error:
            if error.code != "invalid_request":
                raise
            # engined's own bound on a label (the control protocol's); vLLM has none.
            raise ApiError(400, error.message, "Bad Request", "body.new_version") from None
        return _json({"success": True, "new_version": version})

    async def weight_info(self, request: HttpRequest) -> HttpResponse:
        # vLLM's DP client answers with its first engine's version.
        stats = await self._operator.stats()
        return _json({"weight_version": stats.ranks[0].weight_version})

    async def get_world_size(self, request: HttpRequest) -> HttpResponse:
        query = parse_query(request.query, WorldSizeQuery)
        stats = await self._operator.stats()
        # TP x PP is 1 here; with DP, one per rank.
        return _json({"world_size": len(stats.ranks) if query.include_dp else 1})


async def _nothing_to_reset(request: HttpRequest) -> HttpResponse:
    """vLLM's `Response(status_code=200)`: no body, no media type."""
    return HttpResponse(200, b"", content_type="")


def _abort_body(body: bytes) -> dict[str, Any]:
    """The body as vLLM's `/abort_requests` reads it: `json.loads` whatever its media type.

    Raises:
        ApiError: vLLM's answers: 400 for text that is no JSON or no object, its handlers'
            400 for a body `json` cannot decode (not UTF-8, an integer of over 4300 digits)
            and 500 for one nested too deep.
    """
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        raise http_error(400, "Invalid JSON format") from None
    except RecursionError as error:
        raise ApiError(500, str(error), "InternalServerError") from None
    except ValueError as error:
        raise ApiError(400, str(error), BAD_REQUEST) from None
    if not isinstance(parsed, dict):
        raise http_error(400, "Request body must be a JSON object")
    return parsed


def _new_version(body: bytes, content_type: str | None) -> str:
    """`new_version` of the body, as FastAPI's `Body(embed=True)` validates it.

    Raises:
        ApiError: vLLM's 400 for a missing or non-string label, or malformed JSON.
    """
    parsed = read_body(body, content_type)
    value = parsed.get("new_version") if isinstance(parsed, dict) else None
    if isinstance(value, str):
        return value
    errors = Errors()
    loc = ("body", "new_version")
    if value is None:
        errors.add("missing", loc, "Field required", None)
    else:
        errors.add("string_type", loc, "Input should be a valid string", value)
    raise request_validation_error(errors)
