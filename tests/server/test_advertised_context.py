"""The context a daemon advertises (`welcome.max_model_len`, the token histograms' last
bucket) is the one its ranks enforce (`served_context`): capped by the blocks a request can
hold and, without chunked prefill, by one pass's token budget."""

from __future__ import annotations

from typing import Any

import pytest

from engined.config import DaemonConfig
from engined.core.args import EngineArgs, Semantics
from engined.server.control.settings import RuntimeSettings
from engined.server.control.welcome import welcome_message
from engined.server.ops.prometheus_metrics import VllmMetrics
from engined.server.ranks.rank_layouts import RankEndpoints


@pytest.mark.parametrize(
    ("fields", "advertised"),
    [
        # 64 blocks of 16, one of them vLLM's null block.
        ({}, 1008),
        ({"semantics": Semantics.MOCKER_1_3_0}, 1024),
        ({"enable_chunked_prefill": False}, 256),
        ({"enable_chunked_prefill": False, "max_model_len": 200}, 200),
        ({"max_model_len": 512}, 512),
    ],
)
def test_the_advertised_context_is_the_served_one(fields: dict[str, Any], advertised: int) -> None:
    engine = EngineArgs(
        **{"block_size": 16, "num_gpu_blocks": 64, "max_num_batched_tokens": 256, **fields}
    ).normalized()
    config = DaemonConfig(model_name="m", engine=engine)
    settings = RuntimeSettings(vocab_size=None, excluded_token_ids=(), fpm_worker_id="w", fpm=())
    welcome = welcome_message(config, RankEndpoints(), settings, None, "instance")
    assert welcome.max_model_len == advertised
    assert VllmMetrics.from_config(config).max_model_len == advertised
