"""What the daemon's "engined started" log line says of its configuration.

The line is how an operator checks, from the journal alone, which engine and which bounds a
running daemon has (README "Limits and guarantees" lists the same bounds).
"""

from __future__ import annotations

import os

import structlog

import engined
from engined.config import DaemonConfig
from engined.core import running as running_core
from engined.server.ranks.rank_layouts import RankLayout

log = structlog.get_logger("engined.server.daemon")


def log_started(
    cfg: DaemonConfig,
    *,
    worker_id: str,
    instance_id: str,
    ranks: RankLayout,
    max_message_bytes: int,
    api_port: int | None,
) -> None:
    log.info(
        "engined started",
        version=engined.__version__,
        core=str(running_core()),
        pid=os.getpid(),
        worker_id=worker_id,
        instance_id=instance_id,
        control_endpoint=cfg.control_endpoint,
        kv_events_endpoints=ranks.endpoints.kv_events,
        kv_replay_endpoints=ranks.endpoints.kv_replay,
        fpm_endpoints=ranks.endpoints.fpm,
        engine=engine_summary(cfg),
        limits=limits(cfg, ranks.limits.hwms, ranks.limits.batch_bytes, max_message_bytes),
        rank_processes=[worker.pid for worker in ranks.workers],
        api_port=api_port,
    )


def limits(
    cfg: DaemonConfig, hwms: tuple[int, int], batch_bytes: int, control_max_message_bytes: int
) -> dict[str, object]:
    """The bounds in force (README "Limits and guarantees"), as the start-up log shows them.

    `hwms`: rank 0's KV PUB and replay high-water marks (every rank has the same)."""
    kv_hwm, replay_hwm = hwms
    return {
        "max_queued_requests": cfg.max_queued_requests,
        # vLLM's admission control in the API servers (None: no limit).
        "max_num_queued_reqs": cfg.max_num_queued_reqs,
        "max_num_queued_tokens": cfg.max_num_queued_tokens,
        "control_max_message_bytes": control_max_message_bytes,
        "control_inflight_bytes": cfg.control_inflight_bytes,
        "control_unread_bytes": cfg.control_unread_bytes,
        "kv_batch_bytes_max": batch_bytes,
        "kv_events_buffer_bytes": cfg.kv_events_buffer_bytes,
        "kv_events_hwm": kv_hwm,
        "kv_replay_client_bytes": cfg.kv_replay_client_bytes,
        "kv_replay_hwm": replay_hwm,
    }


def engine_summary(cfg: DaemonConfig) -> dict[str, object]:
    """The engine settings a reader of the start-up log checks first."""
    e = cfg.engine
    return {
        "engine_type": str(e.engine_type),
        "worker_type": str(e.worker_type),
        "block_size": e.block_size,
        "num_gpu_blocks": e.num_gpu_blocks,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "enable_prefix_caching": e.enable_prefix_caching,
        "speedup_ratio": e.speedup_ratio,
        "dp_size": e.dp_size,
    }
