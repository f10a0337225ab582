"""What the Dynamo worker does while its daemon is gone, and when it comes back.

The worker stays up across a daemon restart rather than exiting: its Dynamo registration
(model card, endpoint instance, metrics endpoint) stays valid, so the daemon's return costs
one `hello` and the set-up commands instead of a new worker process and a new discovery
round; a supervisor that restarts the pair anyway (systemd's `BindsTo=`) loses nothing. A
daemon that comes back with another shape (block size, KV pool, ranks, role, limits) no
longer matches the registered model card: then the worker ends, exit 1, for its supervisor
to start one that registers the new shape; so does one that refuses the set-up.

While the daemon is gone the worker takes itself out of discovery (the frontend routes to
the other workers) and fails a request that
reaches it anyway with `EngineShutdown`, as its in-flight streams ended: Dynamo's frontend
migrates those (`--migration-limit`). A restarted daemon has an empty cache, no vocabulary
and a reset FPM worker id: the worker sets them again and makes new KV publishers (a fresh
worker-local indexer, which is what makes the router forget the dead daemon's blocks: the
interop test shows a warm prompt routed with no overlap after) before it registers again;
a dropped connection to the same daemon start only needs its `watch_load` again. No
request reaches a daemon in between, so none gets empty text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog

from engined.client import ConnectionBack, ConnectionLost, EngineClient
from engined.dynamo.engine_outputs import RequestFailed
from engined.dynamo.model import SetupError
from engined.wire.control import Welcome

log = structlog.get_logger(__name__)

# The `welcome` fields the registered model card and runtime config were built from.
SHAPE_FIELDS = (
    "worker_type",
    "block_size",
    "num_gpu_blocks",
    "dp_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
)


def shape_change(registered: Welcome, returned: Welcome) -> str | None:
    """What differs between the daemon start the worker registered and the returned one."""
    changed = [
        f"{name} {getattr(registered, name)!r} -> {getattr(returned, name)!r}"
        for name in SHAPE_FIELDS
        if getattr(registered, name) != getattr(returned, name)
    ]
    if bool(registered.kv_events_endpoints) != bool(returned.kv_events_endpoints):
        changed.append("KV events turned on or off")
    return ", ".join(changed) or None


class DaemonFollower:
    """Follows the client's connection events; `serving` is False while the daemon is gone
    or being set up again.

    One follower per daemon, however many Dynamo workers serve it: `endpoints` are theirs
    (one, or one per rank with `--worker-per-rank`), all leaving and rejoining discovery
    together. `setup(welcome)` sends the daemon's set-up (vocabulary, each served rank's FPM
    worker id), `republish(welcome)` replaces the KV and FPM relays, `watch_load()`
    subscribes to load again, `end(reason)` stops the worker for good.
    """

    def __init__(
        self,
        client: EngineClient,
        endpoints: Sequence[Any],
        welcome: Welcome,
        *,
        setup: Callable[[Welcome], Awaitable[None]],
        republish: Callable[[Welcome], None],
        watch_load: Callable[[], Awaitable[object]],
        end: Callable[[str], None],
    ) -> None:
        self._client = client
        self._endpoints = list(endpoints)
        self._registered = welcome
        self._setup = setup
        self._republish = republish
        self._watch_load = watch_load
        self._end = end
        self.serving = True

    def refusal(self) -> Exception:
        """The handler's gate (`engined.dynamo.handler.Gate`): what a request gets while not
        `serving`, and a stream when the daemon goes mid-stream (`daemon_gone`)."""
        return daemon_gone()

    async def run(self) -> None:
        try:
            while True:
                event = await self._client.next_connection_event()
                if isinstance(event, ConnectionLost):
                    await self._lost()
                elif isinstance(event, ConnectionBack) and not self._client.daemon_lost:
                    await self._back(event)
        except Exception as exc:
            # Dynamo refusing the new publishers, say: a worker that no longer follows its
            # daemon must not stay up half-registered.
            log.exception("following the engined daemon failed")
            self._end(f"following the engined daemon failed: {exc}")

    async def _lost(self) -> None:
        if not self.serving:
            return
        self.serving = False
        log.error(
            "the engined daemon is gone: in-flight requests end with EngineShutdown (the "
            "frontend migrates them with --migration-limit); unregistered until it returns",
            instance_id=self._registered.instance_id,
        )
        for endpoint in self._endpoints:
            await _quietly(endpoint.unregister_endpoint_instance(), "unregister")

    async def _back(self, event: ConnectionBack) -> None:
        welcome = event.welcome
        change = shape_change(self._registered, welcome)
        if change is not None:
            self._end(
                f"the engined daemon came back with another shape ({change}): restart the "
                "worker to register it"
            )
            return
        # Against the start this follower last set up, not the client's last `welcome`: a
        # set-up cut short by another loss is owed to that start when it answers again.
        restarted = event.restarted or welcome.instance_id != self._registered.instance_id
        try:
            if restarted:
                await self._setup(welcome)
                self._republish(welcome)
            await self._watch_load()
        except (SetupError, TimeoutError, ConnectionError) as exc:
            if self._client.daemon_lost:
                # Lost again meanwhile: its next return tries again.
                log.error("the returned engined daemon went away again", error=str(exc))
                return
            # A daemon that is there but refuses (or does not answer) the set-up would
            # leave the worker out of discovery for good: end, as at start-up.
            self._end(f"setting up the restarted engined daemon failed: {exc}")
            return
        self._registered = welcome
        for endpoint in self._endpoints:
            await _quietly(endpoint.register_endpoint_instance(), "register")
        self.serving = True
        log.info(
            "the engined daemon is back; serving again",
            instance_id=welcome.instance_id,
            restarted=restarted,
        )


async def _quietly(call: Awaitable[object], what: str) -> None:
    """Discovery calls: a failure is logged, and the worker goes on with what it can do."""
    try:
        await call
    except (TimeoutError, RuntimeError, ValueError, OSError) as exc:
        log.warning(f"could not {what} the endpoint instance", error=str(exc))


def daemon_gone() -> Exception:
    """How a stream ends, or a request is refused, when the daemon is gone: Dynamo's
    `EngineShutdown`, which its frontend migrates to another worker (`--migration-limit`,
    Dynamo 1.6.1's `is_migratable` in lib/llm/src/migration.rs) and for which it stops
    routing to this instance for a while; without migration the client gets an error."""
    try:
        from dynamo.llm.exceptions import EngineShutdown
    except ImportError:  # pragma: no cover - the worker always runs with Dynamo
        return RequestFailed(503, "the engined daemon went away")
    error: Exception = EngineShutdown("the engined daemon went away")
    return error
