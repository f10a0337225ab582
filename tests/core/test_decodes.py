"""A pass's plain decode steps travel column-wise (`Decodes`), its other outputs as
`RequestOutput`s, and `before` keeps the two in emission order.

Steady decoding pays no output object and no list per token; every consumer (the daemon's
routing, Prometheus, the rank workers' wire) reads both, and `request_outputs()` merges them
for tests. The token values are those of seed 0 and these request ids (each request draws from
its own stream, engined/core/token_stream.py).
"""

from __future__ import annotations

from engined.core.types import Decodes, FinishReason, RequestOutput
from tests.core.factories import make_args, make_core, request, submit, uid


def test_first_outputs_and_ends_are_outputs_the_steps_between_are_decodes() -> None:
    """r1 (prompt 4, 3 tokens) starts alone; r2 (prompt 4, 3 tokens) arrives for pass 2.

    Pass 1: r1's first token reports its cached tokens: an output, no step. Pass 2: r1's plain
    step comes before r2's first output in emission order (running order r1, r2). Pass 3:
    r1's last token is an output (it finishes), r2's plain step follows it.
    """
    core = make_core(make_args())
    r1, r2 = uid(1), uid(2)
    submit(core, request(r1, range(4), 3))
    first = core.execute_pass(0.0)
    assert first.outputs == [RequestOutput(r1, [2372731276], None, 0)]
    assert first.decodes == Decodes([], [], [0])

    submit(core, request(r2, range(100, 104), 3))
    second = core.execute_pass(1.0)
    assert second.outputs == [RequestOutput(r2, [1807314366], None, 0)]
    assert second.decodes == Decodes([r1], [543587401], [1])
    assert second.request_outputs() == [
        RequestOutput(r1, [543587401]),
        RequestOutput(r2, [1807314366], None, 0),
    ]

    third = core.execute_pass(2.0)
    assert third.outputs == [RequestOutput(r1, [2043858002], FinishReason.LENGTH)]
    assert third.decodes == Decodes([r2], [1635463185], [0])
    assert [out.request_id for out in third.request_outputs()] == [r1, r2]
    assert third.accept_length_output_tokens == 2


def test_a_steady_pass_has_no_output_objects() -> None:
    """Three running requests in mid-block: the pass's only outputs are three decode steps,
    in running order, and they count as three output tokens."""
    core = make_core(make_args(num_gpu_blocks=12, max_num_batched_tokens=16))
    ids = [uid(n) for n in (1, 2, 3)]
    for n, request_id in enumerate(ids):
        submit(core, request(request_id, range(10 * n, 10 * n + 2), 3))
    core.execute_pass(0.0)
    steady = core.execute_pass(1.0)
    assert steady.outputs == []
    assert steady.decodes.request_ids == ids
    assert steady.decodes.before == []
    assert all(type(token) is int for token in steady.decodes.token_ids)
    assert steady.accept_length_output_tokens == 3
    assert [out.new_token_ids for out in steady.request_outputs()] == [
        [token] for token in steady.decodes.token_ids
    ]


def test_planned_tokens_are_decode_steps_too() -> None:
    """A request with planned output ids takes the general emission path; its plain steps
    still go to the columns, with the planned ids."""
    core = make_core(make_args())
    rid = uid(0xA11CE)
    submit(core, request(rid, [1, 2], 3, output_token_ids=[101, 202, 303]))
    assert core.execute_pass(0.0).outputs == [RequestOutput(rid, [101], None, 0)]
    assert core.execute_pass(1.0).decodes == Decodes([rid], [202], [])
    assert core.execute_pass(2.0).outputs == [RequestOutput(rid, [303], FinishReason.LENGTH)]
