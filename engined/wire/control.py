"""Control protocol v1: the messages on the daemon's ROUTER socket, and their codecs.

Client -> daemon messages are one tagged union (`"type"`, snake_case) of strict structs:
unknown keys are refused so typos surface, and msgspec checks types and value ranges while
decoding. `ControlDecoder` turns every failure into one `WireError` whose code the daemon sends
back as is. Daemon -> client messages tolerate unknown keys when decoded, so a client keeps
working when a later daemon adds fields (msgspec's schema evolution rules).
"""

from __future__ import annotations

import re
from typing import Final, Literal, TypeAlias, get_args

import msgspec

from engined.core.args import EngineType, WorkerType
from engined.wire.constraints import (
    DpRank,
    HandoffIdStr,
    MessageId,
    NonNegativeInt,
    PromptTokenIds,
    RequestIdStr,
    TokenId,
    VocabSize,
    WorkerIdStr,
)

# Re-exported: callers of ControlDecoder catch WireError from here.
from engined.wire.errors import ErrorCode as ErrorCode
from engined.wire.errors import WireError as WireError
from engined.wire.probe import probe_id

PROTOCOL_VERSION: Final = 1
REQUEST_ID_MAX_BYTES: Final = 256
HANDOFF_ID_MAX_BYTES: Final = 256
MESSAGE_ID_MAX_BYTES: Final = 128
WORKER_ID_MAX_BYTES: Final = 256

FinishReason: TypeAlias = Literal["length", "rejected", "cancelled"]

# --- client -> daemon -----------------------------------------------------------------------


class WireRequest(
    msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True, frozen=True
):
    """The `request` map of `submit`, `submit_handoff_prefill` and `reserve_destination`.

    `request_id` is minted by the core when absent; `output_token_ids`, when given, is the
    planned output and its length overrides `max_tokens` (0 = prefill only); `dp_rank` pins
    the rank, else the daemon picks one round-robin.
    """

    request_id: RequestIdStr | None = None
    token_ids: PromptTokenIds
    max_tokens: NonNegativeInt
    output_token_ids: list[TokenId] | None = None
    dp_rank: DpRank | None = None


class ClientMessageBase(
    msgspec.Struct,
    tag_field="type",
    forbid_unknown_fields=True,
    kw_only=True,
    omit_defaults=True,
):
    """Base of every client message; `id` is copied into the direct reply."""

    # NOTE: not frozen: mypy would then demand `frozen=True` restated on every subclass.

    id: MessageId | None = None


class Hello(ClientMessageBase, tag="hello"):
    pass


class Submit(ClientMessageBase, tag="submit"):
    request: WireRequest


class Cancel(ClientMessageBase, tag="cancel"):
    request_id: RequestIdStr


class SubmitHandoffPrefill(ClientMessageBase, tag="submit_handoff_prefill"):
    handoff_id: HandoffIdStr
    request: WireRequest


class ReleaseSource(ClientMessageBase, tag="release_source"):
    handoff_id: HandoffIdStr


class CancelSource(ClientMessageBase, tag="cancel_source"):
    handoff_id: HandoffIdStr


class ReserveDestination(ClientMessageBase, tag="reserve_destination"):
    handoff_id: HandoffIdStr
    request: WireRequest


class ActivateDestination(ClientMessageBase, tag="activate_destination"):
    handoff_id: HandoffIdStr


class CancelDestination(ClientMessageBase, tag="cancel_destination"):
    handoff_id: HandoffIdStr


class Stats(ClientMessageBase, tag="stats"):
    pass


class ResetPrefixCache(ClientMessageBase, tag="reset_prefix_cache"):
    """Clear the prefix cache of `dp_rank`, or of every rank when absent."""

    dp_rank: DpRank | None = None


class Ping(ClientMessageBase, tag="ping"):
    pass


class WaitIdle(ClientMessageBase, tag="wait_idle"):
    """Answer (a `stats` reply) once `dp_rank`, or every rank when absent, is idle.

    Idle: nothing queued, running or parked, and every command the daemon received before
    this message applied and its outputs sent. Tests and benchmarks that wait for a workload
    to finish then need no `stats` polling loop.
    """

    dp_rank: DpRank | None = None


class SetVocabulary(ClientMessageBase, tag="set_vocabulary"):
    """Draw generated ids from `[0, vocab_size)` without `excluded_token_ids`, on every rank.

    A front end that detokenizes (Dynamo's) needs ids its tokenizer knows, and outputs that
    never hit its EOS; `vocab_size` nil restores random u32 ids. Affects tokens drawn after it.
    """

    vocab_size: VocabSize | None
    excluded_token_ids: list[TokenId] = msgspec.field(default_factory=list)


class SetFpmWorkerId(ClientMessageBase, tag="set_fpm_worker_id"):
    """Stamp every rank's forward-pass metrics with `worker_id` from now on.

    Dynamo's planner joins FPM with the worker that relays it by this id, which only the
    worker knows (its endpoint's connection id), so the worker tells the daemon.
    """

    worker_id: WorkerIdStr


class WatchLoad(ClientMessageBase, tag="watch_load"):
    """Stream `load` messages to this client: one per rank now, then one whenever it changes.

    A KV router needs each rank's used blocks as they change; pushing them after the pass
    that changed them is both prompter and cheaper than polling `stats`.
    """


ClientMessage: TypeAlias = (
    Hello
    | Submit
    | Cancel
    | SubmitHandoffPrefill
    | ReleaseSource
    | CancelSource
    | ReserveDestination
    | ActivateDestination
    | CancelDestination
    | Stats
    | ResetPrefixCache
    | Ping
    | WaitIdle
    | SetVocabulary
    | SetFpmWorkerId
    | WatchLoad
)

# The `type` tags of every client message, in declaration order (fuzzers, docs and tests).
CLIENT_MESSAGE_TAGS: Final = tuple(str(c.__struct_config__.tag) for c in get_args(ClientMessage))

# --- daemon -> client -----------------------------------------------------------------------


class DaemonMessageBase(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every daemon message; fields equal to their default (None) are left out."""


class DirectReply(DaemonMessageBase, kw_only=True):
    """A reply to one client message, echoing its `id` when it had one."""

    # NOTE: `kw_only` is restated because mypy applies it per declaring class: without it,
    # mypy reads `id` as positional and refuses the required fields subclasses add after it.

    id: MessageId | None = None


class Welcome(DirectReply, tag="welcome"):
    """What a client needs to find every socket; endpoint lists have one entry per rank.

    `kv_replay_endpoints` is empty when replay is disabled; `protocol` is `PROTOCOL_VERSION`.
    """

    protocol: int
    version: str
    engine_type: EngineType
    worker_type: WorkerType
    block_size: int
    num_gpu_blocks: int
    dp_size: int
    model_name: str
    kv_events_endpoints: list[str]
    kv_replay_endpoints: list[str]
    fpm_endpoints: list[str]
    # Added later in v1 (older clients ignore them): what a front end registering the
    # engine needs (Dynamo's model card), and the current vocabulary and FPM worker id.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    kv_events_topic: str | None = None
    kv_events_format: str | None = None
    vocab_size: int | None = None
    excluded_token_ids: list[int] | None = None
    fpm_worker_id: str | None = None
    # Wall time = modeled time / speedup_ratio (0: as fast as possible); a coordinator that
    # waits out a modeled KV transfer needs it.
    speedup_ratio: float | None = None


class Submitted(DirectReply, tag="submitted"):
    request_id: str
    dp_rank: int


class DestinationAccepted(DirectReply, tag="destination_accepted"):
    """The destination is owned; its KV reservation may still be pending (see `lifecycle`)."""

    request_id: str
    dp_rank: int


class Applied(DirectReply, tag="applied"):
    pass


class Noop(DirectReply, tag="noop"):
    """The command named nothing the daemon owns (unknown, or already released)."""


class RankStats(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    dp_rank: int
    active_blocks: int
    inactive_blocks: int
    total_blocks: int
    kv_cache_usage: float
    running: int
    waiting: int
    preemptions_total: int
    passes_total: int
    # How late passes started against their modeled deadlines (paced mode; 0 otherwise),
    # over the last 100,000 passes.
    lateness_p50_ms: float = 0.0
    lateness_p99_ms: float = 0.0
    lateness_max_ms: float = 0.0
    # Offload tiers (0 without them): the G2 host and G3 disk pools, as the GPU fields above.
    g2_active_blocks: int = 0
    g2_inactive_blocks: int = 0
    g2_total_blocks: int = 0
    g3_active_blocks: int = 0
    g3_inactive_blocks: int = 0
    g3_total_blocks: int = 0
    # KV event messages a slow subscriber missed because its byte budget was full
    # (`kv_events_buffer_bytes`); also `engined:kv_events_overflows_total`.
    kv_events_overflows: int = 0


class StatsReply(DirectReply, tag="stats"):
    ranks: list[RankStats]


class Pong(DirectReply, tag="pong"):
    pass


class ErrorReply(DirectReply, tag="error"):
    code: ErrorCode
    message: str


class OutputEntry(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True, gc=False):
    """What one request emitted in one pass (all tokens of a speculative burst together).

    `finish_reason` is null until the request's last entry; `cached_tokens` rides only on a
    request's first entry, `handoff_delay_ms` only on a prefill worker's last one.
    """

    # NOTE: `finish_reason` has no default so omit_defaults still sends it as null.

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    cached_tokens: int | None = None
    handoff_delay_ms: float | None = None


class Output(DaemonMessageBase, tag="output", gc=False):
    """At most one per client per engine pass."""

    dp_rank: int
    outputs: list[OutputEntry]


KvTransferTimingMode: TypeAlias = Literal["full_prompt", "destination_missing"]


class TransferTiming(msgspec.Struct, frozen=True, kw_only=True):
    """How the coordinator models a held source's KV transfer (PROTOCOL.md §1.7).

    The delay is `tokens * kv_bytes_per_token / (bandwidth_gb_s * 1e9)` seconds, where
    `tokens` is `full_prompt_tokens` in `full_prompt` mode and the destination's
    `transferable_prompt_tokens` (what its prefix cache lacks) in `destination_missing`
    mode; no delay is modelled while either figure is null (or the bandwidth <= 0).
    """

    mode: KvTransferTimingMode
    full_prompt_tokens: int
    kv_bytes_per_token: int | None
    bandwidth_gb_s: float | None


class SourceHeldEvent(msgspec.Struct, tag_field="kind", tag="source_held", frozen=True):
    handoff_id: str
    request_id: str
    # Added in protocol v1 without a version change; absent (null) from older daemons.
    transfer_timing: TransferTiming | None = None


class DestinationReservedEvent(
    msgspec.Struct, tag_field="kind", tag="destination_reserved", frozen=True
):
    handoff_id: str
    request_id: str
    transferable_prompt_tokens: int


WireLifecycleEvent: TypeAlias = SourceHeldEvent | DestinationReservedEvent


class Load(DaemonMessageBase, tag="load", gc=False):
    """A rank's KV load, streamed to `watch_load` clients after a pass or command changed it."""

    dp_rank: int
    active_blocks: int
    total_blocks: int
    kv_cache_usage: float
    running: int
    waiting: int


class Lifecycle(DaemonMessageBase, tag="lifecycle"):
    dp_rank: int
    events: list[WireLifecycleEvent]


DaemonMessage: TypeAlias = (
    Welcome
    | Submitted
    | DestinationAccepted
    | Applied
    | Noop
    | StatsReply
    | Pong
    | ErrorReply
    | Output
    | Lifecycle
    | Load
)

# --- rules Meta cannot express --------------------------------------------------------------


def _utf8_len(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _check_utf8_max(value: str, limit: int, name: str, path: str) -> None:
    # A code point is at most 4 bytes: short strings need no encoding to be known valid.
    if len(value) * 4 <= limit:
        return
    size = _utf8_len(value)
    if size > limit:
        raise WireError(
            "invalid_request",
            f"`{name}` must be at most {limit} bytes of UTF-8, got {size} - at `{path}`",
        )


def check_request_id(value: str, path: str = "$.request.request_id") -> None:
    """A request id is 1..256 UTF-8 bytes (Meta checks the lower bound, in characters)."""
    _check_utf8_max(value, REQUEST_ID_MAX_BYTES, "request_id", path)


def check_handoff_id(value: str, path: str = "$.handoff_id") -> None:
    """A handoff id is 1..256 UTF-8 bytes."""
    _check_utf8_max(value, HANDOFF_ID_MAX_BYTES, "handoff_id", path)


def check_message_id(value: int | str, path: str = "$.id") -> None:
    """A string `id` is at most 128 UTF-8 bytes; an int `id` is any msgpack int."""
    if isinstance(value, str):
        _check_utf8_max(value, MESSAGE_ID_MAX_BYTES, "id", path)


def _check_fields(msg: ClientMessage) -> None:
    match msg:
        case Submit():
            _check_request(msg.request)
        case SubmitHandoffPrefill() | ReserveDestination():
            check_handoff_id(msg.handoff_id)
            _check_request(msg.request)
        case ReleaseSource() | CancelSource() | ActivateDestination() | CancelDestination():
            check_handoff_id(msg.handoff_id)
        case Cancel():
            check_request_id(msg.request_id, "$.request_id")
        case SetFpmWorkerId():
            _check_utf8_max(msg.worker_id, WORKER_ID_MAX_BYTES, "worker_id", "$.worker_id")
        case _:
            pass


def _check_request(request: WireRequest) -> None:
    if request.request_id is not None:
        check_request_id(request.request_id)


# --- codecs ---------------------------------------------------------------------------------

# msgspec words every Meta constraint failure "Expected `T` <op> N" or "Expected `T` of length
# <op> N"; shape errors read "Expected `T`, got `U`", "Object missing/contains ... field".
_CONSTRAINT_FAILURE: Final = re.compile(r"^Expected `[^`]*` (?:of length )?[<>]=? ")

Body: TypeAlias = bytes | bytearray | memoryview


class ControlDecoder:
    """Decodes and validates client messages; build one per control socket.

    Errors map to protocol codes: shape problems (not msgpack, not a map, unknown type or
    field, missing field, wrong msgpack type) are `bad_message`; a well-shaped value breaking
    a rule (a range, a minimum length, a byte limit) is `invalid_request`.
    """

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(ClientMessage)

    def decode(self, body: Body) -> ClientMessage:
        """Decode one message body.

        Raises:
            WireError: the code and a message naming the field; `message_id` is the
                message's `id` when it could still be read and is itself valid.
        """
        try:
            msg = self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            text = str(exc)
            code: ErrorCode = (
                "invalid_request" if _CONSTRAINT_FAILURE.match(text) else "bad_message"
            )
            raise WireError(code, text, message_id=self._probe_id(body)) from None
        except msgspec.DecodeError as exc:
            # Invalid UTF-8 or truncation is a DecodeError, yet the id may still be readable.
            raise WireError(
                "bad_message",
                f"Not a MessagePack message: {exc}",
                message_id=self._probe_id(body),
            ) from None
        except RecursionError:
            # NOTE: msgspec recurses even to skip a value, so deeply nested input raises
            # RecursionError; it is a malformed message like any other, not a daemon failure.
            raise WireError(
                "bad_message", "Message is nested too deeply", message_id=self._probe_id(body)
            ) from None
        if msg.id is not None:
            check_message_id(msg.id)
        try:
            _check_fields(msg)
        except WireError as exc:
            exc.message_id = msg.id
            raise
        return msg

    def _probe_id(self, body: Body) -> int | str | None:
        message_id = probe_id(body)
        if message_id is None:
            return None
        try:
            check_message_id(message_id)
        except WireError:
            return None
        return message_id


class ReplyDecoder:
    """Decodes daemon messages on the client side; build one per client socket."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(DaemonMessage)

    def decode(self, body: Body) -> DaemonMessage:
        """Raises WireError(`bad_message`) for anything that is not a daemon message."""
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise WireError("bad_message", str(exc)) from None


_ENCODE: Final = msgspec.msgpack.Encoder().encode


def encode_reply(msg: DaemonMessage) -> bytes:
    """The body of a daemon -> client message."""
    return _ENCODE(msg)


def encode_message(msg: ClientMessage) -> bytes:
    """The body of a client -> daemon message (the client and tests send these)."""
    return _ENCODE(msg)
