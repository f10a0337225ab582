"""The `welcome` a daemon answers `hello` with: the engine's shape and where its ranks publish.

Built afresh for every `hello`, since the runtime settings (`set_vocabulary`,
`set_fpm_worker_id`) may have changed since start-up and every later client must see what is
in force.
"""

from __future__ import annotations

import engined
from engined.config import DaemonConfig
from engined.core.assembly import served_context
from engined.server.control.settings import RuntimeSettings
from engined.server.ranks.rank_layouts import RankEndpoints
from engined.wire import control as wire


def welcome_message(
    cfg: DaemonConfig,
    endpoints: RankEndpoints,
    settings: RuntimeSettings,
    operator_endpoint: str | None,
    instance_id: str,
) -> wire.Welcome:
    engine = cfg.engine
    return wire.Welcome(
        protocol=wire.PROTOCOL_VERSION,
        version=engined.__version__,
        engine_type=engine.engine_type,
        worker_type=engine.worker_type,
        block_size=engine.block_size,
        num_gpu_blocks=engine.num_gpu_blocks,
        dp_size=engine.dp_size,
        model_name=cfg.model_name,
        kv_events_endpoints=endpoints.kv_events,
        kv_replay_endpoints=endpoints.kv_replay,
        fpm_endpoints=endpoints.fpm,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=served_context(engine),
        enable_prefix_caching=engine.enable_prefix_caching,
        kv_events_topic=cfg.kv_events_topic,
        kv_events_format=cfg.kv_events_format,
        vocab_size=settings.vocab_size,
        excluded_token_ids=list(settings.excluded_token_ids),
        fpm_worker_id=settings.fpm_worker_id,
        speedup_ratio=engine.speedup_ratio,
        operator_endpoint=operator_endpoint,
        instance_id=instance_id,
    )
