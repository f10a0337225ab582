"""Parity with vLLM 0.33, step by step, exactly as docs/parity.md records it.

Each scenario's equal steps and total must match the committed table, so any change in
parity, better or worse, fails until `python -m parity --write-table docs/parity.md`
regenerates the table in the same commit.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parity.compare import Verdict, report
from parity.scenarios import all_scenarios

TABLE = Path(__file__).resolve().parents[2] / "docs" / "parity.md"
_ROW = re.compile(r"^\| `(?P<name>[^`]+)` \|[^|]*\| (?P<equal>\d+)/(?P<total>\d+) \|", re.M)
REGENERATE = "regenerate it: python -m parity --write-table docs/parity.md"


def recorded() -> dict[str, tuple[int, int]]:
    return {m["name"]: (int(m["equal"]), int(m["total"])) for m in _ROW.finditer(TABLE.read_text())}


def test_the_table_lists_every_scenario_once() -> None:
    names = [m["name"] for m in _ROW.finditer(TABLE.read_text())]
    assert names == [s.name for s in all_scenarios()], REGENERATE


@pytest.mark.parametrize("name", [s.name for s in all_scenarios()])
def test_steps_equal_to_vllm_as_recorded(name: str, verdicts: dict[str, Verdict]) -> None:
    verdict = verdicts[name]
    assert not verdict.errors, "\n".join(verdict.errors)
    detail = "\n".join(report(verdict))
    assert (verdict.equal, verdict.total) == recorded()[name], f"{detail}\n{REGENERATE}"
