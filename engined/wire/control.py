"""Control protocol v1: the codecs of the daemon's ROUTER socket, and every message struct.

The structs are declared in `engined.wire.messages` and re-exported here, so callers import
messages and codecs from one place. `ControlDecoder` turns every decoding failure into one
`WireError` whose code the daemon sends back as is; it also checks the rules msgspec's
constraints cannot express (UTF-8 byte lengths).
"""

from __future__ import annotations

import re
from typing import Final, TypeAlias

import msgspec

from engined.wire.constraints import (
    CACHE_SALT_MAX_BYTES,
    LORA_NAME_MAX_BYTES,
    LORA_PATH_MAX_BYTES,
    WEIGHT_VERSION_MAX_BYTES,
)
from engined.wire.messages import (
    CLIENT_MESSAGE_TAGS as CLIENT_MESSAGE_TAGS,
)
from engined.wire.messages import (
    DEFAULT_WEIGHT_VERSION as DEFAULT_WEIGHT_VERSION,
)
from engined.wire.messages import (
    HANDOFF_ID_MAX_BYTES as HANDOFF_ID_MAX_BYTES,
)
from engined.wire.messages import (
    MESSAGE_ID_MAX_BYTES as MESSAGE_ID_MAX_BYTES,
)
from engined.wire.messages import (
    OPERATOR_ONLY as OPERATOR_ONLY,
)
from engined.wire.messages import (
    PROTOCOL_VERSION as PROTOCOL_VERSION,
)
from engined.wire.messages import (
    REQUEST_ID_MAX_BYTES as REQUEST_ID_MAX_BYTES,
)
from engined.wire.messages import (
    WORKER_ID_MAX_BYTES as WORKER_ID_MAX_BYTES,
)
from engined.wire.messages import (
    ActivateDestination as ActivateDestination,
)
from engined.wire.messages import (
    Applied as Applied,
)
from engined.wire.messages import (
    Cancel as Cancel,
)
from engined.wire.messages import (
    CancelDestination as CancelDestination,
)
from engined.wire.messages import (
    CancelSource as CancelSource,
)
from engined.wire.messages import (
    ClientMessage as ClientMessage,
)
from engined.wire.messages import (
    ClientMessageBase as ClientMessageBase,
)
from engined.wire.messages import (
    DaemonMessage as DaemonMessage,
)
from engined.wire.messages import (
    DaemonMessageBase as DaemonMessageBase,
)
from engined.wire.messages import (
    DestinationAccepted as DestinationAccepted,
)
from engined.wire.messages import (
    DestinationReservedEvent as DestinationReservedEvent,
)
from engined.wire.messages import (
    DirectReply as DirectReply,
)
from engined.wire.messages import (
    ErrorReply as ErrorReply,
)
from engined.wire.messages import (
    FinishReason as FinishReason,
)
from engined.wire.messages import (
    Hello as Hello,
)
from engined.wire.messages import (
    KvTransferTimingMode as KvTransferTimingMode,
)
from engined.wire.messages import (
    Lifecycle as Lifecycle,
)
from engined.wire.messages import (
    Load as Load,
)
from engined.wire.messages import (
    Metrics as Metrics,
)
from engined.wire.messages import (
    MetricsReply as MetricsReply,
)
from engined.wire.messages import (
    Noop as Noop,
)
from engined.wire.messages import (
    Output as Output,
)
from engined.wire.messages import (
    OutputEntry as OutputEntry,
)
from engined.wire.messages import (
    Pause as Pause,
)
from engined.wire.messages import (
    Ping as Ping,
)
from engined.wire.messages import (
    Pong as Pong,
)
from engined.wire.messages import (
    RankStats as RankStats,
)
from engined.wire.messages import (
    ReleaseKvCacheMemory as ReleaseKvCacheMemory,
)
from engined.wire.messages import (
    ReleaseSource as ReleaseSource,
)
from engined.wire.messages import (
    ReserveDestination as ReserveDestination,
)
from engined.wire.messages import (
    ResetPrefixCache as ResetPrefixCache,
)
from engined.wire.messages import (
    Resume as Resume,
)
from engined.wire.messages import (
    SetFpmWorkerId as SetFpmWorkerId,
)
from engined.wire.messages import (
    SetVocabulary as SetVocabulary,
)
from engined.wire.messages import (
    SetWeightVersion as SetWeightVersion,
)
from engined.wire.messages import (
    Sleep as Sleep,
)
from engined.wire.messages import (
    SourceHeldEvent as SourceHeldEvent,
)
from engined.wire.messages import (
    Stats as Stats,
)
from engined.wire.messages import (
    StatsReply as StatsReply,
)
from engined.wire.messages import (
    Submit as Submit,
)
from engined.wire.messages import (
    SubmitHandoffPrefill as SubmitHandoffPrefill,
)
from engined.wire.messages import (
    Submitted as Submitted,
)
from engined.wire.messages import (
    TransferTiming as TransferTiming,
)
from engined.wire.messages import (
    WaitIdle as WaitIdle,
)
from engined.wire.messages import (
    WakeUp as WakeUp,
)
from engined.wire.messages import (
    WatchLoad as WatchLoad,
)
from engined.wire.messages import (
    Welcome as Welcome,
)
from engined.wire.messages import (
    WireLifecycleEvent as WireLifecycleEvent,
)
from engined.wire.messages import (
    WireLoraRequest as WireLoraRequest,
)
from engined.wire.messages import (
    WireRequest as WireRequest,
)
from engined.wire.probe import probe_id

# Re-exported: callers of ControlDecoder catch WireError from here.
from engined.wire.protocol_errors import ErrorCode as ErrorCode
from engined.wire.protocol_errors import WireError as WireError

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
        case SetWeightVersion():
            _check_utf8_max(
                msg.weight_version, WEIGHT_VERSION_MAX_BYTES, "weight_version", "$.weight_version"
            )
        case _:
            pass


def _check_request(request: WireRequest) -> None:
    if request.request_id is not None:
        check_request_id(request.request_id)
    if request.cache_salt is not None:
        _check_utf8_max(
            request.cache_salt, CACHE_SALT_MAX_BYTES, "cache_salt", "$.request.cache_salt"
        )
    lora = request.lora_request
    if lora is not None:
        _check_utf8_max(
            lora.lora_name, LORA_NAME_MAX_BYTES, "lora_name", "$.request.lora_request.lora_name"
        )
        _check_utf8_max(
            lora.lora_path, LORA_PATH_MAX_BYTES, "lora_path", "$.request.lora_request.lora_path"
        )


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
