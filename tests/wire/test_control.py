"""Control protocol v1: message round trips, omitted fields, and every refusal's code."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from engined.core.args import EngineType, WorkerType
from engined.core.stops import STOP_TOKEN_IDS_MAX
from engined.wire import control
from engined.wire.constraints import (
    CACHE_SALT_MAX_BYTES,
    LORA_NAME_MAX_BYTES,
    LORA_PATH_MAX_BYTES,
)
from engined.wire.control import ControlDecoder, ReplyDecoder, WireError

encode = msgspec.msgpack.encode
DECODER = ControlDecoder()

REQUEST = control.WireRequest(request_id="r-1", token_ids=[1, 2, 3], max_tokens=4)
FULL_REQUEST = control.WireRequest(
    request_id="r-2", token_ids=[0, 2**32 - 1], max_tokens=0, output_token_ids=[5, 6], dp_rank=1
)

CLIENT_MESSAGES: list[control.ClientMessage] = [
    control.Hello(),
    control.Hello(id="hello-1"),
    control.Submit(request=REQUEST),
    control.Submit(id=7, request=FULL_REQUEST),
    control.Submit(request=control.WireRequest(token_ids=[9], max_tokens=1)),
    control.Submit(request=control.WireRequest(token_ids=[9], max_tokens=1, seed=-(2**63))),
    control.Submit(request=control.WireRequest(token_ids=[9], max_tokens=1, seed=2**63 - 1)),
    control.Submit(request=control.WireRequest(token_ids=[9], max_tokens=1, priority=-(2**63))),
    control.Submit(request=control.WireRequest(token_ids=[9], max_tokens=1, priority=7)),
    control.Submit(
        request=control.WireRequest(
            token_ids=[9],
            max_tokens=4,
            stop_token_ids=[0, 2**32 - 1] * (STOP_TOKEN_IDS_MAX // 2),
            min_tokens=4,
            cache_salt="é" * (CACHE_SALT_MAX_BYTES // 2),
        )
    ),
    control.Submit(
        request=control.WireRequest(
            token_ids=[9],
            max_tokens=1,
            lora_request=control.WireLoraRequest(
                lora_name="é" * (LORA_NAME_MAX_BYTES // 2),
                lora_int_id=2**63 - 1,
                lora_path="/" * LORA_PATH_MAX_BYTES,
            ),
        )
    ),
    control.Cancel(id=-3, request_id="r-1"),
    control.SubmitHandoffPrefill(handoff_id="h-1", request=REQUEST),
    control.ReleaseSource(handoff_id="h-1"),
    control.CancelSource(handoff_id="h-1"),
    control.ReserveDestination(handoff_id="h-2", request=FULL_REQUEST),
    control.ActivateDestination(handoff_id="h-2"),
    control.CancelDestination(handoff_id="h-2"),
    control.Stats(id=2**64 - 1),
    control.ResetPrefixCache(),
    control.ResetPrefixCache(dp_rank=1),
    control.Ping(id="p"),
    control.WaitIdle(id=5),
    control.WaitIdle(dp_rank=1),
    control.SetVocabulary(vocab_size=1000, excluded_token_ids=[0, 1, 2]),
    control.SetVocabulary(id=4, vocab_size=None),
    control.SetFpmWorkerId(worker_id="10477718404275941139"),
    control.SetFpmWorkerId(worker_id="7", dp_rank=3),
    control.WatchLoad(id=9),
    control.Pause(),
    control.Pause(id=1, mode="keep", clear_cache=False),
    control.Resume(),
    control.Sleep(level=0, mode="wait"),
    control.Sleep(level=2),
    control.WakeUp(),
    control.WakeUp(tags=["weights", "scheduling"]),
]

DAEMON_MESSAGES: list[control.DaemonMessage] = [
    control.Welcome(
        id=1,
        protocol=control.PROTOCOL_VERSION,
        version="0.1.0",
        engine_type=EngineType.SGLANG,
        worker_type=WorkerType.PREFILL,
        block_size=16,
        num_gpu_blocks=1024,
        dp_size=2,
        model_name="m",
        kv_events_endpoints=["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"],
        kv_replay_endpoints=["tcp://127.0.0.1:5567", "tcp://127.0.0.1:5568"],
        fpm_endpoints=["tcp://127.0.0.1:20380", "tcp://127.0.0.1:20381"],
    ),
    control.Submitted(id="s", request_id="r-1", dp_rank=0),
    control.DestinationAccepted(request_id="r-2", dp_rank=1),
    control.Applied(),
    control.Noop(id=4),
    control.StatsReply(
        ranks=[
            control.RankStats(
                dp_rank=0,
                active_blocks=3,
                inactive_blocks=2,
                total_blocks=10,
                kv_cache_usage=0.3,
                running=1,
                waiting=0,
                preemptions_total=0,
                passes_total=17,
            )
        ]
    ),
    control.Pong(id="p"),
    control.ErrorReply(id=5, code="duplicate_request", message="request r-1 is already active"),
    control.Output(
        dp_rank=0,
        outputs=[
            control.OutputEntry(
                request_id="r-1",
                token_ids=[1, 2],
                finished=False,
                finish_reason=None,
                cached_tokens=16,
            ),
            control.OutputEntry(
                request_id="r-2",
                token_ids=[],
                finished=True,
                finish_reason="rejected",
                handoff_delay_ms=2.5,
            ),
            control.OutputEntry(
                request_id="r-3",
                token_ids=[4, 2],
                finished=True,
                finish_reason="stop",
                stop_reason=2,
            ),
        ],
    ),
    control.Lifecycle(
        dp_rank=1,
        events=[
            control.SourceHeldEvent(handoff_id="h-1", request_id="r-1"),
            control.DestinationReservedEvent(
                handoff_id="h-2", request_id="r-2", transferable_prompt_tokens=32
            ),
        ],
    ),
    control.Load(
        dp_rank=1, active_blocks=7, total_blocks=64, kv_cache_usage=0.109375, running=2, waiting=0
    ),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_client_message_round_trip(msg: control.ClientMessage) -> None:
    assert DECODER.decode(control.encode_message(msg)) == msg


@pytest.mark.parametrize("msg", DAEMON_MESSAGES, ids=lambda m: type(m).__name__)
def test_daemon_message_round_trip(msg: control.DaemonMessage) -> None:
    assert ReplyDecoder().decode(control.encode_reply(msg)) == msg


def test_tags_are_the_protocols_snake_case_names() -> None:
    client = {msgspec.inspect.type_info(type(m)).tag for m in CLIENT_MESSAGES}  # type: ignore[attr-defined]
    assert client == {
        "hello",
        "submit",
        "cancel",
        "submit_handoff_prefill",
        "release_source",
        "cancel_source",
        "reserve_destination",
        "activate_destination",
        "cancel_destination",
        "stats",
        "reset_prefix_cache",
        "ping",
        "wait_idle",
        "set_vocabulary",
        "set_fpm_worker_id",
        "watch_load",
        "pause",
        "resume",
        "sleep",
        "wake_up",
    }
    daemon = {msgspec.msgpack.decode(control.encode_reply(m))["type"] for m in DAEMON_MESSAGES}
    assert daemon == {
        "welcome",
        "submitted",
        "destination_accepted",
        "applied",
        "noop",
        "stats",
        "pong",
        "error",
        "output",
        "lifecycle",
        "load",
    }


class TestOmittedFields:
    def test_absent_optional_fields_are_left_out(self) -> None:
        body = msgspec.msgpack.decode(
            control.encode_message(
                control.Submit(request=control.WireRequest(token_ids=[1], max_tokens=2))
            )
        )
        assert body == {"type": "submit", "request": {"token_ids": [1], "max_tokens": 2}}

    def test_reply_without_id_has_no_id_key(self) -> None:
        assert msgspec.msgpack.decode(control.encode_reply(control.Applied())) == {
            "type": "applied"
        }
        assert msgspec.msgpack.decode(control.encode_reply(control.Pong(id=0))) == {
            "type": "pong",
            "id": 0,
        }

    def test_finish_reason_is_always_present_and_extras_only_when_set(self) -> None:
        entry = control.OutputEntry(
            request_id="r", token_ids=[1], finished=False, finish_reason=None
        )
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(entry)) == {
            "request_id": "r",
            "token_ids": [1],
            "finished": False,
            "finish_reason": None,
        }

    def test_welcome_keys_in_protocol_order(self) -> None:
        (welcome,) = [m for m in DAEMON_MESSAGES if isinstance(m, control.Welcome)]
        assert list(msgspec.msgpack.decode(control.encode_reply(welcome))) == [
            "type",
            "protocol",
            "version",
            "engine_type",
            "worker_type",
            "block_size",
            "num_gpu_blocks",
            "dp_size",
            "model_name",
            "kv_events_endpoints",
            "kv_replay_endpoints",
            "fpm_endpoints",
            "id",  # inherited keyword-only fields follow the class's own
        ]


def _submit(**request: Any) -> bytes:
    return encode(
        {"type": "submit", "request": {"token_ids": [1, 2, 3], "max_tokens": 4, **request}}
    )


BAD_MESSAGE_CASES = [
    pytest.param(
        encode({"type": "pause", "mode": "drain"}), r"Invalid enum value 'drain'", id="pause-mode"
    ),
    pytest.param(
        encode({"type": "pause", "clear_cache": "yes"}),
        r"Expected `bool`, got `str` - at `\$\.clear_cache`",
        id="pause-clear-cache-str",
    ),
    pytest.param(
        encode({"type": "wake_up", "tags": "weights"}),
        r"Expected `array \| null`, got `str` - at `\$\.tags`",
        id="wake-up-tags-str",
    ),
    pytest.param(
        _submit(seed="7"),
        r"Expected `int \| null`, got `str` - at `\$\.request\.seed`",
        id="seed-str",
    ),
    pytest.param(
        _submit(seed=1.5),
        r"Expected `int \| null`, got `float` - at `\$\.request\.seed`",
        id="seed-float",
    ),
    pytest.param(
        _submit(seed=True),
        r"Expected `int \| null`, got `bool` - at `\$\.request\.seed`",
        id="seed-bool",
    ),
    pytest.param(
        _submit(priority="1"),
        r"Expected `int`, got `str` - at `\$\.request\.priority`",
        id="priority-str",
    ),
    pytest.param(
        _submit(priority=None),
        r"Expected `int`, got `None` - at `\$\.request\.priority`",
        id="priority-null",
    ),
    pytest.param(
        _submit(stop_token_ids=7),
        r"Expected `array \| null`, got `int` - at `\$\.request\.stop_token_ids`",
        id="stop-token-ids-int",
    ),
    pytest.param(
        _submit(stop_token_ids=["7"]),
        r"Expected `int`, got `str` - at `\$\.request\.stop_token_ids\[0\]`",
        id="stop-token-id-str",
    ),
    pytest.param(
        _submit(min_tokens=None),
        r"Expected `int`, got `None` - at `\$\.request\.min_tokens`",
        id="min-tokens-null",
    ),
    pytest.param(
        _submit(min_tokens=1.0),
        r"Expected `int`, got `float` - at `\$\.request\.min_tokens`",
        id="min-tokens-float",
    ),
    pytest.param(
        _submit(cache_salt=7),
        r"Expected `str \| null`, got `int` - at `\$\.request\.cache_salt`",
        id="cache-salt-int",
    ),
    pytest.param(
        _submit(cache_salt=b"salt"),
        r"Expected `str \| null`, got `bytes` - at `\$\.request\.cache_salt`",
        id="cache-salt-bytes",
    ),
    pytest.param(
        _submit(kv_cache_report_mode="partial"),
        r"Invalid enum value 'partial' - at `\$\.request\.kv_cache_report_mode`",
        id="kv-cache-report-mode-value",
    ),
    pytest.param(
        _submit(kv_cache_report_mode=None),
        r"Expected `str`, got `None` - at `\$\.request\.kv_cache_report_mode`",
        id="kv-cache-report-mode-null",
    ),
    pytest.param(
        _submit(lora_request="sql-lora"),
        r"Expected `object \| null`, got `str` - at `\$\.request\.lora_request`",
        id="lora-request-str",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "a", "lora_int_id": 1}),
        r"Object missing required field `lora_path` - at `\$\.request\.lora_request`",
        id="lora-request-no-path",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "a", "lora_int_id": 1, "lora_path": "/p", "x": 1}),
        r"Object contains unknown field `x` - at `\$\.request\.lora_request`",
        id="lora-request-unknown-field",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "a", "lora_int_id": "1", "lora_path": "/p"}),
        r"Expected `int`, got `str` - at `\$\.request\.lora_request\.lora_int_id`",
        id="lora-int-id-str",
    ),
    pytest.param(b"\xc1\x00", "Not a MessagePack message", id="random-bytes"),
    pytest.param(b"\x82\xa4type", "Not a MessagePack message.*truncated", id="truncated"),
    pytest.param(encode({"type": "ping"}) + b"\x00", "trailing characters", id="trailing-bytes"),
    pytest.param(b"", "truncated", id="empty-body"),
    pytest.param(encode(["submit"]), "Expected `object`, got `array`", id="array"),
    pytest.param(encode("ping"), "Expected `object`, got `str`", id="string"),
    pytest.param(encode(17), "Expected `object`, got `int`", id="int"),
    pytest.param(encode({}), "missing required field `type`", id="missing-type"),
    pytest.param(
        encode({"type": "submitt"}), r"Invalid value 'submitt' - at `\$\.type`", id="unknown-type"
    ),
    pytest.param(
        encode({"type": 1}), r"Expected `str`, got `int` - at `\$\.type`", id="type-not-str"
    ),
    pytest.param(
        encode({"type": "ping", "colour": 1}), "unknown field `colour`", id="unknown-field"
    ),
    pytest.param(
        _submit(max_token=4),
        r"unknown field `max_token` - at `\$\.request`",
        id="unknown-request-field",
    ),
    pytest.param(
        encode({"type": "submit"}), "missing required field `request`", id="missing-request"
    ),
    pytest.param(
        encode({"type": "submit", "request": {"max_tokens": 1}}),
        r"missing required field `token_ids` - at `\$\.request`",
        id="missing-token-ids",
    ),
    pytest.param(
        encode({"type": "cancel"}), "missing required field `request_id`", id="missing-request-id"
    ),
    pytest.param(
        _submit(max_tokens="4"),
        r"Expected `int`, got `str` - at `\$\.request\.max_tokens`",
        id="str-int",
    ),
    pytest.param(
        _submit(token_ids="123"),
        r"Expected `array`, got `str` - at `\$\.request\.token_ids`",
        id="token-ids-str",
    ),
    pytest.param(
        _submit(token_ids=[1, 2.5]),
        r"Expected `int`, got `float` - at `\$\.request\.token_ids\[1\]`",
        id="token-float",
    ),
    pytest.param(_submit(request_id=5), r"at `\$\.request\.request_id`", id="request-id-int"),
    pytest.param(encode({"type": "ping", "id": 1.5}), r"at `\$\.id`", id="id-float"),
    pytest.param(encode({"type": "ping", "id": b"x"}), r"got `bytes` - at `\$\.id`", id="id-bytes"),
    pytest.param(encode({1: "ping"}), "Expected `str`, got `int`", id="int-key"),
    pytest.param(
        encode({"type": "release_source", "handoff_id": None}),
        r"Expected `str`, got `None` - at `\$\.handoff_id`",
        id="handoff-null",
    ),
    pytest.param(
        # the tag comes last, so msgspec must skip the nested value to find it
        b"\x82\xa1x" + b"\x91" * 100_000 + b"\xc0\xa4type\xa4ping",
        "nested too deeply",
        id="deep-nesting",
    ),
    pytest.param(
        encode({"type": "set_vocabulary"}),
        "missing required field `vocab_size`",
        id="vocabulary-missing-size",
    ),
    pytest.param(
        encode({"type": "set_vocabulary", "vocab_size": "1000"}),
        r"Expected `int \| null`, got `str` - at `\$\.vocab_size`",
        id="vocabulary-size-str",
    ),
    pytest.param(
        encode({"type": "set_vocabulary", "vocab_size": 10, "excluded_token_ids": 2}),
        r"Expected `array`, got `int` - at `\$\.excluded_token_ids`",
        id="vocabulary-excluded-int",
    ),
    pytest.param(
        encode({"type": "set_fpm_worker_id", "worker_id": 7}),
        r"Expected `str`, got `int` - at `\$\.worker_id`",
        id="worker-id-int",
    ),
    pytest.param(
        encode({"type": "watch_load", "rank": 0}),
        "unknown field `rank`",
        id="watch-load-unknown-key",
    ),
]

INVALID_REQUEST_CASES = [
    pytest.param(
        _submit(token_ids=[]),
        r"Expected `array` of length >= 1 - at `\$\.request\.token_ids`",
        id="empty-prompt",
    ),
    pytest.param(
        _submit(token_ids=[1, 2, 2**32]),
        r"Expected `int` <= 4294967295 - at `\$\.request\.token_ids\[2\]`",
        id="token-id-2**32",
    ),
    pytest.param(
        _submit(token_ids=[-1]),
        r"Expected `int` >= 0 - at `\$\.request\.token_ids\[0\]`",
        id="negative-token",
    ),
    pytest.param(
        _submit(output_token_ids=[2**40]),
        r"at `\$\.request\.output_token_ids\[0\]`",
        id="output-token-id-2**40",
    ),
    pytest.param(
        _submit(max_tokens=-1),
        r"Expected `int` >= 0 - at `\$\.request\.max_tokens`",
        id="negative-max-tokens",
    ),
    pytest.param(_submit(dp_rank=-1), r"`\$\.request\.dp_rank`", id="negative-dp-rank"),
    pytest.param(
        _submit(seed=2**63),
        r"Expected `int` <= 9223372036854775807 - at `\$\.request\.seed`",
        id="seed-over-int64",
    ),
    pytest.param(
        _submit(priority=2**63),
        r"Expected `int` <= 9223372036854775807 - at `\$\.request\.priority`",
        id="priority-over-int64",
    ),
    pytest.param(
        _submit(seed=2**64 - 1),
        r"Expected `int` <= 9223372036854775807 - at `\$\.request\.seed`",
        id="seed-u64-max",
    ),
    pytest.param(
        _submit(stop_token_ids=list(range(STOP_TOKEN_IDS_MAX + 1))),
        r"Expected `array` of length <= 256 - at `\$\.request\.stop_token_ids`",
        id="stop-token-ids-257",
    ),
    pytest.param(
        _submit(stop_token_ids=[1, 2**32]),
        r"Expected `int` <= 4294967295 - at `\$\.request\.stop_token_ids\[1\]`",
        id="stop-token-id-over-u32",
    ),
    pytest.param(
        _submit(stop_token_ids=[-1]),
        r"Expected `int` >= 0 - at `\$\.request\.stop_token_ids\[0\]`",
        id="stop-token-id-negative",
    ),
    pytest.param(
        _submit(min_tokens=-1),
        r"Expected `int` >= 0 - at `\$\.request\.min_tokens`",
        id="negative-min-tokens",
    ),
    pytest.param(
        _submit(cache_salt="s" * (CACHE_SALT_MAX_BYTES + 1)),
        r"`cache_salt` must be at most 1024 bytes of UTF-8, got 1025 - at "
        r"`\$\.request\.cache_salt`",
        id="cache-salt-1025",
    ),
    pytest.param(
        _submit(cache_salt="😀" * 256 + "a"),  # 257 characters, 1025 bytes
        r"`cache_salt` must be at most 1024 bytes of UTF-8, got 1025 - at "
        r"`\$\.request\.cache_salt`",
        id="cache-salt-1025-bytes-4-byte-chars",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "a", "lora_int_id": 0, "lora_path": "/p"}),
        r"Expected `int` >= 1 - at `\$\.request\.lora_request\.lora_int_id`",
        id="lora-int-id-0",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "", "lora_int_id": 1, "lora_path": "/p"}),
        r"Expected `str` of length >= 1 - at `\$\.request\.lora_request\.lora_name`",
        id="lora-name-empty",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "a", "lora_int_id": 1, "lora_path": ""}),
        r"Expected `str` of length >= 1 - at `\$\.request\.lora_request\.lora_path`",
        id="lora-path-empty",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "😀" * 64 + "a", "lora_int_id": 1, "lora_path": "/"}),
        r"`lora_name` must be at most 256 bytes of UTF-8, got 257 - at "
        r"`\$\.request\.lora_request\.lora_name`",
        id="lora-name-257-bytes",
    ),
    pytest.param(
        _submit(lora_request={"lora_name": "a", "lora_int_id": 1, "lora_path": "p" * 10_000_000}),
        r"`lora_path` must be at most 4096 bytes of UTF-8, got 10000000 - at "
        r"`\$\.request\.lora_request\.lora_path`",
        id="lora-path-10MB",
    ),
    pytest.param(
        _submit(cache_salt="s" * 10_000_000),
        r"`cache_salt` must be at most 1024 bytes of UTF-8, got 10000000 - at",
        id="cache-salt-10MB",
    ),
    pytest.param(
        encode({"type": "reset_prefix_cache", "dp_rank": -2}),
        r"`\$\.dp_rank`",
        id="negative-reset-rank",
    ),
    pytest.param(
        encode({"type": "wait_idle", "dp_rank": -1}),
        r"`\$\.dp_rank`",
        id="wait-idle-negative-rank",
    ),
    pytest.param(
        encode({"type": "sleep", "level": 3}), r"<= 2 - at `\$\.level`", id="sleep-level-3"
    ),
    pytest.param(
        encode({"type": "sleep", "level": -1}), r">= 0 - at `\$\.level`", id="sleep-level-neg"
    ),
    pytest.param(
        encode({"type": "wake_up", "tags": ["t"] * 17}),
        r"length <= 16 - at `\$\.tags`",
        id="wake-up-17-tags",
    ),
    pytest.param(
        encode({"type": "wake_up", "tags": ["t" * 10_000_000]}),
        r"length <= 64 - at `\$\.tags\[0\]`",
        id="wake-up-tag-10MB",
    ),
    pytest.param(
        _submit(request_id=""), r"length >= 1 - at `\$\.request\.request_id`", id="empty-request-id"
    ),
    pytest.param(
        _submit(request_id="r" * 257),
        r"`request_id` must be at most 256 bytes of UTF-8, got 257 - at `\$\.request\.request_id`",
        id="request-id-257-ascii",
    ),
    pytest.param(
        _submit(request_id="é" * 128 + "a"),  # 129 characters, 257 bytes
        r"`request_id` must be at most 256 bytes of UTF-8, got 257 - at `\$\.request\.request_id`",
        id="request-id-257-bytes-2-byte-chars",
    ),
    pytest.param(
        _submit(request_id="😀" * 64 + "a"),  # 65 characters, 257 bytes
        r"got 257 - at `\$\.request\.request_id`",
        id="request-id-257-bytes-4-byte-chars",
    ),
    pytest.param(
        encode({"type": "cancel", "request_id": "€" * 86}),  # 258 bytes
        r"`request_id` must be at most 256 bytes of UTF-8, got 258 - at `\$\.request_id`",
        id="cancel-request-id",
    ),
    pytest.param(
        encode({"type": "activate_destination", "handoff_id": "h" * 257}),
        r"`handoff_id` must be at most 256 bytes of UTF-8, got 257 - at `\$\.handoff_id`",
        id="handoff-id-257",
    ),
    pytest.param(
        encode(
            {
                "type": "submit_handoff_prefill",
                "handoff_id": "",
                "request": {"token_ids": [1], "max_tokens": 1},
            }
        ),
        r"length >= 1 - at `\$\.handoff_id`",
        id="empty-handoff-id",
    ),
    pytest.param(
        encode({"type": "ping", "id": "i" * 129}),
        r"`id` must be at most 128 bytes of UTF-8, got 129 - at `\$\.id`",
        id="id-129",
    ),
    pytest.param(
        encode({"type": "ping", "id": "é" * 65}),
        r"`id` must be at most 128 bytes of UTF-8, got 130 - at `\$\.id`",
        id="id-130-bytes-65-chars",
    ),
    pytest.param(
        encode({"type": "set_vocabulary", "vocab_size": 0}),
        r"Expected `int` >= 1 - at `\$\.vocab_size`",
        id="vocabulary-size-0",
    ),
    pytest.param(
        encode({"type": "set_vocabulary", "vocab_size": 2**32 + 1}),
        r"Expected `int` <= 4294967296 - at `\$\.vocab_size`",
        id="vocabulary-size-over-u32",
    ),
    pytest.param(
        encode({"type": "set_vocabulary", "vocab_size": 10, "excluded_token_ids": [-1]}),
        r"Expected `int` >= 0 - at `\$\.excluded_token_ids\[0\]`",
        id="vocabulary-excluded-negative",
    ),
    pytest.param(
        encode({"type": "set_fpm_worker_id", "worker_id": ""}),
        r"length >= 1 - at `\$\.worker_id`",
        id="worker-id-empty",
    ),
    pytest.param(
        encode({"type": "set_fpm_worker_id", "worker_id": "w" * 257}),
        r"`worker_id` must be at most 256 bytes of UTF-8, got 257 - at `\$\.worker_id`",
        id="worker-id-257",
    ),
    pytest.param(
        encode({"type": "set_fpm_worker_id", "worker_id": "w", "dp_rank": -1}),
        r"Expected `int` >= 0 - at `\$\.dp_rank`",
        id="worker-id-rank-negative",
    ),
]


class TestRefusals:
    @pytest.mark.parametrize(("body", "match"), BAD_MESSAGE_CASES)
    def test_bad_message(self, body: bytes, match: str) -> None:
        with pytest.raises(WireError, match=match) as info:
            DECODER.decode(body)
        assert info.value.code == "bad_message"

    @pytest.mark.parametrize(("body", "match"), INVALID_REQUEST_CASES)
    def test_invalid_request(self, body: bytes, match: str) -> None:
        with pytest.raises(WireError, match=match) as info:
            DECODER.decode(body)
        assert info.value.code == "invalid_request"

    @pytest.mark.parametrize(
        "request_id",
        ["r" * 256, "é" * 128, "😀" * 64, "€" * 85 + "a"],
        ids=["ascii", "2B", "4B", "3B"],
    )
    def test_request_id_of_256_bytes_is_accepted(self, request_id: str) -> None:
        msg = DECODER.decode(_submit(request_id=request_id))
        assert isinstance(msg, control.Submit)
        assert msg.request.request_id == request_id

    def test_id_of_128_bytes_and_any_int_id_are_accepted(self) -> None:
        assert DECODER.decode(encode({"type": "ping", "id": "é" * 64})) == control.Ping(id="é" * 64)
        assert DECODER.decode(encode({"type": "ping", "id": -(2**63)})) == control.Ping(id=-(2**63))

    def test_decoder_reads_memoryview(self) -> None:
        body = memoryview(encode({"type": "ping"}))
        assert DECODER.decode(body) == control.Ping()


class TestErrorCarriesMessageId:
    def test_id_of_a_shape_error_is_echoed(self) -> None:
        with pytest.raises(WireError) as info:
            DECODER.decode(encode({"type": "submitt", "id": 7}))
        assert info.value.message_id == 7

    def test_id_of_a_rule_violation_is_echoed(self) -> None:
        with pytest.raises(WireError) as info:
            DECODER.decode(encode({"type": "cancel", "id": "c-1", "request_id": "x" * 300}))
        assert (info.value.code, info.value.message_id) == ("invalid_request", "c-1")

    def test_id_after_a_constraint_failure_is_echoed(self) -> None:
        body = encode({"type": "submit", "request": {"token_ids": [], "max_tokens": 1}, "id": 9})
        with pytest.raises(WireError) as info:
            DECODER.decode(body)
        assert info.value.message_id == 9

    @pytest.mark.parametrize(
        "body",
        [
            b"\xc1",
            encode({"type": "ping", "id": "i" * 129}),
            encode({"type": "nope", "id": "i" * 129}),
            encode({"type": "nope", "id": 1.5}),
            encode({"type": "nope"}),
        ],
    )
    def test_no_id_when_it_cannot_be_read_or_is_itself_invalid(self, body: bytes) -> None:
        with pytest.raises(WireError) as info:
            DECODER.decode(body)
        assert info.value.message_id is None


class TestNamedChecks:
    def test_check_request_id_counts_bytes(self) -> None:
        control.check_request_id("é" * 128)
        with pytest.raises(WireError, match="got 258"):
            control.check_request_id("é" * 129)

    def test_check_handoff_id_path(self) -> None:
        with pytest.raises(WireError, match=r"at `\$\.x`"):
            control.check_handoff_id("h" * 300, "$.x")

    def test_check_message_id_ignores_ints(self) -> None:
        control.check_message_id(2**64 - 1)
        with pytest.raises(WireError, match="at most 128 bytes"):
            control.check_message_id("i" * 129)

    def test_lone_surrogates_are_counted_not_crashed_on(self) -> None:
        with pytest.raises(WireError, match="got 258"):
            control.check_request_id("\ud800" * 86)


def test_wire_error_shape() -> None:
    err = WireError("bad_message", "boom", message_id=3)
    assert isinstance(err, ValueError)
    assert (err.code, err.message, err.message_id, str(err)) == ("bad_message", "boom", 3, "boom")
    assert repr(err) == "WireError('bad_message', 'boom')"


@pytest.mark.parametrize(
    "body",
    [b"\xc1", encode([1]), encode({"type": "output"}), encode({"type": "welcome", "id": 1})],
)
def test_reply_decoder_refuses_non_replies(body: bytes) -> None:
    with pytest.raises(WireError) as info:
        ReplyDecoder().decode(body)
    assert info.value.code == "bad_message"


def test_reply_decoder_ignores_fields_a_later_daemon_adds() -> None:
    body = encode({"type": "submitted", "request_id": "r", "dp_rank": 0, "queue_position": 3})
    assert ReplyDecoder().decode(body) == control.Submitted(request_id="r", dp_rank=0)
