"""LoRA adapters through `engined dynamo-worker`, as a Dynamo 1.6.1 user loads them into
dynamo.vllm: real frontend, real daemons, real workers, no mocks.

The module's frontend (`--router-mode kv`, file discovery) serves:

- `lora`: a daemon with `--enable-lora --max-loras 2` behind a worker with `--enable-lora`,
  `DYN_LORA_ENABLED=true` and Dynamo's system status server (model "tiny-lora");
- `plain`: a daemon without LoRA, behind a worker with `--enable-lora` (the daemon's
  `welcome` does not say it lacks LoRA, so its refusal is what a request for an adapter
  gets; hot swap on), one without DYN_LORA_ENABLED and one without `--enable-lora` (no LoRA
  endpoints at all);
- a prefill and a decode daemon with LoRA behind their workers, for the adapter on both
  sides of a handoff.

Adapters are loaded and unloaded through the worker's `load_lora` and `unload_lora`
endpoints, called with Dynamo's own runtime client (`dynamo_lora_client.py` in the peers
venv), and through Dynamo's system status server (`POST /v1/loras`), which calls the same
endpoints. Requests go through the official `openai` client. Every wait polls an observable
condition (the frontend's `/v1/models`, the daemon's KV event stream) under a deadline.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import openai
import pytest
import zmq.asyncio

from engined.wire.kv_events import BlockStored
from tests.interop.dynamo_cluster import (
    DynamoCluster,
    EnginedDaemon,
    EnginedWorker,
    Frontend,
    dynamo_cluster,
    http_json,
)
from tests.interop.dynamo_worker_support import (
    BLOCK_SIZE,
    FAST_ARGS,
    HANDOFF_ARGS,
    add_worker,
    fresh_prompt,
    poll_until,
    wait_routable,
    welcome,
)
from tests.interop.peers import require_peers
from tests.interop.tiny_model import FIRST_WORD_ID
from tests.server.daemon_harness import KvStream

CLIENT: Final = Path(__file__).with_name("dynamo_lora_client.py")
CALL_TIMEOUT_S: Final = 60.0
EVENTS_TIMEOUT_S: Final = 20.0
LORA_ENV: Final = {"DYN_LORA_ENABLED": "true"}


@dataclass
class Module:
    cluster: DynamoCluster
    frontend: Frontend
    daemon: EnginedDaemon
    lora: EnginedWorker
    adapters: Path

    def adapter(self, name: str) -> str:
        """A `file://` URI of an adapter directory (engined reads nothing in it)."""
        path = self.adapters / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
        return f"file://{path}"


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Module]:
    python = require_peers()
    workdir = tmp_path_factory.mktemp("dynamo-worker-lora")
    with dynamo_cluster(python, workdir) as cluster:
        frontend = cluster.frontend(router_mode="kv")
        daemon = cluster.engined_daemon(
            *FAST_ARGS, "--enable-lora", "--max-loras", "2", name="lora-engined"
        )
        worker = add_worker(
            cluster,
            daemon,
            name="lora-worker",
            model="tiny-lora",
            namespace="lora",
            env=LORA_ENV,
            extra_args=["--enable-lora", "--max-loras", "2"],
            system_port=True,
        )
        wait_routable(frontend, [int(worker.instance_id or 0)])
        yield Module(cluster, frontend, daemon, worker, workdir / "adapters")
        codes = cluster.close()
    assert codes and set(codes.values()) == {0}, f"SIGTERM exit codes {codes}\n{cluster.describe()}"


# --- calling the worker as a Dynamo user does --------------------------------------------------


def call(
    module: Module,
    worker: EnginedWorker,
    endpoint: str,
    body: object,
    *,
    direct: bool = False,
    instance: int | None = None,
) -> list[Any]:
    """Every response of one request to `worker`'s `endpoint`, through Dynamo's client: round
    robin over the endpoint's instances, `direct` to the worker's own, or to `instance` (one
    rank of a `--worker-per-rank` worker)."""
    path = f"{worker.namespace}.{worker.component}.{endpoint}"
    if direct:
        instance = int(worker.instance_id or 0)
    target = [] if instance is None else [str(instance)]
    run = subprocess.run(
        [str(module.cluster.python), str(CLIENT), "call", path, json.dumps(body), *target],
        env=worker.env,
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )
    assert run.returncode == 0, f"{path}: exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def one_reply(module: Module, endpoint: str, body: object) -> dict[str, Any]:
    replies = call(module, module.lora, endpoint, body)
    assert len(replies) == 1, replies
    reply: dict[str, Any] = replies[0]
    return reply


def dynamo_lora_id(module: Module, name: str) -> int:
    """Dynamo's own `lora_name_to_id`, run in the peers venv."""
    run = subprocess.run(
        [str(module.cluster.python), str(CLIENT), "id", name],
        capture_output=True,
        text=True,
        check=True,
        timeout=CALL_TIMEOUT_S,
    )
    return int(run.stdout.strip())


def openai_client(frontend: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)


def prompt_ids(prompt: str) -> list[int]:
    """The tiny model's ids of `words(...)` (one token per word)."""
    return [FIRST_WORD_ID + int(w[1:]) for w in prompt.split()]


def stores_of(daemon: EnginedDaemon, first_token: int) -> list[BlockStored] | None:
    """The daemon's stores (every one it published, through its replay socket) of the prompt
    that begins with `first_token`; None while there is none (`poll_until` waits on)."""
    ready = welcome(daemon)

    async def read() -> list[BlockStored] | None:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, ready.kv_events_endpoints[0], ready.kv_replay_endpoints[0])
        try:
            await stream.catch_up()
            stores = [
                event
                for batch in stream.batches
                for event in batch.events
                if isinstance(event, BlockStored) and event.token_ids[:1] == [first_token]
            ]
            return stores or None
        finally:
            stream.close()
            ctx.destroy(linger=0)

    return asyncio.run(read())


# --- the adapter's life --------------------------------------------------------------------------


def test_an_adapter_loaded_through_load_lora_is_served_routed_and_unloaded(
    module: Module,
) -> None:
    frontend, client = module.frontend, openai_client(module.frontend)
    uri = module.adapter("sql")
    sql_id = dynamo_lora_id(module, "sql")

    loaded = one_reply(module, "load_lora", {"lora_name": "sql", "source": {"uri": uri}})
    assert loaded == {
        "status": "success",
        "message": "LoRA adapter 'sql' loaded successfully",
        "lora_name": "sql",
        "lora_id": sql_id,
        "hot_swap": False,
    }
    # Its own model card: the frontend lists it beside the base model.
    frontend.wait_for_model("sql")
    assert {"tiny-lora", "sql"} <= set(frontend.models())
    assert one_reply(module, "list_loras", {}) == {
        "status": "success",
        "loras": {"sql": sql_id},
        "count": 1,
    }

    # A completion and a chat for the adapter, through the official client.
    prompt = fresh_prompt(3 * BLOCK_SIZE)
    completion = client.completions.create(model="sql", prompt=prompt, max_tokens=4)
    assert completion.model == "sql"
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": fresh_prompt(8)}], max_tokens=3
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3

    # The daemon ran it with the adapter: its stores carry Dynamo's id and the name.
    first = prompt_ids(prompt)[0]
    stores = poll_until(
        "the daemon's stores of the adapter's prompt",
        functools.partial(stores_of, module.daemon, first),
        EVENTS_TIMEOUT_S,
        module.daemon.describe,
    )
    assert [(s.lora_id, s.lora_name) for s in stores] == [(sql_id, "sql")] * len(stores)
    assert all(key == ("sql",) for s in stores for key in s.extra_keys or [None])
    # The base model's requests still run without it.
    base_prompt = fresh_prompt(2 * BLOCK_SIZE)
    client.completions.create(model="tiny-lora", prompt=base_prompt, max_tokens=2)
    base = poll_until(
        "the daemon's stores of the base model's prompt",
        functools.partial(stores_of, module.daemon, prompt_ids(base_prompt)[0]),
        EVENTS_TIMEOUT_S,
        module.daemon.describe,
    )
    assert {(s.lora_id, s.lora_name) for s in base} == {(None, None)}

    # Loading it again changes nothing (no DYN_LORA_HOTSWAP_ENABLED).
    again = one_reply(module, "load_lora", {"lora_name": "sql", "source": {"uri": uri}})
    assert again == {
        "status": "success",
        "message": "LoRA adapter 'sql' already loaded",
        "lora_name": "sql",
        "lora_id": sql_id,
        "hot_swap": False,
    }

    unloaded = one_reply(module, "unload_lora", {"lora_name": "sql"})
    assert unloaded == {
        "status": "success",
        "message": "LoRA adapter 'sql' unloaded successfully",
        "lora_name": "sql",
        "lora_id": sql_id,
    }
    frontend.wait_for_model("sql", present=False)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt=prompt, max_tokens=2)
    assert one_reply(module, "list_loras", {}) == {"status": "success", "loras": {}, "count": 0}
    client.completions.create(model="tiny-lora", prompt=prompt, max_tokens=2)


def test_dynamos_system_server_loads_and_unloads_through_the_worker(module: Module) -> None:
    """`/v1/loras` on the worker's system status server calls its LoRA endpoints."""
    worker, frontend = module.lora, module.frontend
    base = f"http://127.0.0.1:{worker.system_port}/v1/loras"
    uri = module.adapter("chat")
    status, body = http_json("POST", base, {"lora_name": "chat", "source": {"uri": uri}})
    assert status == 200, body
    assert body["status"] == "success" and body["lora_id"] == dynamo_lora_id(module, "chat")
    frontend.wait_for_model("chat")
    status, listed = http_json("GET", base)
    assert status == 200 and listed["loras"] == {"chat": body["lora_id"]}, listed
    reply = openai_client(frontend).completions.create(
        model="chat", prompt=fresh_prompt(BLOCK_SIZE), max_tokens=2
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    status, gone = http_json("DELETE", f"{base}/chat")
    assert status == 200 and gone["status"] == "success", gone
    frontend.wait_for_model("chat", present=False)


# --- what is refused --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (None, "Request is required with 'lora_name' and 'source.uri'"),
        ({"source": {"uri": "file:///x"}}, "'lora_name' is required and must be a string"),
        ({"lora_name": "x"}, "'source' object is required in request"),
        ({"lora_name": "x", "source": {}}, "'source' object is required in request"),
        ({"lora_name": "x", "source": {"uri": 7}}, "'source.uri' is required and must be a string"),
        (
            {"lora_name": "x", "source": {"uri": "file:///nowhere/x"}},
            "Failed to download LoRA: Download failed: Local LoRA not found: file:///nowhere/x",
        ),
        (
            {"lora_name": "x", "source": {"uri": "/adapters/x"}},
            "Failed to download LoRA: Download failed: LoRA /adapters/x not found in any source",
        ),
        (
            {"lora_name": "x", "source": {"uri": "gs://bucket/x"}},
            "Failed to download LoRA: Download failed: LoRA gs://bucket/x not found in any source",
        ),
        (
            {"lora_name": "x" * 257, "source": {"uri": "s3://bucket/x"}},
            "`lora_name` must be at most 256 bytes of UTF-8, got 257",
        ),
        (
            {"lora_name": "x", "source": {"uri": "s3://bucket/" + "p" * 5000}},
            "`lora_path` must be at most 4096 bytes of UTF-8, got ",
        ),
    ],
)
def test_a_malformed_load_gets_dynamos_error(module: Module, body: object, message: str) -> None:
    """Dynamo's messages; the last two are engined's own: a name or path the control protocol
    cannot carry."""
    reply = one_reply(module, "load_lora", body)
    assert reply["status"] == "error" and reply["message"].startswith(message), reply
    assert set(reply) == {"status", "message"}
    if not message.endswith("got "):
        assert reply["message"] == message
    assert "x" not in module.frontend.models()


def test_unloading_an_adapter_not_loaded_is_an_error(module: Module) -> None:
    assert one_reply(module, "unload_lora", {"lora_name": "nope"}) == {
        "status": "error",
        "message": "LoRA adapter 'nope' not found. Available LoRAs: []",
    }
    assert one_reply(module, "unload_lora", {}) == {
        "status": "error",
        "message": "'lora_name' is required and must be a string",
    }


def test_a_request_for_an_unknown_adapter_is_refused(module: Module) -> None:
    """The frontend refuses a name no card has; the worker, one routed to it anyway."""
    with pytest.raises(openai.NotFoundError):
        openai_client(module.frontend).completions.create(
            model="nope", prompt=fresh_prompt(4), max_tokens=2
        )
    request = {
        "model": "nope",
        "token_ids": prompt_ids(fresh_prompt(4)),
        "stop_conditions": {"max_tokens": 2},
        "sampling_options": {},
        "output_options": {},
    }
    replies = call(module, module.lora, "generate", request)
    assert replies and "unknown model or LoRA adapter: 'nope'" in str(replies[-1]), replies


# --- without LoRA somewhere -------------------------------------------------------------------


@dataclass
class Plain:
    """A daemon without `--enable-lora` and three workers of it: with LoRA, DYN_LORA_ENABLED
    and DYN_LORA_HOTSWAP_ENABLED, with LoRA but without DYN_LORA_ENABLED, without LoRA."""

    lora: EnginedWorker
    unset: EnginedWorker
    none: EnginedWorker


@pytest.fixture(scope="module")
def plain(module: Module) -> Plain:
    cluster = module.cluster
    daemon = cluster.engined_daemon(*FAST_ARGS, name="plain-engined")
    workers = [
        add_worker(
            cluster,
            daemon,
            name=f"plain-{kind}",
            model=f"tiny-plain-{kind}",
            namespace=f"plain-{kind}",
            env=env,
            extra_args=args,
            system_port=kind == "none",
        )
        for kind, env, args in (
            ("lora", {**LORA_ENV, "DYN_LORA_HOTSWAP_ENABLED": "true"}, ["--enable-lora"]),
            ("unset", {}, ["--enable-lora"]),
            ("none", LORA_ENV, []),
        )
    ]
    wait_routable(module.frontend, [int(w.instance_id or 0) for w in workers])
    return Plain(*workers)


def test_an_adapter_on_a_daemon_without_lora_gets_the_daemons_refusal(
    module: Module, plain: Plain
) -> None:
    """The daemon's `welcome` does not say whether it has LoRA: the load succeeds, as the
    worker's own flag says, and a request for the adapter gets the daemon's 400."""
    uri = module.adapter("sql-plain")
    body = {"lora_name": "sql-plain", "source": {"uri": uri}}
    (loaded,) = call(module, plain.lora, "load_lora", body)
    assert loaded["status"] == "success", loaded
    module.frontend.wait_for_model("sql-plain")
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(module.frontend).completions.create(
            model="sql-plain", prompt=fresh_prompt(4), max_tokens=2
        )
    assert "LoRA is not enabled" in str(refused.value), refused.value
    (unloaded,) = call(module, plain.lora, "unload_lora", {"lora_name": "sql-plain"})
    assert unloaded["status"] == "success", unloaded
    module.frontend.wait_for_model("sql-plain", present=False)


def test_with_hot_swap_enabled_a_reload_replaces_the_adapter(module: Module, plain: Plain) -> None:
    """DYN_LORA_HOTSWAP_ENABLED: loading a loaded name again swaps its path in place (same id,
    same card) and clears the daemon's prefix cache, as dynamo.vllm does."""
    first = {"lora_name": "swap", "source": {"uri": module.adapter("swap-v1")}}
    (loaded,) = call(module, plain.lora, "load_lora", first)
    assert loaded["status"] == "success" and loaded["hot_swap"] is False, loaded
    module.frontend.wait_for_model("swap")
    second = {"lora_name": "swap", "source": {"uri": module.adapter("swap-v2")}}
    assert call(module, plain.lora, "load_lora", second) == [
        {
            "status": "success",
            "message": "LoRA adapter 'swap' hot-swapped successfully",
            "lora_name": "swap",
            "lora_id": loaded["lora_id"],
            "hot_swap": True,
        }
    ]
    assert "swap" in module.frontend.models()
    (unloaded,) = call(module, plain.lora, "unload_lora", {"lora_name": "swap"})
    assert unloaded["status"] == "success", unloaded
    module.frontend.wait_for_model("swap", present=False)


def test_loading_without_dyn_lora_enabled_gets_dynamos_error(module: Module, plain: Plain) -> None:
    body = {"lora_name": "sql-unset", "source": {"uri": module.adapter("sql-unset")}}
    assert call(module, plain.unset, "load_lora", body) == [
        {
            "status": "error",
            "message": "LoRAManager not initialized. Set DYN_LORA_ENABLED=true to enable "
            "URI-based LoRA loading.",
        }
    ]
    assert call(module, plain.unset, "list_loras", {}) == [
        {"status": "success", "loras": {}, "count": 0}
    ]


def test_a_worker_without_enable_lora_serves_no_lora_endpoints(
    module: Module, plain: Plain
) -> None:
    worker = plain.none
    planes = module.cluster.planes
    assert planes.instances_of(worker.namespace, worker.component, "generate")
    for endpoint in ("load_lora", "unload_lora", "list_loras"):
        assert not planes.instances_of(worker.namespace, worker.component, endpoint)
    # Dynamo's system status server says so where a user would load one.
    body = {"lora_name": "sql-none", "source": {"uri": module.adapter("sql-none")}}
    url = f"http://127.0.0.1:{worker.system_port}/v1/loras"
    status, reply = http_json("POST", url, body)
    assert status >= 400 and "LoRA management not available" in str(reply), (status, reply)
    assert "sql-none" not in module.frontend.models()


def test_prefill_and_decode_both_run_the_adapter(module: Module) -> None:
    """Loaded into a prefill and a decode worker (each its own card, as dynamo.vllm's), an
    adapter's request runs with it on both daemons: both stores carry its name."""
    cluster = module.cluster
    lora_args = ("--enable-lora", "--max-loras", "2")
    daemons = {
        mode: cluster.engined_daemon(
            *FAST_ARGS,
            *lora_args,
            "--worker-type",
            mode,
            *(HANDOFF_ARGS if mode == "prefill" else ()),
            name=f"pd-engined-{mode}",
        )
        for mode in ("prefill", "decode")
    }
    workers = {
        mode: add_worker(
            cluster,
            daemon,
            name=f"pd-worker-{mode}",
            model="tiny-pd-lora",
            namespace="pd-lora",
            disaggregation_mode=mode,
            env=LORA_ENV,
            extra_args=lora_args,
        )
        for mode, daemon in daemons.items()
    }
    wait_routable(
        module.frontend,
        [int(w.instance_id or 0) for w in workers.values()],
        prefill_model="tiny-pd-lora",
    )
    body = {"lora_name": "sql-pd", "source": {"uri": module.adapter("sql-pd")}}
    for worker in workers.values():
        (loaded,) = call(module, worker, "load_lora", body)
        assert loaded["status"] == "success", loaded
    module.frontend.wait_for_model("sql-pd")
    prompt = fresh_prompt(2 * BLOCK_SIZE)
    reply = openai_client(module.frontend).completions.create(
        model="sql-pd", prompt=prompt, max_tokens=3
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    first, sql_id = prompt_ids(prompt)[0], dynamo_lora_id(module, "sql-pd")
    for mode, daemon in daemons.items():
        stores = poll_until(
            f"the {mode} daemon's stores of the adapter's prompt",
            functools.partial(stores_of, daemon, first),
            EVENTS_TIMEOUT_S,
            daemon.describe,
        )
        assert {(s.lora_id, s.lora_name) for s in stores} == {(sql_id, "sql-pd")}, mode
