"""`stop_token_ids`, `min_tokens` and `cache_salt` through a real daemon and the client.

A daemon at speedup 0 with a vocabulary of 8 ids (so stop ids are drawn often), read with
`EngineClient` and, for the salt, its KV stream (PUB plus replay): a stop id ends a stream
with `finish_reason "stop"` and `stop_reason`, never before `min_tokens`; requests share cached
blocks only under one salt, and the salted first block's `BlockStored` carries the salt in
`extra_keys`, as vLLM 0.33 publishes it. Under `--semantics mocker-1.3.0` a salt is refused
`unsupported`. Every wait is bounded (replies, outputs and the KV stream time out).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.asyncio

from engined.client import EngineClient, EngineError
from engined.core.token_stream import token_bits
from engined.core.vocab import Vocabulary
from engined.wire.kv_events import BlockStored
from tests.server.daemon_harness import KvStream, start_daemon
from tests.support import run

WAIT_S = 10.0
BLOCK_SIZE = 4
FLAGS = (
    "--speedup-ratio",
    "0",
    "--block-size",
    str(BLOCK_SIZE),
    "--num-gpu-blocks",
    "256",
    "--seed",
    "3",
    "--vocab-size",
    "8",
)
PROMPT = list(range(10, 19))


def drawn(request_id: str, count: int, stop_id: int = -1, min_tokens: int = 0) -> list[int]:
    """The request's unplanned tokens: its stream under vocabulary 8, a stop id drawn again
    before `min_tokens` (vLLM's masked sampler)."""
    bits = token_bits(3, request_id, None, PROMPT)
    vocab = Vocabulary(8)
    out: list[int] = []
    while len(out) < count:
        token = vocab.next_token(bits)
        while len(out) < min_tokens and token == stop_id:
            token = vocab.next_token(bits)
        out.append(token)
    return out


def test_a_stop_id_ends_the_stream_with_its_stop_reason(tmp_path: Path) -> None:
    free = drawn("s", 40)
    stop_id = free[2]
    first = free.index(stop_id)

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            got = await client.generate(
                PROMPT, 40, request_id="s", stop_token_ids=[stop_id], timeout=WAIT_S
            )
            assert got.token_ids == free[: first + 1]
            assert (got.finish_reason, got.stop_reason) == ("stop", stop_id)
            entries = [
                entry
                async for entry in client.stream(
                    PROMPT, 40, request_id="m", stop_token_ids=[stop_id], min_tokens=12
                )
            ]
            tokens = [t for entry in entries for t in entry.token_ids]
            masked = drawn("m", 40, stop_id, 12)
            assert tokens == masked[: masked.index(stop_id, 11) + 1]
            assert stop_id in drawn("m", 11) and stop_id not in tokens[:11]
            assert [e.stop_reason for e in entries] == [None] * (len(entries) - 1) + [stop_id]
            assert (entries[-1].finished, entries[-1].finish_reason) == (True, "stop")

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(scenario())


def test_only_one_salt_shares_cached_blocks_and_its_store_carries_it(tmp_path: Path) -> None:
    async def scenario() -> list[BlockStored]:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                cached = []
                for salt in ("a", "b", "a", None):
                    got = await client.generate(PROMPT, 1, cache_salt=salt, timeout=WAIT_S)
                    cached.append(got.cached_tokens)
                assert cached == [0, 0, 8, 0]
            await stream.catch_up()
            return [e for e in stream.events() if isinstance(e, BlockStored)]
        finally:
            stream.close()
            ctx.term()

    with start_daemon(tmp_path, *FLAGS) as daemon:
        stored = run(scenario())
    # a, b and no salt store their two whole prompt blocks; a's second request hits both.
    assert [(e.parent_block_hash, e.extra_keys) for e in stored] == [
        (None, [("a",), None]),
        (None, [("b",), None]),
        (None, [None, None]),
    ]
    assert len({h for e in stored for h in e.block_hashes}) == 6


def test_the_mocker_semantics_refuses_a_salt_naming_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            with pytest.raises(EngineError) as refused:
                await client.submit(PROMPT, 1, cache_salt="a", timeout=WAIT_S)
            assert refused.value.code == "unsupported"
            assert refused.value.message.startswith("request.cache_salt needs vLLM semantics")
            got = await client.generate(PROMPT, 3, stop_token_ids=[99], timeout=WAIT_S)
            assert (len(got.token_ids), got.finish_reason) == (3, "length")

    with start_daemon(tmp_path, *FLAGS, "--semantics", "mocker-1.3.0") as daemon:
        run(scenario())
