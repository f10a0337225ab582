"""A simulated cluster per host: one daemon with 4 ranks behind one `engined dynamo-worker
--worker-per-rank`, behind a real NVIDIA Dynamo 1.6.1 frontend with the KV router.

The frontend must see 4 workers, each one rank: 4 instances, each serving the requests
routed to it on its own rank (a repeat's prefix hit proves the rank: only the rank that ran
a prompt holds its blocks), the router filing each rank's KV events under its instance (a
repeat goes back to the instance that holds the prompt, with its 8 blocks of overlap), and
each rank's forward-pass metrics stamped with its own instance id, as Dynamo's decoder reads
them.

Waits poll under deadlines: a prompt is repeated only once the frontend's indexer applied
the `stored` event of its first send (its KV event counter), and FPM frames are read until
each rank's heartbeat (sent every second while idle) arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from tests.interop.dynamo_cluster import (
    EnginedDaemon,
    EnginedWorker,
    Frontend,
    completions,
    dynamo_cluster,
    request_id_of,
)
from tests.interop.dynamo_worker_support import (
    BLOCK_SIZE,
    FAST_ARGS,
    add_frontend,
    cached_after_full_repeat,
    fpm_stamps,
    kv_events_applied,
    poll_until,
    start_worker_per_rank,
    wait_routable,
)
from tests.interop.peers import require_peers
from tests.interop.test_dynamo_worker_outputs import expected_logprobs, text_ids
from tests.interop.tiny_model import FIRST_WORD_ID, words

RANKS: Final = 4
MODEL: Final = "tiny-ranks"
NAMESPACE: Final = "ranks"
EVENTS_TIMEOUT_S: Final = 20.0
PROMPT_TOKENS: Final = 128


@dataclass
class PerRank:
    frontend: Frontend
    daemon: EnginedDaemon
    worker: EnginedWorker
    instance_ids: list[int]  # by rank
    peers_python: Path


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PerRank]:
    python = require_peers()
    with dynamo_cluster(python, tmp_path_factory.mktemp("cluster-per-host")) as cluster:
        # A frontend that sees this namespace only: its KV event counters are these ranks'.
        frontend = add_frontend(cluster, name="frontend", namespace=NAMESPACE)
        daemon = cluster.engined_daemon(*FAST_ARGS, "--data-parallel-size", str(RANKS))
        worker, instance_ids = start_worker_per_rank(
            cluster, daemon, name="engined-worker-per-rank", model=MODEL, namespace=NAMESPACE
        )
        wait_routable(frontend, instance_ids)
        yield PerRank(frontend, daemon, worker, instance_ids, python)
        codes = cluster.close()
    assert set(codes.values()) == {0}, f"SIGTERM exit codes {codes}\n{cluster.describe()}"


def test_the_frontend_lists_one_instance_per_rank(per_rank: PerRank) -> None:
    ids = per_rank.instance_ids
    assert len(ids) == RANKS and len(set(ids)) == RANKS, ids
    listed = {
        int(i["instance_id"])
        for i in per_rank.frontend.instances()
        if i.get("namespace") == NAMESPACE and i.get("endpoint") == "generate"
    }
    assert listed == set(ids)
    assert per_rank.worker.store_instances() == set(ids)


def test_each_instance_serves_on_its_rank_and_repeats_route_back(per_rank: PerRank) -> None:
    frontend = per_rank.frontend

    def stored() -> int:
        return kv_events_applied(frontend).get(("stored", "ok"), 0)

    def stored_reached(count: int) -> Callable[[], bool]:
        return lambda: stored() >= count

    blocks = PROMPT_TOKENS // BLOCK_SIZE
    initial = stored()
    for rank, owner in enumerate(per_rank.instance_ids):
        prompt = words(PROMPT_TOKENS, start=1 + 131 * rank)
        # The first send is pinned to the rank's instance, so that every rank holds a prompt.
        first = completions(
            frontend, prompt, model=MODEL, max_tokens=4, nvext={"backend_instance_id": owner}
        )
        assert first["usage"]["prompt_tokens"] == PROMPT_TOKENS, first
        assert first["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
        (route,) = frontend.wait_route(first)
        assert (route.worker_id, route.dp_rank) == (owner, rank), route
        # One `stored` event for the new prompt, one for the repeat's twin of its last block.
        poll_until(
            f"the frontend to apply the stored event of rank {rank}'s prompt",
            stored_reached(initial + 2 * rank + 1),
            EVENTS_TIMEOUT_S,
            frontend.describe,
        )
        again = completions(frontend, prompt, model=MODEL, max_tokens=4)
        (route,) = frontend.wait_route(again)
        what = f"rank {rank} (instance {owner}): {route}"
        assert (route.worker_id, route.dp_rank, route.overlap_blocks) == (owner, rank, blocks), what
        # The prefix hit is the rank's own: the repeat ran where the prompt's blocks are.
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == cached_after_full_repeat(PROMPT_TOKENS), f"{what}: {again['usage']}"
        assert request_id_of(again) == route.request_id
    poll_until(
        "the frontend to apply every repeat's twin",
        stored_reached(initial + 2 * RANKS),
        EVENTS_TIMEOUT_S,
        frontend.describe,
    )
    applied = kv_events_applied(frontend)
    assert applied[("stored", "ok")] == initial + 2 * RANKS, applied
    refused = {key: n for key, n in applied.items() if key[1] != "ok" and n}
    assert not refused, f"events the frontend's indexer refused: {refused}"


def test_fpm_of_each_rank_carries_its_instance_id(per_rank: PerRank) -> None:
    assert fpm_stamps(per_rank.daemon, per_rank.peers_python) == [
        (str(instance_id), rank) for rank, instance_id in enumerate(per_rank.instance_ids)
    ]


def test_each_rank_makes_up_logprobs_over_the_models_vocabulary(per_rank: PerRank) -> None:
    """A rank's worker draws alternatives below the model's `vocab_size`, as a single worker
    does (it once drew them below 1: every alternative was token 0)."""
    for rank, owner in enumerate(per_rank.instance_ids[:2]):
        reply = completions(
            per_rank.frontend,
            words(5, start=40 + 7 * rank),
            model=MODEL,
            max_tokens=3,
            logprobs=2,
            nvext={"backend_instance_id": owner},
        )
        (choice,) = reply["choices"]
        expected = expected_logprobs(text_ids(choice["text"]), 2, 0)
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"] == pytest.approx([lp for lp, _ in expected])
        for top, (_, entries) in zip(logprobs["top_logprobs"], expected, strict=True):
            want = {f"w{token - FIRST_WORD_ID}": lp for token, lp in entries}
            assert top == pytest.approx(want, rel=1e-6)
