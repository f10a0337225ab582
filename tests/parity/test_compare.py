"""The comparison itself: divergences are found at the right step and field, and blocks are
identified by the token prefix they close, whatever their hashes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from parity.__main__ import TABLE_BEGIN, TABLE_END, write_table
from parity.compare import compare, table
from parity.runner import VllmVenvError, run_vllm, vllm_python
from parity.scenario import Config, Scenario, VllmJob
from parity.trace import (
    Admitted,
    Canonicalizer,
    Removed,
    Scheduled,
    Step,
    StopReport,
    Stored,
    Trace,
    canonical_events,
    prefix_identity,
)

A = list(range(1, 5))
B = list(range(5, 9))


def _trace(hashes: tuple[str, str], steps: int = 5) -> Trace:
    """Request r0 prefills 8 tokens in two blocks of 4, decodes, then its blocks go."""
    first, second = hashes
    out = [
        Step(
            index=0,
            scheduled=[Scheduled("r0", 0, 8)],
            admitted=[Admitted("r0", 0)],
            running=1,
            events=[Stored([first, second], None, A + B, 4)],
        )
    ]
    for i in range(1, steps - 1):
        out.append(Step(index=i, scheduled=[Scheduled("r0", 7 + i, 1)], running=1))
    out.append(Step(index=steps - 1, finished=["r0"], events=[Removed(second), Removed(first)]))
    return Trace(scenario="t", steps=out)


def _copy(trace: Trace) -> Trace:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(trace), type=Trace)


def test_equal_traces_are_equal_at_every_step() -> None:
    verdict = compare(_trace(("1", "2")), _trace(("1", "2")))
    assert (verdict.equal, verdict.total, verdict.first) == (5, 5, None)
    assert verdict.line() == "t: 5/5 steps equal"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scheduled", [Scheduled("r0", 10, 2)]),
        ("admitted", [Admitted("r0", 4)]),
        ("preempted", ["r0"]),
        ("finished", ["r0"]),
        ("stopped", [StopReport("r0", 7)]),
        ("running", 2),
        ("waiting", 1),
    ],
)
def test_an_injected_divergence_is_found_at_its_step_and_field(field: str, value: object) -> None:
    vllm = _copy(_trace(("1", "2")))
    setattr(vllm.steps[3], field, value)
    verdict = compare(_trace(("1", "2")), vllm)
    assert verdict.equal == 4
    assert verdict.first is not None
    assert (verdict.first.step, verdict.first.field) == (3, field)
    assert verdict.first.vllm == msgspec.to_builtins(value)
    assert verdict.first.context[-3] == "step 3:"


def test_a_divergent_block_token_is_an_events_divergence() -> None:
    vllm = _copy(_trace(("1", "2")))
    stored = vllm.steps[0].events[0]
    assert isinstance(stored, Stored)
    vllm.steps[0].events[0] = Stored(stored.block_hashes, None, [*A, 5, 6, 7, 99], 4)
    verdict = compare(_trace(("1", "2")), vllm)
    assert verdict.first is not None
    assert (verdict.first.step, verdict.first.field) == (0, "events")
    # The removal of the changed block differs too: its identity is a different prefix.
    assert verdict.equal == 3


def test_steps_one_side_never_reached_are_unequal() -> None:
    verdict = compare(_trace(("1", "2"), steps=5), _trace(("1", "2"), steps=7))
    assert (verdict.equal, verdict.total) == (4, 7)
    assert verdict.first is not None
    assert (verdict.first.step, verdict.first.field) == (4, "scheduled")


def test_other_hashes_for_the_same_tokens_are_equal_unless_raw_hashes() -> None:
    engined, vllm = _trace(("11", "12")), _trace(("aa", "bb"))
    assert compare(engined, vllm).equal == 5
    strict = compare(engined, vllm, raw_hashes=True)
    assert strict.equal == 3
    assert strict.first is not None
    assert (strict.first.step, strict.first.field) == (0, "raw events")


def test_canonical_identities_are_the_prefixes_blocks_close() -> None:
    blocks = canonical_events(_trace(("1", "2")))
    first, second = prefix_identity(A), prefix_identity(A + B)
    assert [(b.kind, b.identity, b.parent) for b in blocks[0]] == [
        ("stored", first, None),
        ("stored", second, first),
    ]
    assert [(b.kind, b.identity) for b in blocks[4]] == [("removed", second), ("removed", first)]
    assert prefix_identity(A + B) == prefix_identity(list(range(1, 9)))
    assert prefix_identity(A + B) != prefix_identity(B + A)
    assert prefix_identity(A) != prefix_identity([*A, 0])


def test_a_block_stored_under_a_parent_closes_the_parents_prefix_plus_its_tokens() -> None:
    canon = Canonicalizer()
    canon.step([Stored(["p"], None, A, 4)])
    child = canon.step([Stored(["c"], "p", B, 4)])
    alone = Canonicalizer().step([Stored(["x", "y"], None, A + B, 4)])
    assert child[0].identity == alone[1].identity == prefix_identity(A + B)
    assert child[0].parent == alone[1].parent == prefix_identity(A)


def test_a_salted_prefix_is_another_block_and_its_children_inherit_the_salt() -> None:
    """Blocks closing the same tokens under different cache salts (the first block's
    `extra_keys`) are different blocks; a child stored later keeps its root's salt."""
    canon = Canonicalizer()
    plain = canon.step([Stored(["p"], None, A, 4, [None])])
    salted = canon.step([Stored(["s"], None, A, 4, [["a"]])])
    other = canon.step([Stored(["o"], None, A, 4, [["b"]])])
    child = canon.step([Stored(["c"], "s", B, 4, [None])])
    assert plain[0].identity == prefix_identity(A)
    assert salted[0].identity == prefix_identity(A, "a") != plain[0].identity
    assert other[0].identity == prefix_identity(A, "b") != salted[0].identity
    assert (child[0].identity, child[0].parent) == (
        prefix_identity(A + B, "a"),
        prefix_identity(A, "a"),
    )
    assert canon.step([Removed("c")])[0].identity == prefix_identity(A + B, "a")


def test_an_adapters_blocks_are_other_blocks_and_its_name_is_no_salt() -> None:
    """A LoRA request's blocks carry the adapter's name first among their keys: the same
    tokens under another adapter (by id and name), or none, are other blocks, and only the
    key after the name is a salt."""
    canon = Canonicalizer()
    plain = canon.step([Stored(["p"], None, A, 4, [None])])
    sql = canon.step([Stored(["q"], None, A, 4, [["sql"]], 1, "sql")])
    salted = canon.step([Stored(["s"], None, A, 4, [["sql", "a"]], 1, "sql")])
    other = canon.step([Stored(["o"], None, A, 4, [["sql"]], 4, "sql")])
    child = canon.step([Stored(["c"], "s", B, 4, [["sql"]], 1, "sql")])
    assert plain[0].identity == prefix_identity(A)
    assert sql[0].identity == prefix_identity(A, None, "1:sql") != plain[0].identity
    assert salted[0].identity == prefix_identity(A, "a", "1:sql") != sql[0].identity
    assert other[0].identity == prefix_identity(A, None, "4:sql") != sql[0].identity
    assert (child[0].identity, child[0].parent) == (
        prefix_identity(A + B, "a", "1:sql"),
        prefix_identity(A, "a", "1:sql"),
    )


def test_blocks_never_stored_are_named_unknown() -> None:
    blocks = Canonicalizer().step([Removed("7"), Stored(["8"], "6", A, 4)])
    assert [(b.identity, b.parent) for b in blocks] == [
        ("unknown:7", None),
        (prefix_identity(A), "unknown:6"),
    ]


def test_the_table_and_its_markers(tmp_path: Path) -> None:
    verdict = compare(_trace(("1", "2")), _trace(("1", "2"), steps=6))
    markdown = table([verdict], lambda name: f"about {name}")
    assert (
        markdown.splitlines()[2] == "| `t` | about t | 4/6 | step 4: scheduled | 0 / 0 | 11 / 12 |"
    )
    doc = tmp_path / "parity.md"
    doc.write_text(f"# head\n{TABLE_BEGIN}\nold\n{TABLE_END}\ntail\n")
    write_table(str(doc), markdown)
    assert doc.read_text() == f"# head\n{TABLE_BEGIN}\n{markdown}{TABLE_END}\ntail\n"


def test_a_missing_vllm_venv_fails_saying_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(VllmVenvError, match=r"\.ci/vllm-venv"):
        vllm_python(str(tmp_path / "nothing" / "python"))


def test_a_broken_vllm_venv_fails_saying_how_to_make_it(tmp_path: Path) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'No module named vllm' >&2\nexit 1\n")
    broken.chmod(0o755)
    job = VllmJob(
        scenario=Scenario(
            name="x", config=Config(num_gpu_blocks=4, max_num_batched_tokens=8), requests=[]
        ),
        output_tokens={},
    )
    with pytest.raises(VllmVenvError, match=r"(?s)exited 1.*\.ci/vllm-venv.*No module named"):
        run_vllm([job], vllm_python(str(broken)))
