"""`engined dynamo-worker` in Dynamo 1.6.1's production configuration: etcd discovery, with
the request plane on tcp or NATS and the event plane on zmq or NATS.

One real etcd and one real `nats-server -js` serve the module (`servers`); every test runs
its own cluster (a frontend and engined daemon + worker pairs, all on the same `Planes`) in
a Dynamo namespace of its own, its frontend scoped to it, so tests share the servers and
never each other's workers, routers or KV event counters.

The tiny model's words are one token each: a completion of `words(n)` has n prompt tokens,
a chat n + 1 (the template's BOS). Every daemon has 16-token blocks, so a 128-token prompt
is 8 blocks and its full repeat hits vLLM's 112 cached tokens. Waits poll observable state
under a deadline: etcd keys, the frontend's `/health` and metrics, its route log lines, the
daemons' `stats`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from tests.interop.dynamo_cluster import (
    TOKEN_IDS_NVEXT,
    DynamoCluster,
    Frontend,
    OnChunk,
    chat,
    chunk_token_ids,
    completions,
    request_id_of,
    sets_on_first_token,
    stream_text,
    stream_usage,
)
from tests.interop.dynamo_planes import EventPlane, Planes, RequestPlane
from tests.interop.dynamo_worker_support import (
    BLOCK_ARGS,
    BLOCK_SIZE,
    FAST_ARGS,
    EnginedGroup,
    add_pd_group,
    add_worker,
    cached_after_full_repeat,
    fresh_prompt,
    kv_events_applied,
    poll_until,
    rank_stats,
    wait_idle,
    wait_routable,
)
from tests.interop.etcd_nats import CLEAN_EXIT, INSTALL_LINE, EtcdNats, MissingServer, find_binary
from tests.interop.peers import require_peers
from tests.interop.tiny_model import build_tiny_model, word

EVENTS_TIMEOUT_S: Final = 20.0
IDLE_TIMEOUT_S: Final = 10.0
STREAM_TIMEOUT_S: Final = 60.0
LEASE_TIMEOUT_S: Final = 30.0
PROMPT_BLOCKS: Final = 8
PROMPT_TOKENS: Final = PROMPT_BLOCKS * BLOCK_SIZE
# Killed workers' etcd leases run out after this many seconds (Dynamo's default: 30).
LEASE_TTL_S: Final = 5
# 20 ms a decode pass in real time: a 100-token stream lasts 2 s, long enough to be killed
# in the middle of.
PACING: Final = (
    "--speedup-ratio",
    "1",
    "--perf-model",
    "fixed",
    "--fixed-decode-ms-per-pass",
    "20",
)

# --- the module's servers and each test's cluster -------------------------------------------


@dataclass
class Servers:
    python: Path
    etcd_nats: EtcdNats
    model_path: Path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    python = require_peers()
    workdir = tmp_path_factory.mktemp("etcd-nats")
    model_path = build_tiny_model(workdir / "tiny-model", python=python)
    with EtcdNats(workdir) as etcd_nats:
        yield Servers(python, etcd_nats, model_path)
    codes = etcd_nats.stop()
    assert codes == CLEAN_EXIT, codes


@dataclass
class Scenario:
    """A test's cluster on the module's servers; the names of the processes it killed."""

    cluster: DynamoCluster
    killed: set[str]


@pytest.fixture
def scenario(servers: Servers, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """`scenario(request_plane, event_plane)`: a cluster of those planes over etcd; every
    process the test did not kill exits 0 on SIGTERM at the end."""
    made: list[Scenario] = []

    def make(request_plane: RequestPlane, event_plane: EventPlane) -> Scenario:
        planes = Planes(servers.etcd_nats.discovery(), request=request_plane, event=event_plane)
        cluster = DynamoCluster(
            servers.python, tmp_path, model_path=servers.model_path, planes=planes
        )
        made.append(Scenario(cluster, set()))
        return made[-1]

    yield make
    for each in made:
        codes = each.cluster.close()
        clean = {name: code for name, code in codes.items() if name not in each.killed}
        assert set(clean.values()) <= {0}, f"SIGTERM exit codes {codes}\n{each.cluster.describe()}"


def start_pairs(
    cluster: DynamoCluster,
    namespace: str,
    count: int,
    daemon_args: tuple[str, ...] = FAST_ARGS,
    worker_env: dict[str, str] | None = None,
    first: int = 0,
) -> EnginedGroup:
    """`count` aggregated daemon + worker pairs serving `tiny-<namespace>`."""
    group = EnginedGroup(f"tiny-{namespace}", namespace, [], [])
    for i in range(first, first + count):
        daemon = cluster.engined_daemon(*daemon_args, name=f"{namespace}-engined-{i}")
        group.daemons.append(daemon)
        worker = add_worker(
            cluster,
            daemon,
            name=f"{namespace}-worker-{i}",
            model=group.model,
            namespace=namespace,
            env=worker_env,
        )
        group.workers.append(worker)
    return group


# --- replies ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    request_id: str
    text: str
    finish_reasons: list[str]
    usage: dict[str, Any]

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {})["cached_tokens"])


def ask(
    frontend: Frontend,
    endpoint: str,
    prompt: str,
    *,
    model: str,
    max_tokens: int,
    stream: bool = False,
    on_chunk: OnChunk | None = None,
    **fields: Any,
) -> Answer:
    """One request of either endpoint, unary or streamed (a stream's chunks must carry
    exactly the ids of its words, and each is given to `on_chunk` as it arrives)."""
    call = completions if endpoint == "completions" else chat
    if not stream:
        reply = call(frontend, prompt, model=model, max_tokens=max_tokens, **fields)
        (choice,) = reply["choices"]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return Answer(request_id_of(reply), text or "", [choice["finish_reason"]], reply["usage"])
    chunks = call(
        frontend,
        prompt,
        model=model,
        max_tokens=max_tokens,
        stream=True,
        nvext=TOKEN_IDS_NVEXT,
        timeout=STREAM_TIMEOUT_S,
        on_chunk=on_chunk,
        **fields,
    )
    usage = stream_usage(chunks)
    assert usage is not None, f"no usage chunk: {chunks}"
    text = stream_text(chunks)
    ids = [token for chunk in chunks for token in chunk_token_ids(chunk)]
    assert [word(t) for t in ids] == text.split(), chunks
    finish = [
        choice["finish_reason"]
        for chunk in chunks
        for choice in chunk.get("choices") or ()
        if choice.get("finish_reason")
    ]
    return Answer(request_id_of(chunks), text, finish, usage)


def assert_full(answer: Answer, max_tokens: int, prompt_tokens: int, what: object = "") -> None:
    """Exactly `max_tokens` words generated (no EOS exists), the prompt counted exactly."""
    context = f"{what}: {answer}"
    generated = answer.text.split()
    assert len(generated) == max_tokens, context
    assert all(w.startswith("w") for w in generated), context
    assert answer.finish_reasons == ["length"], context
    assert answer.usage["completion_tokens"] == max_tokens, context
    assert answer.usage["prompt_tokens"] == prompt_tokens, context


def stored_events(frontend: Frontend) -> int:
    return kv_events_applied(frontend).get(("stored", "ok"), 0)


def wait_stored(frontend: Frontend, count: int) -> None:
    """Until the frontend's indexer applied `count` `stored` events (a new prompt's blocks
    come in one: its prefill is one pass)."""
    poll_until(
        f"{frontend.name} to apply {count} stored KV events",
        lambda: stored_events(frontend) >= count,
        EVENTS_TIMEOUT_S,
        frontend.describe,
    )


# --- aggregated, every request x event plane ------------------------------------------------

PLANE_PAIRS: Final = [("tcp", "zmq"), ("tcp", "nats"), ("nats", "zmq"), ("nats", "nats")]
# Fully tested; the other two are smoke tests (one pair, unary requests).
FULL_PAIRS: Final = [("tcp", "zmq"), ("nats", "nats")]


def plane_params(pairs: list[tuple[str, str]]) -> list[Any]:
    """(request plane, event plane) parameters, with ids like `nats-zmq`."""
    return [pytest.param(r, e, id=f"{r}-{e}") for r, e in pairs]


# The request plane an instance's etcd record says it serves on.
TRANSPORT_KIND: Final = {"tcp": "tcp", "nats": "nats_tcp"}


@pytest.mark.parametrize(("request_plane", "event_plane"), plane_params(PLANE_PAIRS))
def test_aggregated_pairs_serve_and_route_on_their_kv_events(
    scenario: Any, request_plane: RequestPlane, event_plane: EventPlane
) -> None:
    full = (request_plane, event_plane) in FULL_PAIRS
    namespace = f"agg-{request_plane}-{event_plane}"
    cluster = scenario(request_plane, event_plane).cluster
    frontend = cluster.frontend(namespace=namespace)
    group = start_pairs(cluster, namespace, 2 if full else 1)
    ids = group.worker_ids()
    wait_routable(frontend, ids)
    records = {
        int(r["instance_id"]): r
        for r in cluster.planes.discovery.instances()
        if r.get("namespace") == namespace
    }
    assert set(records) == set(ids), records
    kinds = {kind for r in records.values() for kind in r["transport"]}
    assert kinds == {TRANSPORT_KIND[request_plane]}, records

    # Each worker prefills a prompt of its own (pinned), then every repeat goes back to it.
    prompts = {owner: fresh_prompt(PROMPT_TOKENS) for owner in ids}
    for owner, prompt in prompts.items():
        first = ask(
            frontend,
            "completions",
            prompt,
            model=group.model,
            max_tokens=4,
            nvext={"backend_instance_id": owner},
        )
        assert_full(first, 4, PROMPT_TOKENS, f"first send to {owner}")
        assert first.cached_tokens == 0, first
        (route,) = frontend.wait_route(first.request_id)
        assert route.worker_id == owner, route
    wait_stored(frontend, len(ids))
    for owner, prompt in prompts.items():
        again = ask(frontend, "completions", prompt, model=group.model, max_tokens=4)
        assert_full(again, 4, PROMPT_TOKENS, f"repeat for {owner}")
        assert again.cached_tokens == cached_after_full_repeat(PROMPT_TOKENS), again
        (route,) = frontend.wait_route(again.request_id)
        assert (route.worker_id, route.overlap_blocks, route.outcome) == (
            owner,
            PROMPT_BLOCKS,
            "success",
        ), route

    for endpoint in ("completions", "chat"):
        for stream in (False, True) if full else (False,):
            answer = ask(
                frontend, endpoint, fresh_prompt(24), model=group.model, max_tokens=7, stream=stream
            )
            assert_full(answer, 7, 24 + (endpoint == "chat"), (endpoint, stream))
            assert answer.cached_tokens == 0, answer
            (route,) = frontend.wait_route(answer.request_id)
            assert route.worker_id in ids and route.outcome == "success", route
    for daemon in group.daemons:
        wait_idle(daemon, IDLE_TIMEOUT_S)


# --- prefill/decode -------------------------------------------------------------------------


@pytest.mark.parametrize(("request_plane", "event_plane"), plane_params(FULL_PAIRS))
def test_prefill_and_decode_pairs_serve_with_the_prefill_routed_on_overlap(
    scenario: Any, request_plane: RequestPlane, event_plane: EventPlane
) -> None:
    namespace = f"pd-{request_plane}-{event_plane}"
    cluster = scenario(request_plane, event_plane).cluster
    frontend = cluster.frontend(namespace=namespace)
    group = add_pd_group(cluster, namespace, FAST_ARGS)
    model = group.model
    prefill_id, decode_id = group.worker_ids()
    wait_routable(frontend, [prefill_id, decode_id], prefill_model=model)

    def phases(answer: Answer) -> dict[str, tuple[int, int, str]]:
        lines = frontend.wait_route(answer.request_id, count=2)
        return {line.phase: (line.worker_id, line.overlap_blocks, line.outcome) for line in lines}

    prompt = fresh_prompt(PROMPT_TOKENS)
    first = ask(frontend, "completions", prompt, model=model, max_tokens=6)
    assert_full(first, 6, PROMPT_TOKENS, "first")
    assert first.cached_tokens == 0, first
    assert phases(first) == {
        "Prefill": (prefill_id, 0, "success"),
        "Decode": (decode_id, 0, "success"),
    }
    wait_stored(frontend, 1)
    second = ask(frontend, "completions", prompt, model=model, max_tokens=6)
    assert_full(second, 6, PROMPT_TOKENS, "repeat")
    assert second.cached_tokens == cached_after_full_repeat(PROMPT_TOKENS), second
    routes = phases(second)
    assert routes["Prefill"] == (prefill_id, PROMPT_BLOCKS, "success"), routes
    assert routes["Decode"][::2] == (decode_id, "success"), routes

    with ThreadPoolExecutor(max_workers=4) as pool:
        shapes = [
            ("completions", 40, True),
            ("chat", 64, True),
            ("chat", 33, False),
            ("completions", 70, False),
        ]
        futures = [
            pool.submit(ask, frontend, e, fresh_prompt(n), model=model, max_tokens=6, stream=s)
            for e, n, s in shapes
        ]
        for (endpoint, n, stream), future in zip(shapes, futures, strict=True):
            answer = future.result()
            assert_full(answer, 6, n + (endpoint == "chat"), (endpoint, n, stream))
            routes = phases(answer)
            assert {p: r[0] for p, r in routes.items()} == {
                "Prefill": prefill_id,
                "Decode": decode_id,
            }
    for daemon in group.daemons:
        wait_idle(daemon, IDLE_TIMEOUT_S)


# --- a pair killed mid-stream, then restarted -----------------------------------------------

STREAMS: Final = 6
STREAM_TOKENS: Final = 100


@pytest.mark.parametrize(("request_plane", "event_plane"), plane_params(FULL_PAIRS))
def test_a_killed_pair_s_streams_migrate_and_the_restarted_pair_serves(
    scenario: Any, request_plane: RequestPlane, event_plane: EventPlane
) -> None:
    run = scenario(request_plane, event_plane)
    cluster = run.cluster
    namespace = f"restart-{request_plane}-{event_plane}"
    # Round robin spreads the streams over both pairs; migration is the router's business.
    frontend = cluster.frontend(
        namespace=namespace, router_mode="round-robin", extra_args=["--migration-limit", "3"]
    )
    survivor = start_pairs(cluster, namespace, 1, (*BLOCK_ARGS, *PACING))
    victim = start_pairs(
        cluster, namespace, 1, (*BLOCK_ARGS, *PACING), {"ETCD_LEASE_TTL": str(LEASE_TTL_S)}, first=1
    )
    model = survivor.model
    (survivor_id,), (victim_id,) = survivor.worker_ids(), victim.worker_ids()
    # (A round-robin frontend routes to what `/health` lists, which `start_pairs` waited for.)

    prompts = [fresh_prompt(32) for _ in range(STREAMS)]
    begun = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(max_workers=STREAMS) as pool:
        futures = [
            pool.submit(
                ask,
                frontend,
                "completions",
                p,
                model=model,
                max_tokens=STREAM_TOKENS,
                stream=True,
                on_chunk=sets_on_first_token(b),
            )
            for p, b in zip(prompts, begun, strict=True)
        ]

        def running(group: EnginedGroup) -> int:
            return sum(s.running for s in rank_stats(group.daemons[0]))

        half = STREAMS // 2
        poll_until(
            f"every stream begun, {half} running on each pair",
            lambda: (
                all(b.is_set() for b in begun)
                and running(victim) == half
                and running(survivor) == half
            ),
            STREAM_TIMEOUT_S,
            cluster.describe,
        )
        for process in (victim.daemons[0], victim.workers[0]):
            assert process.proc is not None
            process.proc.kill()
            process.proc.wait()
            run.killed.add(process.name)
        answers = [f.result() for f in futures]
    # Every stream completes; the victim's continue on the survivor, which is given the
    # prompt and the tokens streamed so far (so its usage counts them as prompt).
    moves = []
    for i, answer in enumerate(answers):
        (route,) = frontend.wait_route(answer.request_id)
        assert (route.worker_id, route.outcome) == (survivor_id, "success"), route
        done = int(route.fields["migration.tokens_completed"])
        if route.fields["migration.is_retry"] == "true":
            assert int(route.fields["migration.from_worker_id"]) == victim_id, route
            assert 0 < done < STREAM_TOKENS, route
            moves.append(done)
        assert_full(answer, STREAM_TOKENS, 32 + done, f"stream {i}")
    assert len(moves) == half, frontend.describe()

    # The dead instance leaves etcd when its lease runs out, then the frontend forgets it.
    def forgotten() -> bool:
        return victim_id not in cluster.planes.instances_of(
            namespace, "backend", "generate"
        ) and not any(int(i["instance_id"]) == victim_id for i in frontend.instances())

    poll_until(
        f"instance {victim_id} gone from etcd and {frontend.name}",
        forgotten,
        LEASE_TIMEOUT_S,
        frontend.describe,
    )

    restarted = start_pairs(cluster, namespace, 1, (*BLOCK_ARGS, *PACING), first=2)
    (restarted_id,) = restarted.worker_ids()
    assert restarted_id not in (survivor_id, victim_id)
    pinned = ask(
        frontend,
        "completions",
        fresh_prompt(32),
        model=model,
        max_tokens=8,
        nvext={"backend_instance_id": restarted_id},
    )
    assert_full(pinned, 8, 32, "pinned to the restarted pair")
    (route,) = frontend.wait_route(pinned.request_id)
    assert (route.worker_id, route.outcome) == (restarted_id, "success"), route
    served = set()
    for _ in range(2):
        answer = ask(frontend, "completions", fresh_prompt(32), model=model, max_tokens=8)
        assert_full(answer, 8, 32, "round robin")
        served.add(frontend.wait_route(answer.request_id)[0].worker_id)
    assert served == {survivor_id, restarted_id}, served


def test_a_missing_server_binary_fails_naming_the_apt_get_line() -> None:
    with pytest.raises(MissingServer) as raised:
        find_binary("nats-server-not-installed")
    assert str(raised.value).startswith("nats-server-not-installed is not installed"), raised
    assert str(raised.value).endswith(f": {INSTALL_LINE}"), raised
