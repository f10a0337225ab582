"""`engined dynamo-worker` behind a real NVIDIA Dynamo 1.6.1 frontend (`--router-mode kv`).

One frontend for the module; each group of daemons and workers is a module-scoped fixture
of its own namespace and model name, started the first time a test needs it:

- `agg`: one daemon, one worker (model "tiny");
- `kv_pair`: two daemons, two workers ("tiny-kv"), behind a second frontend that sees their
  namespace only (so that its KV event counters are theirs);
- `disagg`: a prefill daemon and a decode daemon behind a prefill and a decode worker
  ("tiny-pd");
- `paced`: a daemon paced in real time (20 ms per decode pass, "tiny-paced");
- `strict`: a daemon with a 64-token budget and no chunked prefill, so a 64-token context
  ("tiny-strict").

The tiny model's words are one token each, so the prompts are `words(n)`: completions count
exactly n prompt tokens, chats one more (the template's BOS); the tests read
`usage.prompt_tokens` and derive the vLLM prefix hit of a full repeat from it. The worker
sets the model's vocabulary on the daemon without its special ids, so no EOS ever comes
out: every request runs to `max_tokens`, each generated token one word of the text.

Every wait polls a condition under a deadline. A group is used once the frontend's routers
have taken in its workers (`wait_routable`); KV routing is deterministic because a prompt is
repeated only once the frontend's indexer has applied the `stored` event of its first send.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from tests.interop.dynamo_cluster import (
    TOKEN_IDS_NVEXT,
    DynamoCluster,
    Frontend,
    OpenAIError,
    chat,
    chunk_token_ids,
    completions,
    dynamo_cluster,
    request_id_of,
    stream_text,
    stream_usage,
)
from tests.interop.dynamo_worker_support import (
    BLOCK_ARGS,
    BLOCK_SIZE,
    FAST_ARGS,
    AbandonedStream,
    EnginedGroup,
    add_frontend,
    add_pd_group,
    add_worker,
    busy,
    cached_after_full_repeat,
    completion_words,
    fresh_prompt,
    kv_events_applied,
    poll_until,
    rank_stats,
    run_failing_worker,
    wait_idle,
    wait_routable,
    welcome,
)
from tests.interop.peers import require_peers
from tests.interop.tiny_model import EOS_ID, word

VOCAB_SIZE: Final = 1000  # the tiny model's config.json
SPECIAL_IDS: Final = [0, 1, 2]  # <unk> <s> </s>
IDLE_TIMEOUT_S: Final = 10.0
EVENTS_TIMEOUT_S: Final = 20.0
REFUSAL_TIMEOUT_S: Final = 20.0
STREAM_TIMEOUT_S: Final = 20.0
CONNECT_TIMEOUT_S: Final = 2.0
# A cold import of Dynamo on a busy 2-core machine, on top of the worker's connect timeout.
EXIT_MARGIN_S: Final = 30.0


@dataclass
class Module:
    cluster: DynamoCluster
    frontend: Frontend


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Module]:
    python = require_peers()
    with dynamo_cluster(python, tmp_path_factory.mktemp("dynamo-worker")) as cluster:
        frontend = cluster.frontend(router_mode="kv")
        yield Module(cluster, frontend)
        codes = cluster.close()
    assert codes and set(codes.values()) == {0}, f"SIGTERM exit codes {codes}\n{cluster.describe()}"


def _group(
    module: Module,
    model: str,
    namespace: str,
    daemon_args: list[tuple[str, ...]],
    frontend: Frontend | None = None,
) -> EnginedGroup:
    """Aggregated daemons with a worker each, routable by `frontend` (the module's)."""
    cluster = module.cluster
    group = EnginedGroup(model, namespace, [], [])
    for i, args in enumerate(daemon_args):
        daemon = cluster.engined_daemon(*args, name=f"{namespace}-engined-{i}")
        group.daemons.append(daemon)
        group.workers.append(
            add_worker(
                cluster, daemon, name=f"{namespace}-worker-{i}", model=model, namespace=namespace
            )
        )
    wait_routable(frontend or module.frontend, group.worker_ids())
    return group


@pytest.fixture(scope="module")
def agg(module: Module) -> EnginedGroup:
    return _group(module, "tiny", "agg", [FAST_ARGS])


@dataclass
class KvPair:
    group: EnginedGroup
    frontend: Frontend


@pytest.fixture(scope="module")
def kv_pair(module: Module) -> KvPair:
    # A frontend of its own, that sees the two workers only: its KV event counters are
    # theirs (`kv_events_applied`).
    frontend = add_frontend(module.cluster, name="frontend-kv", namespace="kv")
    return KvPair(_group(module, "tiny-kv", "kv", [FAST_ARGS, FAST_ARGS], frontend), frontend)


@pytest.fixture(scope="module")
def paced(module: Module) -> EnginedGroup:
    return _group(module, "tiny-paced", "paced", [(*BLOCK_ARGS, *PACING)])


@pytest.fixture(scope="module")
def strict(module: Module) -> EnginedGroup:
    budget = ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "64")
    return _group(module, "tiny-strict", "strict", [(*FAST_ARGS, *budget)])


PACING = ("--speedup-ratio", "1", "--perf-model", "fixed", "--fixed-decode-ms-per-pass", "20")


@pytest.fixture(scope="module")
def disagg(module: Module) -> EnginedGroup:
    return _pd_group(module, "pd", FAST_ARGS)


@pytest.fixture(scope="module")
def paced_disagg(module: Module) -> EnginedGroup:
    return _pd_group(module, "pdpaced", (*BLOCK_ARGS, *PACING))


def _pd_group(module: Module, namespace: str, daemon_args: tuple[str, ...]) -> EnginedGroup:
    group = add_pd_group(module.cluster, namespace, daemon_args)
    wait_routable(module.frontend, group.worker_ids(), prefill_model=group.model)
    return group


# --- reading replies ------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What a reply (unary or stream) of either endpoint says."""

    request_id: str
    text: str
    finish_reasons: list[str]
    usage: dict[str, Any]
    streamed_token_ids: list[int] | None  # the ids of every chunk (streams only)

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {})["cached_tokens"])


def _answer(reply: dict[str, Any] | list[dict[str, Any]]) -> Answer:
    if isinstance(reply, list):
        usage = stream_usage(reply)
        assert usage is not None, f"no usage chunk: {reply}"
        finish = [
            choice["finish_reason"]
            for chunk in reply
            for choice in chunk.get("choices") or ()
            if choice.get("finish_reason")
        ]
        ids = [token for chunk in reply for token in chunk_token_ids(chunk)]
        return Answer(request_id_of(reply), stream_text(reply), finish, usage, ids)
    (choice,) = reply["choices"]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return Answer(request_id_of(reply), text or "", [choice["finish_reason"]], reply["usage"], None)


def ask(
    frontend: Frontend,
    endpoint: str,
    prompt: str,
    *,
    model: str,
    max_tokens: int,
    stream: bool = False,
) -> Answer:
    """One request; a stream also asks for every chunk's token ids (`TOKEN_IDS_NVEXT`)."""
    call = completions if endpoint == "completions" else chat
    if stream:
        chunks = call(
            frontend, prompt, model=model, max_tokens=max_tokens, stream=True, nvext=TOKEN_IDS_NVEXT
        )
        return _answer(chunks)
    return _answer(call(frontend, prompt, model=model, max_tokens=max_tokens))


def assert_full_answer(answer: Answer, max_tokens: int, what: object = "") -> None:
    """Non-empty text of exactly `max_tokens` tokens, one word each, ended by the length.

    A stream's chunks are not one per token: like vLLM's output collector, the worker merges
    the outputs that queued up while it was busy into one chunk, so the tokens are counted,
    not the chunks."""
    context = f"{what}: {answer}"
    assert answer.usage["completion_tokens"] == max_tokens, context
    generated = completion_words(answer.text)
    assert len(generated) == max_tokens, context
    assert all(w.startswith("w") for w in generated), context
    assert answer.finish_reasons == ["length"], context
    if answer.streamed_token_ids is not None:
        assert len(answer.streamed_token_ids) == max_tokens, context
        assert [word(t) for t in answer.streamed_token_ids] == generated, context


# --- aggregated -----------------------------------------------------------------------------


def test_worker_gives_the_daemon_the_model_vocabulary(agg: EnginedGroup) -> None:
    (daemon,), (worker,) = agg.daemons, agg.workers
    hello = welcome(daemon)
    assert hello.vocab_size == VOCAB_SIZE, hello
    # Never the model's special ids: no EOS ends a completion early.
    assert hello.excluded_token_ids == SPECIAL_IDS, hello
    assert EOS_ID in hello.excluded_token_ids, hello
    assert hello.fpm_worker_id == str(worker.instance_id), (hello, worker.instance_id)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_replies_have_text_and_exactly_max_tokens(
    module: Module, agg: EnginedGroup, endpoint: str, stream: bool
) -> None:
    max_tokens = 7
    answer = ask(
        module.frontend,
        endpoint,
        fresh_prompt(24),
        model=agg.model,
        max_tokens=max_tokens,
        stream=stream,
    )
    assert_full_answer(answer, max_tokens)
    # One token per word; the chat template adds a BOS.
    assert answer.usage["prompt_tokens"] == 24 + (endpoint == "chat"), answer
    (route,) = module.frontend.wait_route(answer.request_id)
    assert (route.worker_id, route.outcome) == (agg.worker_ids()[0], "success"), route


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_repeated_prompt_reports_the_vllm_cached_tokens(
    module: Module, agg: EnginedGroup, endpoint: str
) -> None:
    prompt = fresh_prompt(128)
    first = ask(module.frontend, endpoint, prompt, model=agg.model, max_tokens=4)
    second = ask(module.frontend, endpoint, prompt, model=agg.model, max_tokens=4)
    prompt_tokens = first.usage["prompt_tokens"]
    assert prompt_tokens == 128 + (endpoint == "chat"), first
    assert first.cached_tokens == 0, first
    # 128 tokens -> 112 (the last block is recomputed), 129 (chat) -> 128.
    assert second.usage["prompt_tokens"] == prompt_tokens, second
    assert second.cached_tokens == cached_after_full_repeat(prompt_tokens), second
    assert_full_answer(second, 4)


# --- KV routing over two workers ------------------------------------------------------------


def test_kv_routing_sends_every_repeat_to_the_worker_that_cached_it(kv_pair: KvPair) -> None:
    frontend, model = kv_pair.frontend, kv_pair.group.model
    worker_ids = kv_pair.group.worker_ids()
    assert len(set(worker_ids)) == 2, worker_ids

    def stored() -> int:
        return kv_events_applied(frontend).get(("stored", "ok"), 0)

    def stored_reached(count: int) -> Callable[[], bool]:
        return lambda: stored() >= count

    prompts = [fresh_prompt(128) for _ in range(4)]
    blocks = 128 // BLOCK_SIZE
    initial = stored()
    for i, prompt in enumerate(prompts):
        owner = worker_ids[i % 2]
        # The first send is pinned, so that both workers end up holding prompts.
        reply = completions(
            frontend, prompt, model=model, max_tokens=4, nvext={"backend_instance_id": owner}
        )
        first = _answer(reply)
        assert first.usage["prompt_tokens"] == 128, first
        assert first.cached_tokens == 0, first
        (route,) = frontend.wait_route(first.request_id)
        assert route.worker_id == owner, route
        # The router knows the blocks once its indexer applied the worker's `stored` event:
        # one per new prompt (its 8 blocks are prefilled in one pass); each repeat adds one
        # more, vLLM's twin of the last block, which the fully cached prompt recomputes.
        poll_until(
            f"the frontend to apply the stored event of prompt {i}",
            stored_reached(initial + 3 * i + 1),
            EVENTS_TIMEOUT_S,
            frontend.describe,
        )
        for send in (2, 3):
            again = _answer(completions(frontend, prompt, model=model, max_tokens=4))
            what = f"prompt {i} send {send} (owner {owner})"
            assert again.cached_tokens == cached_after_full_repeat(128), f"{what}: {again}"
            assert_full_answer(again, 4, what)
            (route,) = frontend.wait_route(again.request_id)
            assert (route.worker_id, route.overlap_blocks) == (owner, blocks), f"{what}: {route}"
    poll_until(
        "the frontend to apply every repeat's twin",
        stored_reached(initial + 3 * len(prompts)),
        EVENTS_TIMEOUT_S,
        frontend.describe,
    )
    applied = kv_events_applied(frontend)
    assert applied[("stored", "ok")] == initial + 3 * len(prompts), applied
    refused = {key: n for key, n in applied.items() if key[1] != "ok" and n}
    assert not refused, f"events the frontend's indexer refused: {refused}"


# --- prefill/decode -------------------------------------------------------------------------


def test_prefill_and_decode_workers_serve_a_batch_and_free_everything(
    module: Module, disagg: EnginedGroup
) -> None:
    frontend, model = module.frontend, disagg.model
    prefill_id, decode_id = disagg.worker_ids()
    max_tokens = 6

    # A prompt twice in a row: the decode's usage carries the prefill daemon's prefix hit.
    repeated = fresh_prompt(128)
    first = ask(frontend, "completions", repeated, model=model, max_tokens=max_tokens)
    second = ask(frontend, "completions", repeated, model=model, max_tokens=max_tokens)
    assert first.cached_tokens == 0, first
    assert second.cached_tokens == cached_after_full_repeat(second.usage["prompt_tokens"]), second

    # Six more at once, of both endpoints, streamed and not.
    shapes = [
        ("completions", 40, False),
        ("completions", 70, True),
        ("completions", 130, False),
        ("chat", 33, False),
        ("chat", 64, True),
        ("chat", 100, False),
    ]
    prompts = [(endpoint, fresh_prompt(n), stream) for endpoint, n, stream in shapes]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(ask, frontend, e, p, model=model, max_tokens=max_tokens, stream=s)
            for e, p, s in prompts
        ]
        batch = [f.result() for f in futures]

    for i, answer in enumerate([first, second, *batch]):
        assert_full_answer(answer, max_tokens, f"request {i}")
        lines = frontend.wait_route(answer.request_id, count=2)
        phases = {line.phase: line for line in lines}
        assert set(phases) == {"Prefill", "Decode"}, lines
        assert phases["Prefill"].worker_id == prefill_id, lines
        assert phases["Decode"].worker_id == decode_id, lines
        assert all(line.outcome == "success" for line in lines), lines

    # Every source was released on the prefill daemon, every destination freed on decode.
    for daemon in disagg.daemons:
        wait_idle(daemon, IDLE_TIMEOUT_S)


# --- a client that goes away ----------------------------------------------------------------


def test_a_client_hanging_up_mid_stream_leaves_the_daemon_idle(
    module: Module, paced: EnginedGroup
) -> None:
    (daemon,) = paced.daemons
    assert welcome(daemon).speedup_ratio == 1.0
    # 2000 tokens at 20 ms a pass: 40 s of decode, far longer than the test lets it run.
    stream = AbandonedStream(
        module.frontend,
        {"model": paced.model, "prompt": fresh_prompt(40), "max_tokens": 2000},
        timeout=STREAM_TIMEOUT_S,
    )
    try:
        chunks = stream.read_chunks(3)
        assert all(c["choices"][0]["text"] for c in chunks), chunks
        stats = rank_stats(daemon)
        assert [s.running for s in stats] == [1], busy(stats)
    finally:
        stream.hang_up()
    wait_idle(daemon, IDLE_TIMEOUT_S)
    # And the worker still serves.
    answer = ask(module.frontend, "completions", fresh_prompt(8), model=paced.model, max_tokens=2)
    assert_full_answer(answer, 2)


def test_a_client_hanging_up_mid_decode_frees_both_sides_of_the_handoff(
    module: Module, paced_disagg: EnginedGroup
) -> None:
    prefill, decode = paced_disagg.daemons
    stream = AbandonedStream(
        module.frontend,
        {"model": paced_disagg.model, "prompt": fresh_prompt(100), "max_tokens": 2000},
        timeout=STREAM_TIMEOUT_S,
    )
    try:
        chunks = stream.read_chunks(3)
        assert all(c["choices"][0]["text"] for c in chunks), chunks
        assert [s.running for s in rank_stats(decode)] == [1], busy(rank_stats(decode))
    finally:
        stream.hang_up()
    # The decode request is cancelled; the prefill's source was released at activation.
    wait_idle(decode, IDLE_TIMEOUT_S)
    wait_idle(prefill, IDLE_TIMEOUT_S)
    answer = ask(
        module.frontend, "completions", fresh_prompt(8), model=paced_disagg.model, max_tokens=2
    )
    assert_full_answer(answer, 2)
    wait_idle(decode, IDLE_TIMEOUT_S)
    wait_idle(prefill, IDLE_TIMEOUT_S)


# --- a refused request ----------------------------------------------------------------------


def _refused(module: Module, strict: EnginedGroup) -> OpenAIError:
    # 100 tokens. No chunked prefill and a 64-token budget: a 64-token context, which the
    # daemon advertises (welcome.max_model_len) and the worker gives the frontend.
    with pytest.raises(OpenAIError) as caught:
        completions(
            module.frontend,
            fresh_prompt(100),
            model=strict.model,
            max_tokens=4,
            timeout=REFUSAL_TIMEOUT_S,
        )
    return caught.value


def test_a_prompt_over_the_context_is_an_http_error(module: Module, strict: EnginedGroup) -> None:
    error = _refused(module, strict)
    assert 400 <= error.status < 600, error
    (daemon,) = strict.daemons
    wait_idle(daemon, IDLE_TIMEOUT_S)
    # Daemon and worker go on serving.
    answer = ask(module.frontend, "completions", fresh_prompt(10), model=strict.model, max_tokens=3)
    assert_full_answer(answer, 3)


def test_the_frontend_refuses_it_by_the_context_the_daemon_advertises(
    module: Module, strict: EnginedGroup
) -> None:
    # (A request the daemon itself rejects fails with engined's reason: tests/dynamo.)
    error = _refused(module, strict)
    assert error.status == 400, error
    assert '"type":"context_length","limit":64,"actual":100' in error.body, error.body


# --- start-up failures ----------------------------------------------------------------------


def test_no_daemon_is_a_one_line_error(module: Module, tmp_path: Path) -> None:
    nowhere = f"ipc://{tmp_path}/no-daemon-control"
    result = run_failing_worker(
        module.cluster,
        nowhere,
        name="worker-without-daemon",
        namespace="nodaemon",
        timeout=CONNECT_TIMEOUT_S + EXIT_MARGIN_S,
        extra_args=["--connect-timeout", str(CONNECT_TIMEOUT_S)],
    )
    assert result.returncode == 1, result
    assert result.last_stderr_line.startswith("engined dynamo-worker:"), result
    assert nowhere in result.last_stderr_line, result
    assert "Traceback" not in result.stdout + result.stderr, result


def test_a_prefill_worker_refuses_an_aggregated_daemon(module: Module, agg: EnginedGroup) -> None:
    (daemon,) = agg.daemons
    result = run_failing_worker(
        module.cluster,
        daemon.control,
        name="prefill-worker-on-agg",
        namespace="wrongrole",
        disaggregation_mode="prefill",
        timeout=CONNECT_TIMEOUT_S + EXIT_MARGIN_S,
        extra_args=["--connect-timeout", str(CONNECT_TIMEOUT_S)],
    )
    assert result.returncode == 1, result
    assert result.last_stderr_line.startswith("engined dynamo-worker:"), result
    assert "--worker-type" in result.last_stderr_line, result
    assert "Traceback" not in result.stdout + result.stderr, result
    # The daemon was left as it was.
    assert welcome(daemon).worker_type == "aggregated"
