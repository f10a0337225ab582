"""The context a daemon advertises (`welcome.max_model_len`, the token histograms' last
bucket) is the one its ranks enforce: capped by the KV pool and, without chunked prefill, by
one pass's token budget (`EngineArgs.enforced_max_model_len`)."""

from __future__ import annotations

import pytest

from engined.config import DaemonConfig
from engined.core.args import EngineArgs
from engined.server.control.settings import RuntimeSettings
from engined.server.control.welcome import welcome_message
from engined.server.ops.prometheus_metrics import VllmMetrics
from engined.server.ranks.rank_layouts import RankEndpoints


@pytest.mark.parametrize(
    ("chunked", "max_model_len", "advertised"),
    [(True, None, 1024), (False, None, 256), (False, 200, 200), (True, 512, 512)],
)
def test_the_advertised_context_is_the_enforced_one(
    chunked: bool, max_model_len: int | None, advertised: int
) -> None:
    engine = EngineArgs(
        block_size=16,
        num_gpu_blocks=64,
        max_num_batched_tokens=256,
        enable_chunked_prefill=chunked,
        max_model_len=max_model_len,
    ).normalized()
    config = DaemonConfig(model_name="m", engine=engine)
    settings = RuntimeSettings(vocab_size=None, excluded_token_ids=(), fpm_worker_id="w", fpm=())
    welcome = welcome_message(config, RankEndpoints(), settings, None, "instance")
    assert welcome.max_model_len == advertised
    assert VllmMetrics.from_config(config).max_model_len == advertised
