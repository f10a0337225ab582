"""Caller mistakes the core refuses, each carrying the upstream message verbatim.

A failed command changes nothing. The daemon maps each class to one protocol error code
(`code` below), so a client can act on the kind of failure without parsing the text.
"""

from __future__ import annotations

from typing import Final, Literal, cast

import msgspec


class CoreError(Exception):
    """Base of every error the core raises on purpose."""

    code = "invalid_request"


class InvalidArgsError(CoreError, ValueError):
    """Engine arguments failed validation; the message names the key, and so does `key`.

    `key` is the `EngineArgs` field the error is about (`block_size`, `sglang.page_size`, or
    a legacy key such as `is_prefill`), so the daemon can name it in a config error without
    reading it back out of upstream's text. None where the raiser knows no field (the MTP
    sampler and perf model check values that `EngineArgs` has validated already).
    """

    code = "invalid_args"

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class InvalidRequestError(CoreError, ValueError):
    """A request breaks a rule of the request schema (empty prompt, negative max_tokens...)."""

    code = "invalid_request"


class DuplicateRequestError(CoreError):
    """The request id is already owned by this core."""

    code = "duplicate_request"

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} is already active")
        self.request_id = request_id


class HandoffConflictError(CoreError):
    """A handoff id or request id is already registered on the side it was sent to."""

    code = "duplicate_request"


class UnsupportedError(CoreError):
    code = "unsupported"


class CapacityError(CoreError):
    code = "capacity"


ErrorKind = Literal[
    "CoreError",
    "InvalidArgsError",
    "InvalidRequestError",
    "DuplicateRequestError",
    "HandoffConflictError",
    "UnsupportedError",
    "CapacityError",
]
_KINDS: Final[dict[str, type[CoreError]]] = {
    cls.__name__: cls
    for cls in (
        CoreError,
        InvalidArgsError,
        InvalidRequestError,
        DuplicateRequestError,
        HandoffConflictError,
        UnsupportedError,
        CapacityError,
    )
}


class CoreFailure(msgspec.Struct, frozen=True, array_like=True):
    """A raised `CoreError` as a value, so that it can cross a process boundary.

    A rank worker process answers a failed command with one; the daemon raises `error()`,
    the same class with the same message (and `key` or `request_id`), as an in-process rank
    would have raised it. A kind this build does not know cannot be decoded.
    """

    kind: ErrorKind
    message: str
    key: str | None = None  # InvalidArgsError's
    request_id: str | None = None  # DuplicateRequestError's

    @classmethod
    def of(cls, exc: CoreError) -> CoreFailure:
        kind = cast(ErrorKind, next(c.__name__ for c in type(exc).__mro__ if c.__name__ in _KINDS))
        match exc:
            case InvalidArgsError():
                return cls(kind, str(exc), key=exc.key)
            case DuplicateRequestError():
                return cls(kind, str(exc), request_id=exc.request_id)
        return cls(kind, str(exc))

    def error(self) -> CoreError:
        cls = _KINDS[self.kind]
        if cls is InvalidArgsError:
            return InvalidArgsError(self.message, key=self.key)
        if cls is DuplicateRequestError and self.request_id is not None:
            return DuplicateRequestError(self.request_id)
        return cls(self.message)


def handoff_repr(handoff_id: str) -> str:
    """Upstream formats handoff ids with Rust's Debug (`HandoffId(<id>)`); so do we."""
    return f"HandoffId({handoff_id})"
