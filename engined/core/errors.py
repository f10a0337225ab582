"""Caller mistakes the core refuses, each carrying the upstream message verbatim.

A failed command changes nothing. The daemon maps each class to one protocol error code
(`code` below), so a client can act on the kind of failure without parsing the text.
"""

from __future__ import annotations


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


def handoff_repr(handoff_id: str) -> str:
    """Upstream formats handoff ids with Rust's Debug (`HandoffId(<id>)`); so do we."""
    return f"HandoffId({handoff_id})"
