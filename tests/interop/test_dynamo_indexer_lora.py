"""NVIDIA Dynamo 1.6.1's KV indexer keeps a LoRA adapter's blocks apart, from engined's events.

A real `engined serve --enable-lora` runs the same prompt for adapter "sql" (and two other
prompts, for adapter "chat" and for the base model); a real indexer (`python -m
dynamo.indexer`) consumes its KV events. Dynamo keys a block by its tokens and the event's
`lora_name` (`compute_block_hash_for_seq(..., lora_name=...)`), so `POST /query` with a
`lora_name` must match exactly the blocks the daemon stored for that adapter, and nothing for
another adapter or the base model: what the daemon's own stream says (its stores carry
`lora_id`, `lora_name` and the name in every block's `extra_keys`, as vLLM 0.33's).

Synchronisation: each request's stores are published before its last output is delivered,
and the test polls the indexer until it answers as expected, with a deadline; no sleep stands
in for an event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import zmq.asyncio

from engined.client import EngineClient
from engined.wire.control import WireLoraRequest
from engined.wire.kv_events import BlockStored
from tests.interop.peers import DynamoIndexer
from tests.server.daemon_harness import DaemonProcess, KvStream, start_daemon

BLOCK_SIZE = 16
WORKER_ID = 1
TIMEOUT_S = 20.0
POLL_S = 0.05

SQL = WireLoraRequest(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
CHAT = WireLoraRequest(lora_name="chat", lora_int_id=2, lora_path="/adapters/chat")
PROMPT = [1_000_000 + t for t in range(3 * BLOCK_SIZE)]  # 3 blocks
CHAT_PROMPT = [2_000_000 + t for t in range(2 * BLOCK_SIZE)]
BASE_PROMPT = [3_000_000 + t for t in range(2 * BLOCK_SIZE)]


Scores = dict[tuple[int, int], int]


async def until(query: Callable[[], Scores], want: Scores, indexer: DynamoIndexer) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        got = await asyncio.to_thread(query)
        if got == want:
            return
        assert time.monotonic() < deadline, f"{got} != {want}\n{indexer.log_text()[-4000:]}"
        await asyncio.sleep(POLL_S)


def test_dynamo_indexer_matches_an_adapters_blocks_by_lora_name(
    tmp_path: Path, peers_python: Path
) -> None:
    async def scenario(daemon: DaemonProcess, indexer: DynamoIndexer) -> None:
        ctx = zmq.asyncio.Context()
        stream = KvStream(ctx, daemon.kv_endpoint(0), daemon.replay_endpoint(0))
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                for prompt, lora in ((PROMPT, SQL), (CHAT_PROMPT, CHAT), (BASE_PROMPT, None)):
                    gen = await client.generate(prompt, 0, lora_request=lora, timeout=TIMEOUT_S)
                    assert gen.finish_reason == "length"
            await stream.catch_up()
            stores = [
                event
                for batch in stream.batches
                for event in batch.events
                if isinstance(event, BlockStored)
            ]
        finally:
            stream.close()
            ctx.term()

        # The daemon's own stream: vLLM 0.33's fields on the adapters' stores only.
        assert [(ev.lora_id, ev.lora_name, ev.extra_keys) for ev in stores] == [
            (1, "sql", [("sql",)] * 3),
            (2, "chat", [("chat",)] * 2),
            (None, None, [None, None]),
        ]
        full = {(WORKER_ID, 0): 3 * BLOCK_SIZE}
        await until(lambda: indexer.query(PROMPT, lora_name="sql"), full, indexer)
        assert indexer.query(PROMPT) == {}, "the base model has none of the adapter's blocks"
        assert indexer.query(PROMPT, lora_name="chat") == {}
        chat = {(WORKER_ID, 0): 2 * BLOCK_SIZE}
        assert indexer.query(CHAT_PROMPT, lora_name="chat") == chat
        assert indexer.query(BASE_PROMPT) == chat  # the base model's: as many blocks
        assert indexer.query(BASE_PROMPT, lora_name="sql") == {}
        assert indexer.log_problems() == [], indexer.log_text()[-4000:]

    with start_daemon(
        tmp_path,
        "--speedup-ratio",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks",
        "64",
        "--enable-lora",
        "--max-loras",
        "2",
    ) as daemon:
        indexer = DynamoIndexer(peers_python, tmp_path, "indexer-lora", block_size=BLOCK_SIZE)
        try:
            indexer.start()
            indexer.register(WORKER_ID, 0, daemon.kv_endpoint(0), daemon.replay_endpoint(0))
            asyncio.run(asyncio.wait_for(scenario(daemon, indexer), 120))
        finally:
            indexer.stop()
