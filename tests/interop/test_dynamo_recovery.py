"""KV-state recovery behind a real Dynamo 1.6.1 frontend: a frontend started after the
workers (here, one restarted) routes warm prompts back to the worker that holds them.

Each `engined dynamo-worker` registers with the worker-local indexer on, as dynamo.vllm
does: its `KvEventPublisher`s keep the blocks the daemon reported, and a frontend that
discovers the worker asks that indexer for them instead of starting blind. Without it the
new frontend routed 0 of 3 warm prompts to their holder (issue 26).

Two aggregated daemons, each behind its worker, in a namespace of their own; a KV-routing
frontend that sees that namespace only (its KV event counters are those workers'). Three
prompts of 8 blocks each are sent once, pinned (two to one worker, one to the other), then
the frontend is stopped and a new one started while the workers stay. The same prompts,
unpinned, must go back to their holders with all 8 blocks of overlap.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from tests.interop.dynamo_cluster import DynamoCluster, Frontend, completions, dynamo_cluster
from tests.interop.dynamo_worker_support import (
    BLOCK_SIZE,
    FAST_ARGS,
    EnginedGroup,
    add_frontend,
    add_worker,
    cached_after_full_repeat,
    kv_events_applied,
    poll_until,
    wait_routable,
)
from tests.interop.peers import require_peers
from tests.interop.tiny_model import words

NAMESPACE: Final = "recovery"
MODEL: Final = "tiny-recovery"
PROMPT_TOKENS: Final = 128
BLOCKS: Final = PROMPT_TOKENS // BLOCK_SIZE
EVENTS_TIMEOUT_S: Final = 20.0
# Prompts of distinct first words share no block.
PROMPTS: Final = tuple(words(PROMPT_TOKENS, start=start) for start in (0, 300, 600))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[DynamoCluster]:
    with dynamo_cluster(require_peers(), tmp_path) as cluster:
        yield cluster


def _group(cluster: DynamoCluster, frontend: Frontend) -> EnginedGroup:
    group = EnginedGroup(MODEL, NAMESPACE, [], [])
    for i in range(2):
        daemon = cluster.engined_daemon(*FAST_ARGS, name=f"{NAMESPACE}-engined-{i}")
        group.daemons.append(daemon)
        group.workers.append(
            add_worker(
                cluster, daemon, name=f"{NAMESPACE}-worker-{i}", model=MODEL, namespace=NAMESPACE
            )
        )
    wait_routable(frontend, group.worker_ids())
    return group


def stored_ok(frontend: Frontend) -> int:
    return kv_events_applied(frontend).get(("stored", "ok"), 0)


def test_a_restarted_frontend_routes_warm_prompts_back_to_their_holders(
    cluster: DynamoCluster,
) -> None:
    first = add_frontend(cluster, name="frontend-before", namespace=NAMESPACE)
    group = _group(cluster, first)
    worker_ids = group.worker_ids()
    assert len(set(worker_ids)) == 2, worker_ids
    owners = [worker_ids[0], worker_ids[1], worker_ids[0]]
    for prompt, owner in zip(PROMPTS, owners, strict=True):
        reply = completions(
            first, prompt, model=MODEL, max_tokens=4, nvext={"backend_instance_id": owner}
        )
        assert reply["usage"]["prompt_tokens"] == PROMPT_TOKENS, reply
        (route,) = first.wait_route(reply)
        assert route.worker_id == owner, route
    # Each new prompt's 8 blocks are stored in one event. Once the frontend has applied all
    # three, the publishers that relayed them have them in their local indexers too.
    poll_until(
        "the first frontend to apply the 3 stored events",
        lambda: stored_ok(first) >= len(PROMPTS),
        EVENTS_TIMEOUT_S,
        first.describe,
    )
    assert cluster.stop(first) == 0, first.describe()

    second = add_frontend(cluster, name="frontend-after", namespace=NAMESPACE)
    for worker in group.workers:
        worker.wait_listed(second)
    wait_routable(second, worker_ids)
    # The new frontend asks each worker's local indexer for what it holds and applies the
    # answer as events: the same 3 stored events, none of them sent again by a daemon.
    recovered = poll_until(
        "the new frontend to recover the 3 stored events from the workers",
        lambda: n if (n := stored_ok(second)) >= len(PROMPTS) else None,
        EVENTS_TIMEOUT_S,
        second.describe,
    )
    assert recovered == len(PROMPTS), kv_events_applied(second)
    for i, (prompt, owner) in enumerate(zip(PROMPTS, owners, strict=True)):
        reply = completions(second, prompt, model=MODEL, max_tokens=4)
        what = f"prompt {i} (held by worker {owner})"
        details = reply["usage"].get("prompt_tokens_details") or {}
        assert details.get("cached_tokens") == cached_after_full_repeat(PROMPT_TOKENS), (
            f"{what}: {reply}"
        )
        (route,) = second.wait_route(reply)
        assert (route.worker_id, route.overlap_blocks) == (owner, BLOCKS), f"{what}: {route}"
