"""The messages a Dynamo worker sends a running daemon: `set_vocabulary`, `set_fpm_worker_id`,
`watch_load`, and the `welcome` fields it registers the model with.

Each runs against a real daemon process; bad values get an error naming the field and the
daemon goes on serving.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from engined.client import EngineClient, EngineError
from engined.core.vocab import EXCLUDED_TOKEN_IDS_MAX
from engined.wire.control import ErrorReply, Load
from engined.wire.fpm_schema import decode_fpm
from tests.server.daemon_harness import DaemonProcess, read_fpm, start_daemon
from tests.support import run

TIMEOUT_S = 10.0
FLAGS = (
    "--speedup-ratio",
    "0",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "64",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "256",
    "--max-model-len",
    "512",
)
DAEMON_FLAGS = FLAGS  # the `daemon` fixture's (tests/server/conftest.py)


def test_welcome_reports_what_a_model_card_needs(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            welcome = await client.hello(timeout=TIMEOUT_S)
            assert (welcome.max_num_seqs, welcome.max_num_batched_tokens) == (8, 256)
            assert welcome.max_model_len == 512
            assert welcome.enable_prefix_caching is True
            assert (welcome.kv_events_topic, welcome.kv_events_format) == ("", "vllm")
            assert welcome.speedup_ratio == 0.0
            assert welcome.vocab_size is None and welcome.excluded_token_ids == []
            assert welcome.fpm_worker_id  # hostname:pid until a worker sets its own

    run(scenario())


def test_set_vocabulary_bounds_generated_ids(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            await client.set_vocabulary(5, [0, 1, 2], timeout=TIMEOUT_S)
            welcome = await client.hello(timeout=TIMEOUT_S)
            assert (welcome.vocab_size, welcome.excluded_token_ids) == (5, [0, 1, 2])
            gen = await client.generate(list(range(40)), 64, timeout=TIMEOUT_S)
            assert len(gen.token_ids) == 64 and set(gen.token_ids) <= {3, 4}
            assert gen.finish_reason == "length"
            # Planned outputs are emitted as given, excluded ids included.
            planned = await client.generate(
                [7, 8], 3, output_token_ids=[0, 1, 2], timeout=TIMEOUT_S
            )
            assert planned.token_ids == [0, 1, 2]
            await client.set_vocabulary(None, timeout=TIMEOUT_S)
            gen = await client.generate(list(range(40)), 16, timeout=TIMEOUT_S)
            assert any(token >= 5 for token in gen.token_ids)
            assert (await client.hello(timeout=TIMEOUT_S)).vocab_size is None

    run(scenario())


@pytest.mark.parametrize(
    ("vocab_size", "excluded", "field"),
    [
        pytest.param(3, [0, 1, 2], "excluded_token_ids", id="nothing-left"),
        pytest.param(3, [3], "excluded_token_ids", id="excluded-past-vocab"),
    ],
)
def test_set_vocabulary_refuses_what_the_core_refuses(
    daemon: DaemonProcess, vocab_size: int, excluded: list[int], field: str
) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            with pytest.raises(EngineError) as refused:
                await client.set_vocabulary(vocab_size, excluded, timeout=TIMEOUT_S)
            assert refused.value.code == "invalid_request"
            assert field in refused.value.message
            # Nothing changed and the daemon goes on.
            assert (await client.hello(timeout=TIMEOUT_S)).vocab_size is None
            assert (
                await client.generate([1, 2, 3], 2, timeout=TIMEOUT_S)
            ).finish_reason == "length"

    run(scenario())


async def welcome_bytes(endpoint: str) -> bytes:
    """The encoded `welcome` a raw DEALER receives."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send(msgspec.msgpack.encode({"type": "hello"}))
        async with asyncio.timeout(TIMEOUT_S):
            return await sock.recv()
    finally:
        sock.close()
        ctx.term()


def test_excluded_ids_are_bounded_and_so_is_every_welcome(daemon: DaemonProcess) -> None:
    """At most EXCLUDED_TOKEN_IDS_MAX excluded ids: one more is refused naming the field and
    the bound, changing nothing; at the bound, a `welcome` grows by the ids alone (5 bytes
    each at most) and stays that size."""
    top = 2**32
    largest = list(range(top - EXCLUDED_TOKEN_IDS_MAX, top))  # 5 bytes each in msgpack

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            before = await welcome_bytes(daemon.control)
            with pytest.raises(EngineError) as refused:
                await client.set_vocabulary(None, [*largest, 0], timeout=TIMEOUT_S)
            assert refused.value.code == "invalid_request"
            assert refused.value.message == (
                "excluded_token_ids has 8193 ids, more than the 8192 allowed (a model's EOS "
                "and special tokens are far fewer)"
            )
            assert await welcome_bytes(daemon.control) == before
            await client.set_vocabulary(top, largest, timeout=TIMEOUT_S)
            try:
                after = await welcome_bytes(daemon.control)
                # The ids' array (3-byte header, 5 bytes an id) replaces an empty one (1 byte),
                # and `vocab_size` (a 10-byte key, a 9-byte uint64) appears.
                ids_bytes = 3 + 5 * EXCLUDED_TOKEN_IDS_MAX
                assert ids_bytes == 40_963
                assert len(after) == len(before) + ids_bytes - 1 + (1 + 10) + 9
                assert await welcome_bytes(daemon.control) == after
            finally:
                await client.set_vocabulary(None, timeout=TIMEOUT_S)

    run(scenario())


def test_malformed_setting_messages_get_errors_naming_the_field(daemon: DaemonProcess) -> None:
    encode = msgspec.msgpack.encode
    cases = [
        (
            encode({"type": "set_vocabulary", "vocab_size": 0, "id": 1}),
            "invalid_request",
            "vocab_size",
        ),
        (encode({"type": "set_vocabulary", "id": 2}), "bad_message", "vocab_size"),
        (
            encode({"type": "set_fpm_worker_id", "worker_id": "", "id": 3}),
            "invalid_request",
            "worker_id",
        ),
        (encode({"type": "watch_load", "every": 1, "id": 4}), "bad_message", "every"),
    ]

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            for body, code, field in cases:
                reply = await client.send_raw(body, timeout=TIMEOUT_S)
                assert isinstance(reply, ErrorReply), reply
                assert reply.code == code and field in reply.message
            await client.ping(timeout=TIMEOUT_S)

    run(scenario())


def test_fpm_carries_the_worker_id_a_client_sets(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                await client.set_fpm_worker_id("10477718404275941139", timeout=TIMEOUT_S)
                assert (
                    await client.hello(timeout=TIMEOUT_S)
                ).fpm_worker_id == "10477718404275941139"
                reader = asyncio.ensure_future(read_fpm(ctx, daemon.fpm_endpoint(), 3))
                # The subscription settles while heartbeats and passes go out.
                while not reader.done():
                    await client.generate([9, 9, 9], 2, timeout=TIMEOUT_S)
                    await asyncio.sleep(0.05)
                metrics = await reader
                assert {m.worker_id for m in metrics} == {"10477718404275941139"}
        finally:
            ctx.destroy(linger=0)

    run(scenario())


async def _pass_ids(
    ctx: zmq.asyncio.Context, client: EngineClient, endpoint: str, rank: int
) -> set[str]:
    """The worker ids of three of rank's pass frames (not heartbeats: one sent before a
    setting reached the rank may still be queued), from requests submitted from now on."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    deadline = asyncio.get_running_loop().time() + TIMEOUT_S
    try:
        ids: list[str] = []
        while len(ids) < 3:
            assert asyncio.get_running_loop().time() < deadline, f"rank {rank}: {ids}"
            # Until the subscription is live, passes go unseen: submit until three are seen.
            await client.generate([5, 6, 7], 2, dp_rank=rank, timeout=TIMEOUT_S)
            while await sub.poll(100):
                _topic, _seq, payload = await sub.recv_multipart()
                metrics = decode_fpm(payload)
                assert metrics.dp_rank == rank
                if metrics.wall_time > 0.0:
                    ids.append(metrics.worker_id)
        return set(ids)
    finally:
        sub.close()


@pytest.mark.parametrize("rank_processes", ["0", "2"])
def test_set_fpm_worker_id_of_one_rank(tmp_path: Path, rank_processes: str) -> None:
    """A worker that registers each rank as a Dynamo worker gives each its own id; the
    engine-wide id (the one `welcome` reports) is then the other ranks'."""

    async def scenario(daemon: DaemonProcess) -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                await client.set_fpm_worker_id("all", timeout=TIMEOUT_S)
                await client.set_fpm_worker_id("rank-1", dp_rank=1, timeout=TIMEOUT_S)
                assert (await client.hello(timeout=TIMEOUT_S)).fpm_worker_id == "all"
                ids = [await _pass_ids(ctx, client, daemon.fpm_endpoint(r), r) for r in range(3)]
                assert ids == [{"all"}, {"rank-1"}, {"all"}]
                with pytest.raises(EngineError) as refused:
                    await client.set_fpm_worker_id("x", dp_rank=3, timeout=TIMEOUT_S)
                assert refused.value.code == "invalid_request"
                assert refused.value.message == "dp_rank: 3 is out of range [0, 3)"
                # Engine-wide again: every rank, the one set alone included.
                await client.set_fpm_worker_id("again", timeout=TIMEOUT_S)
                ids = [await _pass_ids(ctx, client, daemon.fpm_endpoint(r), r) for r in range(3)]
                assert ids == [{"again"}] * 3
        finally:
            ctx.destroy(linger=0)

    flags = ("--data-parallel-size", "3", "--rank-processes", rank_processes)
    with start_daemon(tmp_path, *FLAGS, *flags) as d:
        run(scenario(d))


def test_watch_load_pushes_each_change(tmp_path: Path) -> None:
    async def scenario(daemon: DaemonProcess) -> None:
        loads: list[Load] = []
        changed = asyncio.Event()

        def on_load(load: Load) -> None:
            loads.append(load)
            changed.set()

        async with await EngineClient.connect(daemon.control) as client:
            await client.watch_load(on_load, timeout=TIMEOUT_S)
            # One message per rank; the second may be read after this task resumes.
            while len(loads) < 2:
                changed.clear()
                await asyncio.wait_for(changed.wait(), TIMEOUT_S)
            assert [(x.dp_rank, x.active_blocks, x.total_blocks) for x in loads] == [
                (0, 0, 64),
                (1, 0, 64),
            ]
            gen = await client.generate(list(range(64)), 4, dp_rank=1, timeout=TIMEOUT_S)
            assert gen.finish_reason == "length"
            while loads[-1].active_blocks != 0 or len(loads) < 4:
                changed.clear()
                await asyncio.wait_for(changed.wait(), TIMEOUT_S)
            later = loads[2:]
            assert {x.dp_rank for x in later} == {1}
            # 64 prompt tokens + 4 generated at block size 16: 5 blocks while it ran.
            assert max(x.active_blocks for x in later) == 5
            assert later[-1].active_blocks == 0 and later[-1].running == 0
            # Only changes are pushed: no two consecutive messages are equal.
            assert all(a != b for a, b in itertools.pairwise(later))

    with start_daemon(tmp_path, *FLAGS, "--data-parallel-size", "2") as d:
        run(scenario(d))
