"""Bad input: random bytes, non-map msgpack, unknown type, unknown/missing/wrongly typed fields,
huge token lists, out-of-range dp_rank, duplicate request ids, commands for unknown handoffs:
each gets the documented `error`/`noop` and the daemon keeps serving (a hypothesis test sends
hundreds of malformed messages interleaved with valid requests; every valid request completes).

Also: the REQ-style envelope, garbage envelopes, a body over the 64 MiB message limit, a
prompt larger than the KV pool, the queue limit (`overloaded`) and shutdown (`shutting_down`,
the drain, its timeout, and a second SIGTERM).

Raw bodies go through `EngineClient.send_raw` or a raw DEALER socket; the expected `code` and
the field the message must name come from proto/PROTOCOL.md §1.2. Every wait is bounded:
replies are awaited with timeouts, `stats` and submits are polled with deadlines, and each
scenario runs under `asyncio.wait_for`. No sleep is used to synchronise.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import parse_monitor_message

from engined.client import EngineClient, EngineError, Generation
from engined.wire.control import (
    Applied,
    ControlDecoder,
    DirectReply,
    ErrorReply,
    Noop,
    Output,
    Pong,
    RankStats,
    ReplyDecoder,
    Submitted,
    WireError,
)
from tests.server.daemon_harness import PACED_FLAGS, DaemonProcess, start_daemon
from tests.server.support import WAIT_S, assert_idle, rank0, wait_for_stats
from tests.support import run
from tests.wire import strategies
from tests.wire.strategies import msgpack_scalars

BLOCK_SIZE = 16
NUM_BLOCKS = 4096  # 65,536 tokens: a request filling it streams for a few seconds
# What requests can hold: vLLM keeps block 0 as its null block.
POOL_TOKENS = BLOCK_SIZE * (NUM_BLOCKS - 1)
FAST = (
    "--speedup-ratio",
    "0",
    "--block-size",
    str(BLOCK_SIZE),
    "--num-gpu-blocks",
    str(NUM_BLOCKS),
)
# Paced at 10 ms per decode pass: a request of n tokens streams for about n * 10 ms.
PACED = PACED_FLAGS
# The control ROUTER's MAXMSGSIZE, derived from the pool: 2 x 65,536 tokens at 5 bytes,
# 1 KiB of ids, a 1 MiB margin (engined.server.control.budgets).
MAX_MESSAGE_BYTES = 2 * BLOCK_SIZE * NUM_BLOCKS * 5 + 1024 + 1024 * 1024

# The `daemon` fixture (tests/server/conftest.py): one fast daemon (speedup 0, a 4096-block
# pool) shared by the tests that leave it idle.
DAEMON_FLAGS = FAST

encode = msgspec.msgpack.encode


def submit_body(**request: Any) -> bytes:
    return encode(
        {"type": "submit", "request": {"token_ids": [1, 2, 3], "max_tokens": 2, **request}}
    )


# (body, code, what the message must contain: the offending field, or the failure)
REFUSALS = [
    pytest.param(b"", "bad_message", "Not a MessagePack message", id="empty-body"),
    pytest.param(b"\xc1", "bad_message", "Not a MessagePack message", id="invalid-opcode"),
    pytest.param(b"\x82\xa4type", "bad_message", "truncated", id="truncated"),
    pytest.param(
        bytes(range(256)), "bad_message", "Expected `object`, got `int`", id="bytes-0-to-255"
    ),
    pytest.param(encode([1, 2]), "bad_message", "Expected `object`, got `array`", id="array"),
    pytest.param(encode("ping"), "bad_message", "Expected `object`, got `str`", id="string"),
    pytest.param(encode(None), "bad_message", "Expected `object`, got `None`", id="nil"),
    pytest.param(encode({1: "ping"}), "bad_message", "`key` in `$`", id="int-key"),
    pytest.param(encode({"type": "submitt"}), "bad_message", "`$.type`", id="unknown-type"),
    pytest.param(encode({"type": 5}), "bad_message", "`$.type`", id="int-type"),
    pytest.param(encode({"id": 1}), "bad_message", "field `type`", id="missing-type"),
    pytest.param(
        encode({"type": "ping", "colour": 1}), "bad_message", "field `colour`", id="unknown-key"
    ),
    pytest.param(
        submit_body(temperature=0.5),
        "bad_message",
        "unknown field `temperature` - at `$.request`",
        id="unknown-request-key",
    ),
    pytest.param(
        encode({"type": "submit"}), "bad_message", "field `request`", id="missing-request"
    ),
    pytest.param(
        encode({"type": "submit", "request": {"token_ids": [1]}}),
        "bad_message",
        "field `max_tokens` - at `$.request`",
        id="missing-max-tokens",
    ),
    pytest.param(
        encode({"type": "release_source"}),
        "bad_message",
        "field `handoff_id`",
        id="missing-handoff-id",
    ),
    pytest.param(
        submit_body(max_tokens="8"),
        "bad_message",
        "Expected `int`, got `str` - at `$.request.max_tokens`",
        id="max-tokens-str",
    ),
    pytest.param(
        submit_body(token_ids="abc"),
        "bad_message",
        "Expected `array`, got `str` - at `$.request.token_ids`",
        id="token-ids-str",
    ),
    pytest.param(
        submit_body(token_ids=[1, 2.5]),
        "bad_message",
        "at `$.request.token_ids[1]`",
        id="token-id-float",
    ),
    pytest.param(
        submit_body(dp_rank=1.5), "bad_message", "at `$.request.dp_rank`", id="dp-rank-float"
    ),
    pytest.param(
        encode({"type": "release_source", "handoff_id": 5}),
        "bad_message",
        "Expected `str`, got `int` - at `$.handoff_id`",
        id="handoff-id-int",
    ),
    pytest.param(
        encode({"type": "cancel", "request_id": 7}),
        "bad_message",
        "Expected `str`, got `int` - at `$.request_id`",
        id="cancel-request-id-int",
    ),
    pytest.param(
        submit_body(token_ids=[]),
        "invalid_request",
        "at `$.request.token_ids`",
        id="empty-prompt",
    ),
    pytest.param(
        submit_body(token_ids=[1, 2, 2**32]),
        "invalid_request",
        "at `$.request.token_ids[2]`",
        id="token-id-2**32",
    ),
    pytest.param(
        submit_body(max_tokens=-1),
        "invalid_request",
        "at `$.request.max_tokens`",
        id="negative-max-tokens",
    ),
    pytest.param(
        submit_body(request_id="r" * 257),
        "invalid_request",
        "`request_id` must be at most 256 bytes of UTF-8, got 257 - at `$.request.request_id`",
        id="request-id-257-bytes",
    ),
    pytest.param(
        encode({"type": "cancel_source", "handoff_id": ""}),
        "invalid_request",
        "at `$.handoff_id`",
        id="empty-handoff-id",
    ),
    pytest.param(
        submit_body(dp_rank=-1), "invalid_request", "at `$.request.dp_rank`", id="negative-rank"
    ),
    pytest.param(
        submit_body(dp_rank=1),
        "invalid_request",
        "request.dp_rank: 1 is out of range [0, 1)",
        id="dp-rank-out-of-range",
    ),
    pytest.param(
        encode({"type": "reset_prefix_cache", "dp_rank": 3}),
        "invalid_request",
        "dp_rank: 3 is out of range",
        id="reset-rank-out-of-range",
    ),
    pytest.param(
        submit_body(stop_token_ids=3),
        "bad_message",
        "Expected `array | null`, got `int` - at `$.request.stop_token_ids`",
        id="stop-token-ids-int",
    ),
    pytest.param(
        submit_body(stop_token_ids=[1, "2"]),
        "bad_message",
        "Expected `int`, got `str` - at `$.request.stop_token_ids[1]`",
        id="stop-token-id-str",
    ),
    pytest.param(
        submit_body(min_tokens="1"),
        "bad_message",
        "Expected `int`, got `str` - at `$.request.min_tokens`",
        id="min-tokens-str",
    ),
    pytest.param(
        submit_body(cache_salt=["a"]),
        "bad_message",
        "Expected `str | null`, got `array` - at `$.request.cache_salt`",
        id="cache-salt-array",
    ),
    pytest.param(
        submit_body(stop_token_ids=list(range(100_000))),
        "invalid_request",
        "Expected `array` of length <= 256 - at `$.request.stop_token_ids`",
        id="too-many-stop-ids",
    ),
    pytest.param(
        submit_body(stop_token_ids=[2**32]),
        "invalid_request",
        "at `$.request.stop_token_ids[0]`",
        id="stop-token-id-over-u32",
    ),
    pytest.param(
        submit_body(min_tokens=-3),
        "invalid_request",
        "Expected `int` >= 0 - at `$.request.min_tokens`",
        id="negative-min-tokens",
    ),
    pytest.param(
        submit_body(min_tokens=3),
        "invalid_request",
        "request.min_tokens must be less than or equal to max_tokens=2, got 3.",
        id="min-tokens-over-max-tokens",
    ),
    pytest.param(
        submit_body(max_tokens=9, output_token_ids=[5], min_tokens=2),
        "invalid_request",
        "request.min_tokens must be less than or equal to max_tokens=1, got 2.",
        id="min-tokens-over-planned-output",
    ),
    pytest.param(
        # 1 MB of salt: under the message limit, far over the salt's.
        submit_body(cache_salt="s" * 1_000_000),
        "invalid_request",
        "`cache_salt` must be at most 1024 bytes of UTF-8, got 1000000 - at `$.request.cache_salt`",
        id="huge-cache-salt",
    ),
    pytest.param(
        # 868 KB: under the message limit, over the pool.
        submit_body(token_ids=list(range(200_000))),
        "invalid_request",
        f"request.token_ids: 200000 tokens exceed the KV pool capacity of {POOL_TOKENS}",
        id="huge-token-list",
    ),
]


@pytest.mark.parametrize(("body", "code", "names"), REFUSALS)
def test_refused_message_gets_documented_error(
    daemon: DaemonProcess, body: bytes, code: str, names: str
) -> None:
    """1. send the raw body; 2. ping.

    Result: an `error` reply with the documented code whose message names the offending
    field (or says what is wrong with the bytes); the daemon still answers the ping and
    holds nothing.
    """

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            reply = await client.send_raw(body, timeout=WAIT_S)
            assert isinstance(reply, ErrorReply), reply
            assert reply.code == code
            assert names in reply.message
            assert isinstance(await client.ping(), Pong)
            assert_idle(await rank0(client))

    run(scenario())


def test_error_reply_echoes_a_readable_id(daemon: DaemonProcess) -> None:
    """1. send an unknown key with int id 7; 2. a wrong type with string id "q-1";
    3. a too long string id (129 bytes) with an unknown key; 4. random bytes.

    Result: the errors echo 7 and "q-1"; the too long id and the unreadable body get errors
    without an id.
    """

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            cases: list[tuple[bytes, int | str | None]] = [
                (encode({"type": "ping", "colour": 1, "id": 7}), 7),
                (encode({"type": "cancel", "request_id": 7, "id": "q-1"}), "q-1"),
                (encode({"type": "ping", "colour": 1, "id": "i" * 129}), None),
                (b"\xc1\xc1", None),
            ]
            for body, expected in cases:
                reply = await client.send_raw(body, timeout=WAIT_S)
                assert isinstance(reply, ErrorReply)
                assert reply.id == expected

    run(scenario())


def test_unknown_handoffs_and_requests_are_noops(daemon: DaemonProcess) -> None:
    """1. send every handoff command naming a handoff id the daemon never saw;
    2. cancel a request id it never saw.

    Result: every one is answered `noop`; the daemon holds nothing.
    """

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            for command in (
                client.release_source,
                client.cancel_source,
                client.activate_destination,
                client.cancel_destination,
            ):
                assert isinstance(await command("no-such-handoff"), Noop)
            assert isinstance(await client.cancel("no-such-request"), Noop)
            assert_idle(await rank0(client))

    run(scenario())


def test_duplicate_request_id(tmp_path: Path) -> None:
    """1. submit request "dup" with a long output; 2. submit "dup" again from the same
    client, and from another; 3. cancel "dup"; 4. submit "dup" again with 3 tokens.

    Result: the same client's duplicate gets duplicate_request "request dup is already
    active" and the first request keeps streaming; the other client's "dup" is its own
    request (ids are per client, protocol §1.5) and completes with its 1 token; once
    cancelled, the id is free again and the new request completes with its 3 tokens.
    """

    async def scenario(daemon: DaemonProcess) -> None:
        async with (
            await EngineClient.connect(daemon.control) as client,
            await EngineClient.connect(daemon.control) as other,
        ):
            await client.submit(list(range(64)), POOL_TOKENS - 64, request_id="dup")
            with pytest.raises(EngineError) as duplicate:
                await client.submit([5, 6, 7], 1, request_id="dup")
            assert duplicate.value.code == "duplicate_request"
            assert duplicate.value.message == "request dup is already active"
            others = await other.generate([5, 6, 7], 1, request_id="dup", timeout=WAIT_S)
            assert (others.request_id, len(others.token_ids)) == ("dup", 1)
            first = await anext(client.outputs("dup", timeout=WAIT_S))
            assert first.request_id == "dup"
            assert isinstance(await client.cancel("dup"), Applied)
            gen = await client.generate([5, 6, 7], 3, request_id="dup", timeout=WAIT_S)
            assert (len(gen.token_ids), gen.finish_reason) == (3, "length")
            assert_idle(await rank0(client))

    pool = ("--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(NUM_BLOCKS))
    with start_daemon(tmp_path, *pool, *PACED) as daemon:
        run(scenario(daemon))


def test_prompt_larger_than_the_kv_pool(daemon: DaemonProcess) -> None:
    """1. submit a prompt of pool + 1 tokens; 2. the same as submit_handoff_prefill;
    3. as reserve_destination; 4. a prompt of exactly the pool's tokens, max_tokens 0.

    Result: submit and submit_handoff_prefill get invalid_request naming request.token_ids;
    reserve_destination gets capacity "destination prompt exceeds the KV pool capacity";
    the request that fits exactly completes (prefill only); the daemon ends idle.
    """
    too_long = list(range(POOL_TOKENS + 1))

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control) as client:
            calls: tuple[Callable[[], Awaitable[object]], ...] = (
                lambda: client.submit(too_long, 1),
                lambda: client.submit_handoff_prefill("h-big", too_long, 1),
            )
            for call in calls:
                with pytest.raises(EngineError) as refused:
                    await call()
                assert refused.value.code == "invalid_request"
                assert refused.value.message.startswith(
                    f"request.token_ids: {POOL_TOKENS + 1} tokens exceed the KV pool"
                )
            with pytest.raises(EngineError) as refused:
                await client.reserve_destination("h-big", too_long, 1)
            assert refused.value.code == "capacity"
            assert refused.value.message == "destination prompt exceeds the KV pool capacity"
            gen = await client.generate(too_long[:-1], 0, timeout=WAIT_S)
            assert (gen.token_ids, gen.finish_reason) == ([], "length")
            assert_idle(await rank0(client))

    run(scenario())


async def raw_dealer(
    ctx: zmq.asyncio.Context, endpoint: str, *, monitor_events: int = 0
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket | None]:
    """A DEALER connected to `endpoint`, and a monitor of `monitor_events` registered before
    the connect (so it sees the connection being made)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(monitor_events) if monitor_events else None
    sock.connect(endpoint)
    return sock, monitor


async def expected_pong(endpoint: str, ctx: zmq.asyncio.Context, message_id: int) -> Pong:
    """The daemon's answer to a `ping` of `message_id`: with its start's `instance_id`, the
    one its `welcome` names."""
    async with await EngineClient.connect(endpoint, ctx=ctx) as client:
        welcome = await client.hello()
    return Pong(id=message_id, instance_id=welcome.instance_id)


async def recv_frames(sock: zmq.asyncio.Socket) -> list[bytes]:
    frames: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), WAIT_S)
    return frames


def test_req_style_envelope_is_answered_with_the_delimiter(daemon: DaemonProcess) -> None:
    """1. a raw DEALER sends [b"", ping]; 2. [b"", submit of 3 tokens]; 3. [b"", bad body].

    Result: every reply and every streamed `output` arrives as [b"", body]: the pong, the
    `submitted`, three outputs ending with finish_reason "length", and the error.
    """
    decoder = ReplyDecoder()

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        sock, _ = await raw_dealer(ctx, daemon.control)
        try:

            async def recv() -> Any:
                frames = await recv_frames(sock)
                assert len(frames) == 2 and frames[0] == b"", frames
                return decoder.decode(frames[1])

            await sock.send_multipart([b"", encode({"type": "ping", "id": 1})])
            assert await recv() == await expected_pong(daemon.control, ctx, 1)
            request = {"request_id": "req", "token_ids": [1, 2, 3], "max_tokens": 3}
            await sock.send_multipart([b"", encode({"type": "submit", "request": request})])
            tokens: list[int] = []
            finished = None
            while finished is None:
                msg = await recv()
                if isinstance(msg, Submitted):
                    assert msg.request_id == "req"
                    continue
                assert isinstance(msg, Output)
                for entry in msg.outputs:
                    tokens += entry.token_ids
                    if entry.finished:
                        finished = entry.finish_reason
            assert (len(tokens), finished) == (3, "length")
            await sock.send_multipart([b"", b"\xc1"])
            error = await recv()
            assert isinstance(error, ErrorReply) and error.code == "bad_message"
        finally:
            sock.close()
            ctx.term()

    run(scenario())


@pytest.mark.parametrize(
    "frames",
    [
        [b"a", b"b", b"c"],
        [b"", b"", encode({"type": "ping"})],
        [b"x", encode({"type": "ping"})],
        [b"", encode({"type": "ping"}), b"trailer"],
    ],
    ids=["three-frames", "two-delimiters", "non-empty-delimiter", "trailing-frame"],
)
def test_garbage_envelope_gets_an_error(daemon: DaemonProcess, frames: list[bytes]) -> None:
    """1. a raw DEALER sends a multi-frame message that is not [body] or [b"", body];
    2. the same socket sends a plain [ping].

    Result: the garbage gets one `bad_message` error (as a plain [body] reply) saying what
    a message must look like; the ping is answered; the daemon keeps serving.
    """
    decoder = ReplyDecoder()

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        sock, _ = await raw_dealer(ctx, daemon.control)
        try:
            await sock.send_multipart(frames)
            (body,) = await recv_frames(sock)
            error = decoder.decode(body)
            assert isinstance(error, ErrorReply)
            assert error.code == "bad_message"
            assert "one body frame" in error.message
            await sock.send_multipart([encode({"type": "ping", "id": 2})])
            (body,) = await recv_frames(sock)
            assert decoder.decode(body) == await expected_pong(daemon.control, ctx, 2)
        finally:
            sock.close()
            ctx.term()

    run(scenario())


def test_body_over_the_message_limit_drops_the_connection(daemon: DaemonProcess) -> None:
    """1. a raw DEALER (with a socket monitor) sends a body of the limit + 1 byte;
    2. await the monitor's DISCONNECTED event; 3. ping on the same socket (it reconnects)
    and from a fresh client.

    Result: ZeroMQ refuses the message (MAXMSGSIZE) and drops the connection, so no reply
    comes; both pings are answered and the daemon holds nothing.
    """
    decoder = ReplyDecoder()

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        sock, monitor = await raw_dealer(
            ctx, daemon.control, monitor_events=zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        assert monitor is not None
        try:

            async def next_event() -> int:
                frames = await asyncio.wait_for(monitor.recv_multipart(), WAIT_S)
                event: int = parse_monitor_message(frames)["event"]
                return event

            assert await next_event() == zmq.EVENT_CONNECTED
            await sock.send_multipart([b"\x00" * (MAX_MESSAGE_BYTES + 1)])
            assert await next_event() == zmq.EVENT_DISCONNECTED
            assert not await sock.poll(0)
            await sock.send_multipart([encode({"type": "ping", "id": 3})])
            (body,) = await recv_frames(sock)
            assert decoder.decode(body) == await expected_pong(daemon.control, ctx, 3)
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                assert isinstance(await client.ping(), Pong)
                assert_idle(await rank0(client))
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()
            ctx.term()

    run(scenario())


# --- hypothesis: malformed messages interleaved with valid requests -------------------------

DECODER = ControlDecoder()
FIELDS = [
    "type",
    "id",
    "request",
    "request_id",
    "handoff_id",
    "token_ids",
    "max_tokens",
    "output_token_ids",
    "dp_rank",
    "stop_token_ids",
    "min_tokens",
    "cache_salt",
]
TEMPLATES: list[dict[str, Any]] = [
    {"type": "submit", "request": {"token_ids": [1, 2, 3], "max_tokens": 4}, "id": 1},
    {
        "type": "submit",
        "request": {
            "request_id": "r",
            "token_ids": [9],
            "max_tokens": 1,
            "output_token_ids": [5],
            "dp_rank": 0,
        },
    },
    {"type": "cancel", "request_id": "r"},
    {
        "type": "submit",
        "request": {
            "token_ids": [1, 2, 3],
            "max_tokens": 4,
            "stop_token_ids": [7],
            "min_tokens": 1,
            "cache_salt": "t",
        },
    },
    {
        "type": "submit_handoff_prefill",
        "handoff_id": "h",
        "request": {"token_ids": [1], "max_tokens": 1},
    },
    {
        "type": "reserve_destination",
        "handoff_id": "h",
        "request": {"token_ids": [1], "max_tokens": 1},
    },
    {"type": "release_source", "handoff_id": "h"},
    {"type": "cancel_source", "handoff_id": "h"},
    {"type": "activate_destination", "handoff_id": "h"},
    {"type": "cancel_destination", "handoff_id": "h"},
    {"type": "reset_prefix_cache", "dp_rank": 0},
    {"type": "wait_idle", "dp_rank": 0},
    {"type": "stats", "id": "s"},
    {"type": "ping"},
    {"type": "hello"},
]

scalars = msgpack_scalars(text_size=40)
msgpack_values = strategies.msgpack_values(scalars, FIELDS, key_size=12, max_leaves=20)


@st.composite
def mutated_messages(draw: st.DrawFn) -> bytes:
    """A valid message with one mutation: a key added, dropped or retyped, the tag changed,
    or its encoding truncated or overwritten at one byte."""
    msg = msgspec.json.decode(msgspec.json.encode(draw(st.sampled_from(TEMPLATES))))
    target: dict[str, Any] = msg
    if "request" in msg and draw(st.booleans()):
        target = msg["request"]
    kind = draw(st.sampled_from(["add", "drop", "retype", "tag", "truncate", "overwrite"]))
    if kind == "add":
        key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS))
        target[key] = draw(scalars)
    elif kind == "drop":
        del target[draw(st.sampled_from(sorted(target)))]
    elif kind == "retype":
        target[draw(st.sampled_from(sorted(target)))] = draw(msgpack_values)
    elif kind == "tag":
        msg["type"] = draw(st.text(max_size=24) | scalars)
    body = bytearray(encode(msg))
    if kind == "truncate":
        return bytes(body[: draw(st.integers(min_value=0, max_value=len(body) - 1))])
    if kind == "overwrite":
        body[draw(st.integers(min_value=0, max_value=len(body) - 1))] = draw(
            st.integers(min_value=0, max_value=255)
        )
    return bytes(body)


malformed = st.one_of(
    st.binary(max_size=200),
    msgpack_values.map(encode),
    mutated_messages(),
    mutated_messages(),
)
valid_requests = st.tuples(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=150),
    st.integers(min_value=0, max_value=8),
)
operations = st.lists(
    st.one_of(malformed, malformed, malformed, valid_requests), min_size=4, max_size=14
)


def expected_refusal(body: bytes) -> WireError | None:
    """What the control decoder makes of `body`: its WireError, or None when it is valid."""
    try:
        DECODER.decode(body)
    except WireError as exc:
        return exc
    return None


def test_malformed_messages_interleaved_with_valid_requests(daemon: DaemonProcess) -> None:
    """1. one daemon; per hypothesis example a fresh client sends a list of operations in
       order: malformed bodies (random bytes, arbitrary msgpack, valid messages with one
       mutation) through send_raw, and valid submits (random prompts, max_tokens 0..8);
    2. at the end of each example, collect every valid request's outputs;
    3. after all examples, ask for stats.

    Result: each malformed body gets an `error` with the code, message and echoed `id` the
    control decoder gives it (bodies that happen to be valid messages are not sent); every
    valid request completes with exactly its max_tokens tokens and finish_reason "length";
    hundreds of malformed messages were sent; the daemon ends idle (no active block,
    nothing waiting or running).
    """
    sent = {"malformed": 0, "valid": 0}

    async def example(ops: list[Any]) -> None:
        async with await EngineClient.connect(daemon.control) as client:
            submitted: list[tuple[Submitted, int]] = []
            for op in ops:
                if isinstance(op, tuple):
                    tokens, max_tokens = op
                    submitted.append((await client.submit(tokens, max_tokens), max_tokens))
                    sent["valid"] += 1
                    continue
                refusal = expected_refusal(op)
                if refusal is None:
                    continue
                reply: DirectReply = await client.send_raw(op, timeout=WAIT_S)
                assert isinstance(reply, ErrorReply), (op, reply)
                assert (reply.code, reply.message, reply.id) == (
                    refusal.code,
                    refusal.message,
                    refusal.message_id,
                ), op
                sent["malformed"] += 1
            for done, max_tokens in submitted:
                gen: Generation = await client.collect(done, timeout=WAIT_S)
                assert (len(gen.token_ids), gen.finish_reason) == (max_tokens, "length"), gen

    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(operations)
    def check(ops: list[Any]) -> None:
        run(example(ops))

    check()

    async def final() -> RankStats:
        async with await EngineClient.connect(daemon.control) as client:
            return await rank0(client)

    assert_idle(run(final()))
    assert sent["malformed"] >= 200, sent
    assert sent["valid"] >= 20, sent


# --- queue limit and shutdown (own daemons) -------------------------------------------------


def test_queue_limit_answers_overloaded(tmp_path: Path) -> None:
    """1. start a paced daemon with --max-queued-requests 2 and --max-num-seqs 1;
    2. submit three long requests: one runs, two wait (polled in `stats`);
    3. submit a fourth; 4. cancel the running one; submit a fifth (its place in the queue
       is free again); 5. cancel everything.

    Result: the fourth gets `overloaded` naming the rank and the limit; the fifth is
    accepted; after the cancels the daemon is idle.
    """

    async def scenario(d: DaemonProcess) -> None:
        async with await EngineClient.connect(d.control) as client:
            ids = [f"q-{i}" for i in range(3)]
            for request_id in ids:
                await client.submit([7] * 32, 1000, request_id=request_id)
            await wait_for_stats(
                client, lambda s: (s.running, s.waiting) == (1, 2), "1 running, 2 waiting"
            )
            with pytest.raises(EngineError) as refused:
                await client.submit([8] * 32, 1000, request_id="q-3")
            assert refused.value.code == "overloaded"
            assert refused.value.message == "rank 0 has 2 queued requests"
            assert isinstance(await client.cancel("q-0"), Applied)
            await wait_for_stats(
                client, lambda s: (s.running, s.waiting) == (1, 1), "1 running, 1 waiting"
            )
            await client.submit([9] * 32, 1000, request_id="q-4")
            for request_id in ("q-1", "q-2", "q-4"):
                assert isinstance(await client.cancel(request_id), Applied)
            assert_idle(await rank0(client))

    flags = (*PACED, "--max-queued-requests", "2", "--max-num-seqs", "1")
    with start_daemon(tmp_path, *flags) as d:
        run(scenario(d))


async def submit_until_shutting_down(client: EngineClient) -> list[Submitted]:
    """Submit 1-token probes until one is refused with shutting_down; returns the accepted."""
    accepted = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            accepted.append(await client.submit([3, 1, 4], 1))
        except EngineError as exc:
            assert exc.code == "shutting_down", exc
            assert exc.message == "the daemon is shutting down"
            return accepted
    raise AssertionError("the daemon never answered shutting_down")


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    """1. start a paced daemon; submit a request of 150 tokens (about 1.5 s) and read its
       first output;
    2. SIGTERM; submit probes until one is refused; submit once more;
    3. read the rest of the stream; wait for the process.

    Result: submits during the drain get shutting_down; the in-flight request streams all
    150 tokens and finishes with "length"; probes accepted before the signal was handled
    finish too; the process exits with code 0.
    """

    async def scenario(d: DaemonProcess) -> None:
        async with await EngineClient.connect(d.control) as client:
            submitted = await client.submit(list(range(40)), 150, request_id="long")
            stream = client.outputs("long", timeout=WAIT_S)
            first = await anext(stream)
            d.proc.send_signal(signal.SIGTERM)
            probes = await submit_until_shutting_down(client)
            with pytest.raises(EngineError, match="shutting_down"):
                await client.submit([2, 7], 1)
            tokens = list(first.token_ids)
            last = first
            async for entry in stream:
                tokens += entry.token_ids
                last = entry
            assert (len(tokens), last.finish_reason) == (150, "length")
            assert submitted.request_id == "long"
            for probe in probes:
                gen = await client.collect(probe, timeout=WAIT_S)
                assert gen.finish_reason == "length"
        assert await asyncio.to_thread(d.proc.wait, WAIT_S) == 0

    with start_daemon(tmp_path, *PACED) as d:
        run(scenario(d))


def test_drain_timeout_cancels_what_is_left(tmp_path: Path) -> None:
    """1. start a paced daemon with --drain-timeout 0.5; submit a request of 100,000 tokens
       (about 1,000 s) and read its first output;
    2. SIGTERM; read the rest of the stream; wait for the process.

    Result: after the drain timeout the stream ends with a token-less entry, finish_reason
    "cancelled", long before the request could finish; the process exits with code 0.
    """

    async def scenario(d: DaemonProcess) -> None:
        async with await EngineClient.connect(d.control) as client:
            await client.submit(list(range(40)), 100_000, request_id="endless")
            stream = client.outputs("endless", timeout=WAIT_S)
            await anext(stream)
            signalled = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            entries = [entry async for entry in stream]
            assert entries[-1].finished
            assert (entries[-1].token_ids, entries[-1].finish_reason) == ([], "cancelled")
            assert len(entries) < 1000
            assert time.monotonic() - signalled >= 0.5
        assert await asyncio.to_thread(d.proc.wait, WAIT_S) == 0

    with start_daemon(tmp_path, *PACED, "--drain-timeout", "0.5") as d:
        run(scenario(d))


def test_second_sigterm_skips_the_drain(tmp_path: Path) -> None:
    """1. start a paced daemon (drain timeout 30 s); submit a request of 100,000 tokens and
       read its first output;
    2. SIGTERM; submit probes until one is refused (the drain has begun);
    3. SIGTERM again; read the rest of the stream; wait for the process.

    Result: the stream ends with finish_reason "cancelled" after a handful of passes, where
    the 30 s drain would have run ~3,000 more (counted in passes, not wall seconds, so a
    loaded machine cannot fail it), and the process exits with code 0.
    """

    async def scenario(d: DaemonProcess) -> None:
        async with await EngineClient.connect(d.control) as client:
            await client.submit(list(range(40)), 100_000, request_id="endless")
            stream = client.outputs("endless", timeout=WAIT_S)
            await anext(stream)
            d.proc.send_signal(signal.SIGTERM)
            probes = await submit_until_shutting_down(client)
            d.proc.send_signal(signal.SIGTERM)
            entries = [entry async for entry in stream]
            assert entries[-1].finish_reason == "cancelled"
            # One entry per 10 ms pass: the drain (30 s) was skipped, not waited out.
            assert len(entries) < 300, len(entries)
            for probe in probes:
                gen = await client.collect(probe, timeout=WAIT_S)
                assert gen.finish_reason in ("length", "cancelled")
        assert await asyncio.to_thread(d.proc.wait, WAIT_S) == 0

    with start_daemon(tmp_path, *PACED) as d:
        run(scenario(d))
