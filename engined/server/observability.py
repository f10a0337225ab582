"""The daemon's metrics and their ways out: `/metrics` and `/health` over HTTP, and the
control protocol's `metrics` command.

Started first, so that `/health` answers 503 while the rest starts; imported lazily by the
daemon, since prometheus_client adds ~20 ms to start-up, which a daemon without metrics (no
`http_port`, no API server) should not pay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import engined
from engined.admission_counters import AdmissionCounters
from engined.config import DaemonConfig
from engined.core import running as running_core
from engined.server.control.control_server import ControlServer
from engined.server.control.reports import Refresh
from engined.server.ops.build_info import BuildInfo
from engined.server.ops.exposition import Exposition, MetricsRequests
from engined.server.ops.http_endpoint import HealthState, HttpServer
from engined.server.ops.prometheus_metrics import VllmMetrics
from engined.server.ops.sleep_mode_operations import SleepModeOperations
from engined.server.publish.prometheus_publishers import WatchedPublisher
from engined.server.ranks.rank_handle import RankHandle


class Observability:
    def __init__(self, cfg: DaemonConfig, ranks: Sequence[RankHandle]) -> None:
        """`ranks` may still be empty: it is read at each scrape (the layout fills it)."""
        self.metrics = VllmMetrics.from_config(cfg)
        self.metrics.register(BuildInfo(cfg.model_name, engined.__version__, running_core()))
        self.sleep_operations = SleepModeOperations()
        self.metrics.register(self.sleep_operations)
        # One exposition for /metrics and the control protocol's `metrics` command.
        self.exposition = Exposition(self.metrics.registry, Refresh(ranks), rendered=self.metrics)
        self.requests = MetricsRequests(self.exposition)
        self.http: HttpServer | None = None

    async def serve_http(self, cfg: DaemonConfig, health: Callable[[], HealthState]) -> None:
        self.http = HttpServer(
            self.exposition,
            health=health,
            api_keys=cfg.api_key or (),
            guard_metrics=cfg.api_key_metrics,
        )
        await self.http.start(cfg.http_host, cfg.http_port or 0)

    def watch(
        self,
        ranks: Sequence[RankHandle],
        publishers: Sequence[WatchedPublisher],
        control: ControlServer,
        api: AdmissionCounters | None,
    ) -> None:
        """Tally every rank's passes and commands, read its publishers' counters at each
        scrape, and count admission refusals: the control server's for a full queue, and
        the API servers' (`api`) by vLLM's reasons."""
        for rank in ranks:
            self.metrics.attach(rank)
        self.metrics.watch_publishers(publishers)

        def rejections() -> tuple[int, int]:
            requests, tokens = (0, 0) if api is None else api.rejections()
            return control.queue_refusals + requests, tokens

        self.metrics.watch_admission(rejections)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
