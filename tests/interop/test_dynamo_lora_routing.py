"""Dynamo 1.6.1's KV router routes a LoRA adapter's requests by the adapter's cached blocks.

Two daemons with `--enable-lora`, each behind an `engined dynamo-worker --enable-lora`, and a
KV-routing frontend of their own (`--namespace`, so its event counters are theirs). The
adapter "sql" is loaded into both workers through their `load_lora` endpoints (Dynamo's
client, each instance directly). A prompt for the adapter is sent once pinned to one worker;
once the frontend's indexer has applied that daemon's store (which carries `lora_name`, as
vLLM's), every repeat is routed to that worker with the whole prompt's blocks as its
overlap, while the same tokens for the base model overlap nothing: Dynamo hashes a request's
blocks with its adapter's name, as it indexed the daemon's events.

Every wait polls an observable condition (the frontend's models, its KV event counters, its
route lines) under a deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.interop.dynamo_cluster import EnginedWorker, Frontend, completions, dynamo_cluster
from tests.interop.dynamo_worker_support import (
    BLOCK_SIZE,
    FAST_ARGS,
    add_frontend,
    add_worker,
    cached_after_full_repeat,
    fresh_prompt,
    kv_events_applied,
    poll_until,
    wait_routable,
)
from tests.interop.peers import require_peers
from tests.interop.test_dynamo_worker_lora import LORA_ENV, Module, call

MODEL = "tiny-lora-kv"
NAMESPACE = "lorakv"
ADAPTER = "sql"
EVENTS_TIMEOUT_S = 20.0
PROMPT_TOKENS = 128


@dataclass
class Pair:
    module: Module
    frontend: Frontend
    workers: list[EnginedWorker]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    python = require_peers()
    workdir = tmp_path_factory.mktemp("dynamo-lora-routing")
    with dynamo_cluster(python, workdir) as cluster:
        frontend = add_frontend(cluster, name="frontend-lora-kv", namespace=NAMESPACE)
        workers = []
        for i in range(2):
            daemon = cluster.engined_daemon(
                *FAST_ARGS, "--enable-lora", "--max-loras", "2", name=f"lora-kv-engined-{i}"
            )
            workers.append(
                add_worker(
                    cluster,
                    daemon,
                    name=f"lora-kv-worker-{i}",
                    model=MODEL,
                    namespace=NAMESPACE,
                    env=LORA_ENV,
                    extra_args=["--enable-lora", "--max-loras", "2"],
                )
            )
        wait_routable(frontend, [int(w.instance_id or 0) for w in workers])
        module = Module(cluster, frontend, daemon, workers[0], workdir / "adapters")
        uri = module.adapter(ADAPTER)
        for worker in workers:
            (reply,) = call(
                module,
                worker,
                "load_lora",
                {"lora_name": ADAPTER, "source": {"uri": uri}},
                direct=True,
            )
            assert reply["status"] == "success", reply
        poll_until(
            "the frontend to list the adapter",
            lambda: ADAPTER in frontend.models(),
            EVENTS_TIMEOUT_S,
            frontend.describe,
        )
        yield Pair(module, frontend, workers)
        codes = cluster.close()
    assert codes and set(codes.values()) == {0}, f"SIGTERM exit codes {codes}\n{cluster.describe()}"


def test_kv_routing_sends_an_adapters_repeats_to_the_worker_holding_its_blocks(
    pair: Pair,
) -> None:
    frontend = pair.frontend
    ids = [int(w.instance_id or 0) for w in pair.workers]
    assert len(set(ids)) == 2, ids

    def stored() -> int:
        return kv_events_applied(frontend).get(("stored", "ok"), 0)

    def stored_reached(count: int) -> Callable[[], bool]:
        return lambda: stored() >= count

    blocks = PROMPT_TOKENS // BLOCK_SIZE
    for i in range(2):
        owner = ids[i]
        prompt = fresh_prompt(PROMPT_TOKENS)
        before = stored()
        first = completions(
            frontend,
            prompt,
            model=ADAPTER,
            max_tokens=4,
            nvext={"backend_instance_id": owner},
        )
        assert first["model"] == ADAPTER, first
        assert first["usage"]["prompt_tokens"] == PROMPT_TOKENS, first
        (route,) = frontend.wait_route(first)
        assert route.worker_id == owner, route
        poll_until(
            f"the frontend to apply the adapter's stores of prompt {i}",
            stored_reached(before + 1),
            EVENTS_TIMEOUT_S,
            frontend.describe,
        )
        for send in (2, 3):
            again = completions(frontend, prompt, model=ADAPTER, max_tokens=4)
            what = f"prompt {i} send {send} (owner {owner})"
            details = again["usage"].get("prompt_tokens_details") or {}
            assert details.get("cached_tokens") == cached_after_full_repeat(PROMPT_TOKENS), (
                f"{what}: {again}"
            )
            (route,) = frontend.wait_route(again)
            assert (route.worker_id, route.overlap_blocks) == (owner, blocks), f"{what}: {route}"
        # The same tokens for the base model: none of the adapter's blocks are its own.
        base = completions(frontend, prompt, model=MODEL, max_tokens=4)
        (route,) = frontend.wait_route(base)
        assert route.overlap_blocks == 0, route
    applied = kv_events_applied(frontend)
    refused = {key: n for key, n in applied.items() if key[1] != "ok" and n}
    assert not refused, f"events the frontend's indexer refused: {refused}"
