"""LoRA adapters in `engined dynamo-worker`, served as Dynamo 1.6.1's vLLM worker serves them.

A Dynamo user loads an adapter into a dynamo.vllm worker through its `load_lora` endpoint
(`{namespace}.{component}.load_lora`, beside `unload_lora` and `list_loras`, served only with
`--enable-lora`; its system server's `/v1/loras` calls the same endpoints), and from then on
the frontend lists the adapter as a model of its own and routes requests naming it to the
worker. This module is that worker's side (dynamo/vllm/handlers.py: `load_lora`,
`unload_lora`, `list_loras`, `_resolve_lora_request`, `_generate_with_lora_admission_lock`;
dynamo/vllm/lora_state.py), with the same request and reply shapes and messages:

- an adapter's id is Dynamo's `lora_name_to_id` of its name (a stable hash), so every worker
  numbers it alike and the daemon's KV events carry that `lora_id`;
- loading needs `DYN_LORA_ENABLED=true`, as Dynamo's LoRA manager does; re-loading a loaded
  name answers "already loaded" unless `DYN_LORA_HOTSWAP_ENABLED=true`, which replaces its
  path once its requests are done and clears the daemon's prefix cache, as Dynamo does;
- each loaded adapter gets a model card in discovery (`engined.dynamo.cards`) until unloaded;
  an unload waits for the adapter's requests to end, as a load's hot swap does;
- a request's `model` resolves to no adapter for the base model's names, to the loaded
  adapter's `lora_request` otherwise, and an unknown name is Dynamo's 400.

engined loads no weights, so nothing is downloaded or read. The path the daemon gets (and
hashes the adapter's blocks by) is the one dynamo.vllm would hand vLLM: a `file://` URI's
directory, which must exist (Dynamo's local source checks that much); for `s3://` and `hf://`
the cache directory Dynamo's downloader would fill (`DYN_LORA_PATH`), computed, not filled,
so no credentials or network are needed. Other schemes and bare paths are refused with
Dynamo's "not found in any source". The daemon's `welcome` does not say whether it has
`--enable-lora`: without it every request for an adapter gets the daemon's refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Final

import structlog

from engined.dynamo.engine_outputs import RequestFailed
from engined.wire.constraints import LORA_NAME_MAX_BYTES, LORA_PATH_MAX_BYTES
from engined.wire.control import WireLoraRequest

log = structlog.get_logger(__name__)

ENABLED_ENV: Final = "DYN_LORA_ENABLED"
HOTSWAP_ENV: Final = "DYN_LORA_HOTSWAP_ENABLED"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})  # Dynamo's env_bool
NOT_ENABLED: Final = (
    "LoRAManager not initialized. Set DYN_LORA_ENABLED=true to enable URI-based LoRA loading."
)
# The schemes Dynamo's downloader fetches (besides file://): here, where their files would go.
_REMOTE_SCHEMES: Final = frozenset({"s3", "hf"})

Reply = dict[str, Any]


def env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


class LoraRequestError(ValueError):
    """A malformed load or unload request; the message is Dynamo's, returned as the reply."""


def parse_load(request: Any) -> tuple[str, str]:
    """(lora_name, source.uri) of a `load_lora` request, checked as Dynamo checks it."""
    if not isinstance(request, Mapping):
        raise LoraRequestError("Request is required with 'lora_name' and 'source.uri'")
    name = request.get("lora_name")
    if not isinstance(name, str) or not name:
        raise LoraRequestError("'lora_name' is required and must be a string")
    source = request.get("source")
    if not source or not isinstance(source, Mapping):
        raise LoraRequestError("'source' object is required in request")
    uri = source.get("uri")
    if not isinstance(uri, str) or not uri:
        raise LoraRequestError("'source.uri' is required and must be a string")
    return name, uri


def parse_unload(request: Any) -> str:
    """The `lora_name` of an `unload_lora` request, checked as Dynamo checks it."""
    if not isinstance(request, Mapping):
        raise LoraRequestError("Request is required with 'lora_name' field")
    name = request.get("lora_name")
    if not isinstance(name, str) or not name:
        raise LoraRequestError("'lora_name' is required and must be a string")
    return name


def _too_long(name: str, path: str) -> str | None:
    """engined's own refusal: a name or path the control protocol cannot carry, which the
    daemon would refuse on every request for the adapter."""
    for field, value, limit in (
        ("lora_name", name, LORA_NAME_MAX_BYTES),
        ("lora_path", path, LORA_PATH_MAX_BYTES),
    ):
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > limit:
            return f"`{field}` must be at most {limit} bytes of UTF-8, got {size}"
    return None


def adapter_path(uri: str, cache_path: Callable[[str], str]) -> str:
    """The path dynamo.vllm would give vLLM for `uri`, found without reading or fetching.

    Raises:
        LoraRequestError: Dynamo's download failure for the URI.
    """
    failed = "Failed to download LoRA: Download failed: "
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not Path(path).is_dir():
            raise LoraRequestError(f"{failed}Local LoRA not found: {uri}")
        return path
    if uri.partition("://")[0] in _REMOTE_SCHEMES and "://" in uri:
        return cache_path(uri)
    raise LoraRequestError(f"{failed}LoRA {uri} not found in any source")


def dynamo_naming() -> tuple[Callable[[str], int], Callable[[str], str]]:
    """Dynamo's own adapter id (`lora_name_to_id`) and download cache path of a URI."""
    from dynamo.llm import LoRADownloader, lora_name_to_id

    downloader = LoRADownloader(None)

    def cache_path(uri: str) -> str:
        return str(downloader.get_cache_path(LoRADownloader.uri_to_cache_key(uri)))

    return lora_name_to_id, cache_path


class BaseModelOnly:
    """The adapters of a worker without `--enable-lora`: none, and every request's `model` is
    the base model, as dynamo.vllm resolves names without LoRA."""

    def admitted(
        self, model: str | None
    ) -> contextlib.AbstractAsyncContextManager[WireLoraRequest | None]:
        return contextlib.nullcontext(None)


BASE_MODEL_ONLY: Final = BaseModelOnly()


class LoraAdapters:
    """The adapters one worker serves: Dynamo's three endpoints and request admission.

    `publish(name, id)` and `withdraw(name)` put an adapter's model card in discovery and take
    it out; `reset_prefix_cache()` clears the daemon's cache after a hot swap. Load, unload and
    admission of one adapter are serialised by its lock, as in Dynamo: a request waiting on it
    while the adapter is unloaded gets the unknown-adapter error, never the base model.
    """

    def __init__(
        self,
        base_names: Collection[str],
        *,
        publish: Callable[[str, int], Awaitable[None]],
        withdraw: Callable[[str], Awaitable[None]],
        reset_prefix_cache: Callable[[], Awaitable[object]],
        naming: tuple[Callable[[str], int], Callable[[str], str]],
        env: Mapping[str, str],
    ) -> None:
        self._base_names = frozenset(base_names)
        self._publish = publish
        self._withdraw = withdraw
        self._reset_prefix_cache = reset_prefix_cache
        self._lora_id, self._cache_path = naming
        self._env = env
        # Dynamo's `_lora_enabled`: --enable-lora (this object exists) and its LoRA manager.
        self._enabled = env_flag(env, ENABLED_ENV)
        self._loaded: dict[str, WireLoraRequest] = {}
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._active: dict[str, int] = {}
        self._drained: dict[str, asyncio.Event] = {}

    # --- requests ---------------------------------------------------------------------------

    def resolve(self, model: str | None) -> WireLoraRequest | None:
        """The adapter a request's `model` names; None for the base model.

        Raises:
            RequestFailed: 400, a name that is neither (with LoRA loading enabled).
        """
        if not model or model in self._base_names:
            return None
        lora = self._loaded.get(model)
        if lora is None and self._enabled:
            raise RequestFailed(400, f"unknown model or LoRA adapter: '{model}'")
        return lora

    @contextlib.asynccontextmanager
    async def admitted(self, model: str | None) -> AsyncIterator[WireLoraRequest | None]:
        """The request's adapter, counted as in use (an unload or hot swap waits for it)
        until the context ends; looked up again under the adapter's lock, as it may have been
        unloaded or swapped while the request waited for it."""
        lora = self.resolve(model)
        if lora is None:
            yield None
            return
        name = lora.lora_name
        async with self._lock(name):
            admitted = self._loaded.get(name)
            if admitted is None:
                log.warning("LoRA adapter unloaded before admission", lora_name=name)
                raise RequestFailed(400, f"unknown model or LoRA adapter: '{name}'")
            if not self._active.get(name):
                self._drained[name] = asyncio.Event()
            self._active[name] = self._active.get(name, 0) + 1
        try:
            yield admitted
        finally:
            self._active[name] -= 1
            if not self._active[name]:
                del self._active[name]
                self._drained.pop(name).set()

    # --- the endpoints ----------------------------------------------------------------------

    async def load_lora(self, request: Any, context: Any = None) -> AsyncIterator[Reply]:
        """`load_lora`: `{"lora_name", "source": {"uri"}}` -> one status reply."""
        try:
            name, uri = parse_load(request)
        except LoraRequestError as exc:
            yield {"status": "error", "message": str(exc)}
            return
        try:
            async with self._lock(name):
                yield await self._load(name, uri)
        except Exception as exc:  # Dynamo's catch-all: the reply says what went wrong
            log.exception("loading the LoRA adapter failed", lora_name=name)
            yield {"status": "error", "message": str(exc)}

    async def _load(self, name: str, uri: str) -> Reply:
        old = self._loaded.get(name)
        if old is not None and not env_flag(self._env, HOTSWAP_ENV):
            log.info("LoRA adapter already loaded", lora_name=name, lora_id=old.lora_int_id)
            return {
                "status": "success",
                "message": f"LoRA adapter '{name}' already loaded",
                "lora_name": name,
                "lora_id": old.lora_int_id,
                "hot_swap": False,
            }
        if not self._enabled:
            return {"status": "error", "message": NOT_ENABLED}
        try:
            path = adapter_path(uri, self._cache_path)
        except LoraRequestError as exc:
            return {"status": "error", "message": str(exc)}
        too_long = _too_long(name, path)
        if too_long is not None:
            return {"status": "error", "message": too_long}
        lora_id = self._lora_id(name)
        if old is not None:
            await self._wait_idle(name)  # its requests run on the old path to the end
        self._loaded[name] = WireLoraRequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
        if old is not None:
            try:
                await self._reset_prefix_cache()
            except Exception as exc:
                self._loaded[name] = old
                return {
                    "status": "error",
                    "message": f"LoRA '{name}' hot-swap aborted; prefix cache reset failed: {exc}",
                    "lora_name": name,
                    "lora_id": lora_id,
                }
        else:
            try:
                await self._publish(name, lora_id)
            except Exception as exc:
                del self._loaded[name]
                log.exception("publishing the LoRA adapter's model card failed", lora_name=name)
                return {
                    "status": "error",
                    "message": f"Failed to register LoRA '{name}' in discovery registry: {exc}",
                    "lora_name": name,
                }
        verb = "loaded" if old is None else "hot-swapped"
        log.info(f"LoRA adapter {verb}", lora_name=name, lora_id=lora_id, lora_path=path)
        return {
            "status": "success",
            "message": f"LoRA adapter '{name}' {verb} successfully",
            "lora_name": name,
            "lora_id": lora_id,
            "hot_swap": old is not None,
        }

    async def unload_lora(self, request: Any, context: Any = None) -> AsyncIterator[Reply]:
        """`unload_lora`: `{"lora_name"}` -> one status reply, once its requests are done."""
        try:
            name = parse_unload(request)
        except LoraRequestError as exc:
            yield {"status": "error", "message": str(exc)}
            return
        try:
            async with self._lock(name):
                yield await self._unload(name)
        except Exception as exc:
            log.exception("unloading the LoRA adapter failed", lora_name=name)
            yield {"status": "error", "message": str(exc)}

    async def _unload(self, name: str) -> Reply:
        lora = self._loaded.get(name)
        if lora is None:
            return {
                "status": "error",
                "message": (
                    f"LoRA adapter '{name}' not found. Available LoRAs: {list(self._loaded)}"
                ),
            }
        await self._wait_idle(name)
        # Out of discovery first: a request routed meanwhile must not run on the base model.
        try:
            await self._withdraw(name)
        except Exception as exc:
            log.exception("unregistering the LoRA adapter's model card failed", lora_name=name)
            return {
                "status": "error",
                "message": f"Failed to unregister LoRA '{name}' from discovery registry: {exc}",
                "lora_name": name,
            }
        del self._loaded[name]
        log.info("LoRA adapter unloaded", lora_name=name, lora_id=lora.lora_int_id)
        return {
            "status": "success",
            "message": f"LoRA adapter '{name}' unloaded successfully",
            "lora_name": name,
            "lora_id": lora.lora_int_id,
        }

    async def list_loras(self, request: Any = None, context: Any = None) -> AsyncIterator[Reply]:
        """`list_loras`: every loaded adapter's name and id."""
        loras = {name: lora.lora_int_id for name, lora in self._loaded.items()}
        yield {"status": "success", "loras": loras, "count": len(loras)}

    # --- locks and in-flight requests -------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        """The adapter's lock, kept only while someone holds or awaits it."""
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    async def _wait_idle(self, name: str) -> None:
        drained = self._drained.get(name)
        if drained is not None:
            await drained.wait()
