"""LoRA adapters on a simulated cluster per host: one daemon with 2 ranks and
`--enable-lora`, behind one `engined dynamo-worker --worker-per-rank --enable-lora`, behind a
real Dynamo 1.6.1 frontend with the KV router.

Each rank is a dynamo.vllm worker of its own, so each keeps its own adapters: "sql" loaded
through rank 1's `load_lora` instance is listed by rank 1 only, a request naming it runs on
rank 1 with the adapter (a repeat is routed back there with the whole prompt as overlap: the
router hashed it with the adapter's name, as it indexed rank 1's events), and rank 0 refuses
it with Dynamo's 400 until it loads it too. Unloading it from both takes its card away.
Dynamo's system status server (`/v1/loras`) reaches rank 0's adapters only.

Every wait polls an observable condition (the frontend's models, its KV event counters, its
route lines) under a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import pytest

from tests.interop.dynamo_cluster import Frontend, completions, dynamo_cluster, http_json
from tests.interop.dynamo_worker_support import (
    BLOCK_SIZE,
    FAST_ARGS,
    add_frontend,
    cached_after_full_repeat,
    fresh_prompt,
    kv_events_applied,
    poll_until,
    start_worker_per_rank,
    wait_routable,
)
from tests.interop.peers import require_peers
from tests.interop.test_dynamo_worker_lora import (
    LORA_ENV,
    Module,
    call,
    dynamo_lora_id,
    prompt_ids,
)

MODEL: Final = "tiny-ranks-lora"
NAMESPACE: Final = "rankslora"
ADAPTER: Final = "sql"
EVENTS_TIMEOUT_S: Final = 20.0
PROMPT_TOKENS: Final = 128


@dataclass
class PerRank:
    module: Module
    frontend: Frontend
    instance_ids: list[int]  # by rank


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PerRank]:
    python = require_peers()
    workdir = tmp_path_factory.mktemp("cluster-lora")
    with dynamo_cluster(python, workdir) as cluster:
        frontend = add_frontend(cluster, name="frontend-ranks-lora", namespace=NAMESPACE)
        daemon = cluster.engined_daemon(
            *FAST_ARGS,
            "--data-parallel-size",
            "2",
            "--rank-processes",
            "0",
            "--enable-lora",
            "--max-loras",
            "2",
            name="ranks-lora-engined",
        )
        worker, ids = start_worker_per_rank(
            cluster,
            daemon,
            name="ranks-lora-worker",
            model=MODEL,
            namespace=NAMESPACE,
            env=LORA_ENV,
            extra_args=["--enable-lora", "--max-loras", "2"],
            system_port=True,
        )
        wait_routable(frontend, ids)
        module = Module(cluster, frontend, daemon, worker, workdir / "adapters")
        yield PerRank(module, frontend, ids)
        codes = cluster.close()
    assert codes and set(codes.values()) == {0}, f"SIGTERM exit codes {codes}\n{cluster.describe()}"


def _one(per_rank: PerRank, rank: int, endpoint: str, body: object) -> object:
    module = per_rank.module
    replies = call(module, module.lora, endpoint, body, instance=per_rank.instance_ids[rank])
    assert len(replies) == 1, replies
    return replies[0]


def test_each_rank_keeps_its_own_adapters(per_rank: PerRank) -> None:
    module, frontend, ids = per_rank.module, per_rank.frontend, per_rank.instance_ids
    sql_id = dynamo_lora_id(module, ADAPTER)
    uri = module.adapter(ADAPTER)
    loaded = _one(per_rank, 1, "load_lora", {"lora_name": ADAPTER, "source": {"uri": uri}})
    assert loaded == {
        "status": "success",
        "message": f"LoRA adapter '{ADAPTER}' loaded successfully",
        "lora_name": ADAPTER,
        "lora_id": sql_id,
        "hot_swap": False,
    }
    assert _one(per_rank, 0, "list_loras", {}) == {"status": "success", "loras": {}, "count": 0}
    assert _one(per_rank, 1, "list_loras", {}) == {
        "status": "success",
        "loras": {ADAPTER: sql_id},
        "count": 1,
    }
    frontend.wait_for_model(ADAPTER)

    # Rank 0 has not loaded it: its worker refuses the adapter as dynamo.vllm's would.
    request = {
        "model": ADAPTER,
        "token_ids": prompt_ids(fresh_prompt(4)),
        "stop_conditions": {"max_tokens": 2},
        "sampling_options": {},
        "output_options": {},
    }
    refused = call(module, module.lora, "generate", request, instance=ids[0])
    assert refused and f"unknown model or LoRA adapter: '{ADAPTER}'" in str(refused[-1]), refused

    # Rank 1 runs it with the adapter, and the router sends the repeat back with its blocks.
    def stored() -> int:
        return kv_events_applied(frontend).get(("stored", "ok"), 0)

    prompt = fresh_prompt(PROMPT_TOKENS)
    before = stored()
    first = completions(
        frontend, prompt, model=ADAPTER, max_tokens=4, nvext={"backend_instance_id": ids[1]}
    )
    assert (first["model"], first["usage"]["prompt_tokens"]) == (ADAPTER, PROMPT_TOKENS), first
    (route,) = frontend.wait_route(first)
    assert (route.worker_id, route.dp_rank) == (ids[1], 1), route
    poll_until(
        "the frontend to apply rank 1's stores of the adapter's prompt",
        lambda: stored() >= before + 1,
        EVENTS_TIMEOUT_S,
        frontend.describe,
    )
    again = completions(frontend, prompt, model=ADAPTER, max_tokens=4)
    (route,) = frontend.wait_route(again)
    blocks = PROMPT_TOKENS // BLOCK_SIZE
    assert (route.worker_id, route.dp_rank, route.overlap_blocks) == (ids[1], 1, blocks), route
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == cached_after_full_repeat(PROMPT_TOKENS), again["usage"]

    # Loaded on rank 0 too, then unloaded from both: the frontend drops the adapter.
    reloaded = _one(per_rank, 0, "load_lora", {"lora_name": ADAPTER, "source": {"uri": uri}})
    assert isinstance(reloaded, dict) and reloaded["lora_id"] == sql_id, reloaded
    served = call(module, module.lora, "generate", request, instance=ids[0])
    assert served and "token_ids" in served[-1], served
    for rank in (0, 1):
        unloaded = _one(per_rank, rank, "unload_lora", {"lora_name": ADAPTER})
        assert isinstance(unloaded, dict) and unloaded["status"] == "success", unloaded
    frontend.wait_for_model(ADAPTER, present=False)


def test_the_system_server_serves_rank_zeros_adapters(per_rank: PerRank) -> None:
    """Dynamo's system status server runs in rank 0's runtime (the other ranks find its port
    taken), so its `/v1/loras` loads, lists and unloads rank 0's adapters alone, every time
    (three rounds: no round robin over the ranks' instances)."""
    module, frontend, ids = per_rank.module, per_rank.frontend, per_rank.instance_ids
    base = f"http://127.0.0.1:{module.lora.system_port}/v1/loras"
    chat_id = dynamo_lora_id(module, "chat")
    uri = module.adapter("chat")
    for _ in range(3):
        status, body = http_json("POST", base, {"lora_name": "chat", "source": {"uri": uri}})
        assert (status, body["status"], body["lora_id"]) == (200, "success", chat_id), body
        assert _one(per_rank, 0, "list_loras", {}) == {
            "status": "success",
            "loras": {"chat": chat_id},
            "count": 1,
        }
        assert _one(per_rank, 1, "list_loras", {}) == {"status": "success", "loras": {}, "count": 0}
        assert http_json("GET", base)[1]["loras"] == {"chat": chat_id}
        frontend.wait_for_model("chat")
        served = completions(
            frontend,
            fresh_prompt(4),
            model="chat",
            max_tokens=2,
            nvext={"backend_instance_id": ids[0]},
        )
        assert served["usage"]["completion_tokens"] == 2, served
        status, gone = http_json("DELETE", f"{base}/chat")
        assert (status, gone["status"]) == (200, "success"), gone
        assert _one(per_rank, 0, "list_loras", {}) == {"status": "success", "loras": {}, "count": 0}
        frontend.wait_for_model("chat", present=False)
