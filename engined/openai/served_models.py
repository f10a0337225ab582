"""The models one API server process serves, as vLLM 0.33's `OpenAIServingModels` keeps them:
the base model's names and the LoRA adapters; `GET /v1/models`, `POST /v1/load_lora_adapter`
and `POST /v1/unload_lora_adapter`; and what a request's `model` names (vLLM's
`_check_model` and `_maybe_get_adapters`).

Adapters belong to the process, as in vLLM, where each API server process builds its own
`OpenAIServingModels`. The static ones (`lora_modules`, vLLM's `--lora-modules`) are loaded
at start, in their order, through the checks of a runtime load, and numbered by a counter
from 1, so every process numbers them alike; that number is the `lora_int_id` the daemon's
scheduler counts against `max_loras` and its KV events publish as `lora_id`. The runtime
routes exist only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`, which vLLM refuses with more than
one API server process (`check_startup`), so no process lacks an adapter another has. With
it, a request for a model neither served nor loaded takes a number too, as vLLM's
`resolve_lora` takes one before it finds no resolver, so later loads get vLLM's numbers.

With `VLLM_LORA_RESOLVER_CACHE_DIR` too, such a model is looked up by vLLM's filesystem
resolver (engined.openai.lora_resolver) and, when found, loaded under that number and served.

The daemon loads no weights: a path is never read, only passed on with the adapter (it keys
the adapter's KV blocks), so vLLM's 404 for a path without an adapter never happens here.
Without `engine.enable_lora` a load fails as vLLM's engine fails it (500), once it has taken
its number, so the daemon is never sent an adapter it would refuse. One refusal is engined's
own: a name or a path longer than the control protocol carries (256 and 4,096 bytes of
UTF-8), which the daemon would refuse on every request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import structlog

from engined.config import ConfigError, DaemonConfig
from engined.config.lora_modules import LoraModule, parse_lora_modules, runtime_lora_updating
from engined.openai.api_errors import ApiError, model_not_found
from engined.openai.http.http_messages import HttpRequest, HttpResponse
from engined.openai.lora_resolver import FilesystemResolver, filesystem_resolver
from engined.openai.protocol import decode_load_lora_request, decode_unload_lora_request
from engined.openai.protocol_responses import ENCODE, ModelList, model_card
from engined.wire.constraints import LORA_NAME_MAX_BYTES, LORA_PATH_MAX_BYTES
from engined.wire.control import WireLoraRequest

log = structlog.get_logger(__name__)

# What vLLM's engine answers `add_lora` without `--enable-lora` (the worker's RuntimeError,
# as the engine core's utility call reports it), and its error type.
NOT_ENABLED: Final = (
    "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA."
)
_INVALID: Final = "InvalidUserInput"


@dataclass(frozen=True, slots=True)
class Served:
    """What a request's `model` names: the name its responses carry, and the adapter its
    engine requests run with (None: the base model)."""

    name: str
    lora: WireLoraRequest | None = None


@dataclass(frozen=True, slots=True)
class _Adapter:
    request: WireLoraRequest
    # The served name `/v1/models` gives as its parent; None: the first served name.
    base_model_name: str | None


class ServedModels:
    """The served names (`names[0]` the one responses carry) and this process's adapters."""

    def __init__(
        self,
        names: Sequence[str],
        root: str,
        max_model_len: int,
        *,
        enable_lora: bool,
        runtime_updating: bool,
        static: Sequence[LoraModule] = (),
        resolver: FilesystemResolver | None = None,
    ) -> None:
        """`resolver`: asked, with `runtime_updating`, for a model neither served nor loaded.

        Raises ApiError: a static adapter vLLM would not load (it would not start)."""
        self.names = tuple(names)
        self.root = root
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load and unload routes exist.
        self.runtime_updating = runtime_updating
        self._resolver = resolver
        self._adapters: dict[str, _Adapter] = {}
        self._last_id = 0
        for module in static:
            self.load(module.name, module.path, base_model_name=module.base_model_name)

    @classmethod
    def of(
        cls,
        config: DaemonConfig,
        *,
        root: str,
        max_model_len: int,
        env: Mapping[str, str] = os.environ,
        with_resolver: bool = True,
    ) -> ServedModels:
        """The process's models: `config`'s names and static adapters; `env` holds vLLM's
        VLLM_ALLOW_RUNTIME_LORA_UPDATING and its resolver's variables (the daemon's
        environment, which the process has).

        Raises:
            ApiError: a static adapter vLLM would not load.
            ConfigError: the resolver's cache directory is not a directory.
        """
        return cls(
            (config.model_name, *config.model_aliases),
            root,
            max_model_len,
            enable_lora=config.engine.enable_lora,
            runtime_updating=runtime_lora_updating(env),
            static=parse_lora_modules(config.lora_modules),
            resolver=filesystem_resolver(env) if with_resolver else None,
        )

    def check(self, requested: str | None) -> Served:
        """What `requested` names, in vLLM's order: nothing or a served name is the base
        model (answered as the first name), then the adapters, then (with runtime updating)
        an adapter the resolver finds, loaded now; else vLLM's 404.

        Raises:
            ApiError: 404, the model is neither served nor loaded nor found; vLLM's 400 for
                one found that cannot be loaded; 500, its adapter_config.json is malformed.
        """
        if not requested or requested in self.names:
            return Served(self.names[0])
        adapter = self._adapters.get(requested)
        if adapter is not None:
            return Served(requested, adapter.request)
        if self.runtime_updating:
            # vLLM's resolve_lora numbers the adapter before it asks its resolvers.
            self._last_id += 1
            path = None if self._resolver is None else self._resolver.resolve(self.root, requested)
            if path is not None:
                return self._resolved(requested, path)
        raise model_not_found(requested, self.names)

    def _resolved(self, name: str, path: str) -> Served:
        """A resolved adapter, loaded under the number just taken (vLLM's `add_lora`).

        Raises:
            ApiError: vLLM's 400 when it cannot be loaded (no `enable_lora`; here also a name
                or path longer than the daemon takes).
        """
        problem = NOT_ENABLED if not self.enable_lora else _over_bounds(name, path)
        if problem is not None:
            log.warning("resolved LoRA adapter not loaded", lora_name=name, problem=problem)
            message = f"LoRA adapter '{name}' was found but could not be loaded."
            raise ApiError(400, message, "BadRequestError")
        request = WireLoraRequest(lora_name=name, lora_int_id=self._last_id, lora_path=path)
        self._adapters[name] = _Adapter(request, None)
        log.info(
            "Resolved and loaded LoRA adapter",
            lora_name=name,
            lora_path=path,
            lora_int_id=request.lora_int_id,
            resolver="FilesystemResolver",
        )
        return Served(name, request)

    def load(
        self,
        name: str,
        path: str,
        *,
        inplace: bool = False,
        base_model_name: str | None = None,
    ) -> str:
        """vLLM's `load_lora_adapter`: checked, numbered (a reload in place keeps its number
        and takes the new path), then added; its success text.

        Raises:
            ApiError: vLLM's 400 for a request its checks refuse, its 500 without
                `enable_lora`; engined's 400 for a name or path the daemon cannot take.
        """
        problem = self._load_problem(name, path, inplace=inplace)
        if problem is not None:
            raise ApiError(400, problem, _INVALID)
        previous = self._adapters.get(name)
        if previous is not None:
            lora_int_id = previous.request.lora_int_id
        else:
            self._last_id += 1
            lora_int_id = self._last_id
        if not self.enable_lora:
            raise ApiError(500, NOT_ENABLED, "InternalServerError")
        if previous is not None and previous.request.lora_path == path:
            # vLLM's warning: the daemon keys blocks by name and path, so they are shared too.
            log.warning(
                "LoRA adapter reloaded in place from the same path: its cached blocks stay "
                "matchable; load changed weights from a new path",
                lora_name=name,
                lora_path=path,
            )
        request = WireLoraRequest(lora_name=name, lora_int_id=lora_int_id, lora_path=path)
        base = base_model_name if base_model_name in self.names else None
        self._adapters[name] = _Adapter(request, base)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _load_problem(self, name: str, path: str, *, inplace: bool) -> str | None:
        if not name or not path:
            return "Both 'lora_name' and 'lora_path' must be provided."
        if name in self.names:
            return f"The lora adapter '{name}' conflicts with a served base model."
        if not inplace and name in self._adapters:
            return (
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        return _over_bounds(name, path)

    def unload(self, name: str) -> str:
        """vLLM's `unload_lora_adapter`; its success text. The number is not reused.

        Raises:
            ApiError: vLLM's 400 for no name, its 404 for a name not loaded.
        """
        if not name:
            raise ApiError(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", _INVALID
            )
        if name not in self._adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self._adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self) -> ModelList:
        """`/v1/models`: a card per served name, then one per adapter in the order loaded,
        its `root` the adapter's path, its `parent` the served name it was loaded for, and no
        `max_model_len` (vLLM gives adapters none)."""
        created = int(time.time())
        cards = [model_card(name, self.root, self.max_model_len, created) for name in self.names]
        cards.extend(
            model_card(
                adapter.request.lora_name,
                adapter.request.lora_path,
                None,
                created,
                parent=adapter.base_model_name or self.names[0],
            )
            for adapter in self._adapters.values()
        )
        return ModelList(data=cards)

    async def models_route(self, http: HttpRequest) -> HttpResponse:
        return HttpResponse(200, ENCODE(self.cards()))

    def adapters(self) -> list[WireLoraRequest]:
        """The adapters loaded, in their order."""
        return [adapter.request for adapter in self._adapters.values()]

    async def load_route(self, http: HttpRequest) -> HttpResponse:
        request = decode_load_lora_request(http.body, http.headers.get("content-type"))
        text = self.load(request.lora_name, request.lora_path, inplace=request.load_inplace)
        loaded = self._adapters[request.lora_name].request
        log.info(
            "LoRA adapter loaded",
            lora_name=loaded.lora_name,
            lora_path=loaded.lora_path,
            lora_int_id=loaded.lora_int_id,
        )
        return _text(text)

    async def unload_route(self, http: HttpRequest) -> HttpResponse:
        request = decode_unload_lora_request(http.body, http.headers.get("content-type"))
        text = self.unload(request.lora_name)
        log.info("LoRA adapter removed", lora_name=request.lora_name)
        return _text(text)


def _over_bounds(name: str, path: str) -> str | None:
    """engined's own refusal: a name or path longer than the control protocol carries."""
    for field, text, limit in (
        ("lora_name", name, LORA_NAME_MAX_BYTES),
        ("lora_path", path, LORA_PATH_MAX_BYTES),
    ):
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            return (
                f"'{field}' is {size} bytes of UTF-8: engined serves adapters whose "
                f"{field} is at most {limit} bytes."
            )
    return None


def _text(message: str) -> HttpResponse:
    """vLLM's `Response(status_code=200, content=message)`: the text, with no media type."""
    return HttpResponse(200, message.encode(), content_type="")


def check_startup(config: DaemonConfig, env: Mapping[str, str]) -> None:
    """What vLLM refuses as its API servers start, refused by `engined serve` before the
    daemon starts: VLLM_ALLOW_RUNTIME_LORA_UPDATING with several API server processes (whose
    adapters would drift apart), a LoRA resolver directory that is not one, and a static
    adapter its first API server would not load.

    Raises:
        ConfigError: naming `api_server_count`, the resolver's variable or `lora_modules`,
            with vLLM's words.
    """
    if config.api_port is not None and config.api_server_count > 1 and runtime_lora_updating(env):
        raise ConfigError(
            "api_server_count: VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with "
            f"api_server_count > 1, as in vLLM (each process would load its own adapters), "
            f"got {config.api_server_count}",
            key="api_server_count",
        )
    if config.api_port is not None:
        # vLLM's resolver plugin refuses to load, and vLLM to start, without its directory.
        filesystem_resolver(env)
    try:
        ServedModels.of(config, root="", max_model_len=0, env=env, with_resolver=False)
    except ApiError as error:
        raise ConfigError(
            f"lora_modules: vLLM's API server would not start: {error.message}",
            key="lora_modules",
        ) from None
