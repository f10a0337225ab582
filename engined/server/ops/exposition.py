"""The daemon's Prometheus exposition, rendered the same way for `/metrics` and for `metrics`.

The HTTP server's `GET /metrics` and the control protocol's `metrics` command (which lets an
API server process serve `/metrics` on its own port) must answer alike: the same registry,
the same refresh of the figures worker-process ranks keep at home, the same choice of text
format by the `Accept` header. Both go through one `Exposition`.

Ranks in worker processes keep some figures in their own process (the replay and overflow
counters); `refresh` fetches them first, bounded by `SCRAPE_REFRESH_S` so that a worker that
does not answer delays a scrape but never fails it. Rendering is synchronous, on the daemon's
event loop (about 0.5 ms a rank), once per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from engined.wire import control as wire

log = structlog.get_logger(__name__)

# A scrape waits this long for the ranks' figures, then renders what the daemon has.
SCRAPE_REFRESH_S = 1.0


class Rendered(Protocol):
    """Collectors that render their own families (`VllmMetrics`): `render` gives what the
    registry's encoders would for them, `others` holds the registry's remaining collectors."""

    @property
    def others(self) -> Collector: ...

    def render(self, openmetrics: bool, underscored: bool) -> str: ...


class Exposition:
    """`registry` rendered for an `Accept` header, after `before_scrape` (when given). With
    `rendered` (the registry's collectors, first), its own rendering and the encoder's text
    of its `others` make the same bytes, sooner."""

    def __init__(
        self,
        registry: Collector,
        before_scrape: Callable[[], Awaitable[None]] | None = None,
        *,
        rendered: Rendered | None = None,
    ) -> None:
        self.registry = registry
        self._rendered = rendered
        self._before_scrape = before_scrape
        self._stale_scrapes = 0

    async def refresh(self) -> None:
        """Await `before_scrape` up to `SCRAPE_REFRESH_S`; past it, go on without it."""
        if self._before_scrape is None:
            return
        try:
            await asyncio.wait_for(self._before_scrape(), SCRAPE_REFRESH_S)
        except TimeoutError:
            self._stale_scrapes += 1
            # NOTE: one line per power of two, so that a flood of scrapes cannot flood the log.
            if self._stale_scrapes & (self._stale_scrapes - 1) == 0:
                log.warning(
                    "metrics scraped without fresh worker figures",
                    waited_s=SCRAPE_REFRESH_S,
                    total=self._stale_scrapes,
                )

    def render(self, accept: str) -> tuple[str, bytes]:
        """(content type, body). As prometheus_client's own handlers (and so vLLM's
        /metrics) answer: the text format by default, OpenMetrics when `accept` asks for it."""
        encoder, content_type = choose_encoder(accept)
        rendered = self._rendered
        # The escaping a versioned Accept asked for, which the content type repeats.
        _, _, escaping = content_type.partition("escaping=")
        if rendered is None or escaping not in ("", "underscores", "allow-utf-8"):
            return content_type, encoder(self.registry)
        openmetrics = content_type.startswith("application/openmetrics-text")
        head = rendered.render(openmetrics, openmetrics and escaping != "allow-utf-8")
        # An OpenMetrics encoder ends its text with `# EOF`: the others' text comes last.
        return content_type, head.encode() + encoder(rendered.others)


# `metrics` messages in progress (waiting for the refresh, then rendered) at once, from every
# client together, and from one client. Each costs one render on the event loop, so the bound
# caps the loop time one refresh window's worth of them can take; an API server process asks
# once per scrape of its `/metrics`, so a few per client is plenty.
METRICS_LIMIT = 16
METRICS_CLIENT_LIMIT = 4


class MetricsRequests:
    """The control protocol's `metrics`: admitted within the bounds above, then answered with
    what `/metrics` would serve."""

    def __init__(self, exposition: Exposition) -> None:
        self._exposition = exposition
        self._in_progress = 0
        # Requests per client identity; an identity leaves with its last one.
        self._of: dict[bytes, int] = {}

    def admit(self, identity: bytes) -> str | None:
        """Count one request of `identity` and return None, or say why it is refused
        (`overloaded`)."""
        mine = self._of.get(identity, 0)
        if mine >= METRICS_CLIENT_LIMIT:
            return f"this client has {METRICS_CLIENT_LIMIT} metrics requests in progress already"
        if self._in_progress >= METRICS_LIMIT:
            return f"{METRICS_LIMIT} metrics requests are in progress already"
        self._in_progress += 1
        self._of[identity] = mine + 1
        return None

    async def answer(self, msg: wire.Metrics, identity: bytes) -> wire.MetricsReply:
        """The exposition for `msg.accept` (after `admit` admitted it)."""
        try:
            await self._exposition.refresh()
            content_type, body = self._exposition.render(msg.accept or "")
        finally:
            self._in_progress -= 1
            left = self._of[identity] - 1
            if left:
                self._of[identity] = left
            else:
                del self._of[identity]
        return wire.MetricsReply(id=msg.id, content_type=content_type, text=body.decode())

    @property
    def clients(self) -> int:
        """Identities with a request in progress (tests: the per-client counts are freed)."""
        return len(self._of)
