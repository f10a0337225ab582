"""Twins of the seed module `source_holds` (docs/upstream/seed-tests.md, mod source_holds).

A handoff source runs as a normal prefill on a prefill worker; when it completes its KV stays
held (request gone, blocks active) until `ReleaseSource`/`CancelSource` frees it exactly once.
Every KV event the core emits (pass results and out-of-pass commands) is fed to the reference
indexer, which must see a clean stream.
"""

from __future__ import annotations

import re

import pytest

from engined.core.args import EngineArgs, WorkerType
from engined.core.engine import Engine
from engined.core.errors import CoreError, DuplicateRequestError
from engined.core.types import (
    APPLIED,
    NOOP,
    CancelSource,
    ReleaseSource,
    Request,
    SourceHeld,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
)
from tests.core.factories import (
    Watched,
    active_blocks,
    make_args,
    num_requests,
    source_is_held,
    source_is_registered,
    submit,
    uid,
)


def args() -> EngineArgs:
    """bs 4, 8 blocks, budget 8, one sequence, chunked, caching off, prefill worker."""
    return make_args(
        num_gpu_blocks=8,
        max_num_batched_tokens=8,
        max_num_seqs=1,
        enable_prefix_caching=False,
        worker_type=WorkerType.PREFILL,
    )


def request(request_id: str) -> Request:
    """The seed's 8-token prompt (0..8) with 2 output tokens."""
    return Request(token_ids=list(range(8)), max_tokens=2, request_id=request_id)


def test_terminal_completion_holds_source_without_freeing_kv() -> None:
    """Terminal completion of a handoff source holds its KV until ReleaseSource.

    1. SubmitHandoffPrefill(handoff 201, request 101: 8 tokens, 2 outputs) on a prefill core.
    2. Pass 1 at 0 ms: prefill + first token, not completed; KV is active.
    3. Pass 2 at pass 1's end: terminal token.

    Expected: pass 2 completes the request and emits exactly one SourceHeld(201, 101); the
    source is held, the request is gone, and the active block count is unchanged. The first
    ReleaseSource frees every block; a second one is a no-op and frees nothing more. The KV
    event stream is clean.
    """
    watched = Watched(Engine(args()))
    core = watched.core
    request_id = uid(101)
    handoff_id = uid(201)
    result = watched.command(SubmitHandoffPrefill(handoff_id, request(request_id)))
    assert result == Submitted(request_id)

    first = watched.execute(0.0)
    assert first.request_outputs()[0].finish_reason is None
    active_before_terminal = active_blocks(core)
    assert active_before_terminal > 0

    terminal = watched.execute(first.end_ms)
    assert terminal.request_outputs()[0].finish_reason is not None
    assert len(terminal.lifecycle_events) == 1
    held = terminal.lifecycle_events[0]
    assert isinstance(held, SourceHeld)
    assert held.handoff_id == handoff_id
    assert held.request_id == request_id
    assert source_is_held(core, handoff_id)
    assert core.inspect(request_id) is None
    assert active_blocks(core) == active_before_terminal

    assert watched.command(ReleaseSource(handoff_id)) == APPLIED
    assert not source_is_held(core, handoff_id)
    assert active_blocks(core) == 0

    assert watched.command(ReleaseSource(handoff_id)) == NOOP
    assert active_blocks(core) == 0
    assert core.is_drained()
    watched.assert_clean()


def test_cancel_and_early_release_cleanup_exactly_once() -> None:
    """CancelSource of a held source and ReleaseSource of a pending one each clean up once.

    1. SubmitHandoffPrefill(handoff 202, request 102); run two passes: the source is held.
    2. CancelSource(202) twice.
    3. Reuse handoff 202 for request 103 (registered, still pending), then ReleaseSource(202).
    4. Run two passes: request 103 completes.

    Expected: after step 1 blocks are held (> 0); the first CancelSource frees them all and the
    second frees nothing (0 blocks either way). The reused id registers again; releasing it
    while pending unregisters it, so request 103 completes as a plain request: nothing is held
    and 0 blocks stay active. The KV event stream is clean.
    """
    watched = Watched(Engine(args()))
    core = watched.core
    first_id = uid(202)
    watched.command(SubmitHandoffPrefill(first_id, request(uid(102))))
    first = watched.execute(0.0)
    watched.execute(first.end_ms)
    held_blocks = active_blocks(core)
    assert source_is_held(core, first_id)

    assert watched.command(CancelSource(first_id)) == APPLIED
    assert active_blocks(core) == 0
    assert watched.command(CancelSource(first_id)) == NOOP
    assert active_blocks(core) == 0
    assert held_blocks > 0

    second_id = first_id
    result = watched.command(SubmitHandoffPrefill(second_id, request(uid(103))))
    assert result == Submitted(uid(103))
    assert source_is_registered(core, second_id)
    assert watched.command(ReleaseSource(second_id)) == APPLIED
    assert not source_is_registered(core, second_id)

    first = watched.execute(0.0)
    terminal = watched.execute(first.end_ms)
    assert terminal.request_outputs()[0].finish_reason is not None
    assert terminal.lifecycle_events == []
    assert not source_is_held(core, second_id)
    assert active_blocks(core) == 0
    assert core.is_drained()
    watched.assert_clean()


def test_active_request_id_is_rejected_before_source_hold_registration() -> None:
    """An active request id is refused by Submit and by SubmitHandoffPrefill.

    1. receive(request 104).
    2. Submit(request 104) again.
    3. SubmitHandoffPrefill(handoff 204, request 104).

    Expected: steps 2 and 3 both fail with "request <104> is already active" and change
    nothing: handoff 204 is not registered, the core still holds exactly one request, and the
    metrics and active block count are those after step 1.
    """
    watched = Watched(Engine(args()))
    core = watched.core
    request_id = uid(104)
    handoff_id = uid(204)
    submit(core, request(request_id))
    metrics_before = core.metrics()
    active_before = active_blocks(core)
    message = re.escape(f"request {request_id} is already active")

    with pytest.raises(CoreError, match=message) as submit_error:
        watched.command(Submit(request(request_id)))
    assert isinstance(submit_error.value, DuplicateRequestError)
    with pytest.raises(CoreError, match=message) as handoff_error:
        watched.command(SubmitHandoffPrefill(handoff_id, request(request_id)))
    assert isinstance(handoff_error.value, DuplicateRequestError)

    assert not source_is_registered(core, handoff_id)
    assert num_requests(core) == 1
    assert core.metrics() == metrics_before
    assert active_blocks(core) == active_before
    watched.assert_clean()
