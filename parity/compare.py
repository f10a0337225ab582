"""Step-by-step comparison of two traces, the verdicts, and the parity table.

A step is equal when every field is: the scheduled requests with their computed and new
tokens, the admissions with their prefix hits, the `cached_tokens` reported, the preemption
victims, the finished requests (all in order), the running and waiting counts, and the KV
events by canonical block identity (`parity.trace.canonical_events`), or by raw hash too
with `raw_hashes`. Steps one side never reached count as unequal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from parity.trace import CanonicalBlock, Step, Trace, canonical_events

FIELDS: tuple[str, ...] = (
    "scheduled",
    "admitted",
    "cached",
    "preempted",
    "finished",
    "stopped",
    "running",
    "waiting",
    "events",
)


class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    field: str
    engined: Any
    vllm: Any
    # A few lines on both sides' steps up to the divergence.
    context: list[str] = []


class Totals(msgspec.Struct, frozen=True, array_like=True):
    """One side's whole run: preemptions and tokens scheduled (wasted recompute shows here)."""

    preemptions: int
    tokens: int


def totals(trace: Trace) -> Totals:
    return Totals(
        sum(len(step.preempted) for step in trace.steps),
        sum(share.new for step in trace.steps for share in step.scheduled),
    )


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    scenario: str
    equal: int
    total: int
    first: Divergence | None = None
    errors: list[str] = []
    engined: Totals = Totals(0, 0)
    vllm: Totals = Totals(0, 0)

    def line(self) -> str:
        return f"{self.scenario}: {self.equal}/{self.total} steps equal"


def _raw_events(step: Step) -> list[Any]:
    return [msgspec.to_builtins(event) for event in step.events]


def _field_values(
    step: Step | None, canonical: list[CanonicalBlock] | None, raw_hashes: bool
) -> dict[str, Any]:
    if step is None:
        return {"missing": "no such step"}
    values: dict[str, Any] = {name: msgspec.to_builtins(getattr(step, name)) for name in FIELDS}
    values["events"] = msgspec.to_builtins(canonical or [])
    if raw_hashes:
        values["raw events"] = _raw_events(step)
    return values


def _summary(side: str, step: Step | None) -> str:
    if step is None:
        return f"  {side:8} (no step)"
    shares = " ".join(f"{s.request_id}:{s.computed}+{s.new}" for s in step.scheduled)
    kinds = "".join(type(e).__name__[0] for e in step.events)
    return (
        f"  {side:8} sched[{shares}] adm{[a.request_id for a in step.admitted]} "
        f"pre{step.preempted} fin{step.finished} run={step.running} wait={step.waiting} "
        f"ev={kinds or '-'}"
    )


def _context(engined: Trace, vllm: Trace, at: int, lines: int = 3) -> list[str]:
    out: list[str] = []
    for index in range(max(0, at - lines + 1), at + 1):
        out.append(f"step {index}:")
        for side, trace in (("engined", engined), ("vllm", vllm)):
            out.append(_summary(side, trace.steps[index] if index < len(trace.steps) else None))
    return out


def compare(engined: Trace, vllm: Trace, *, raw_hashes: bool = False) -> Verdict:
    """How many steps of the two traces are equal, and the first that is not."""
    canon_e = canonical_events(engined)
    canon_v = canonical_events(vllm)
    total = max(len(engined.steps), len(vllm.steps))
    equal = 0
    first: Divergence | None = None
    for index in range(total):
        step_e = engined.steps[index] if index < len(engined.steps) else None
        step_v = vllm.steps[index] if index < len(vllm.steps) else None
        values_e = _field_values(step_e, canon_e[index] if step_e is not None else None, raw_hashes)
        values_v = _field_values(step_v, canon_v[index] if step_v is not None else None, raw_hashes)
        if values_e == values_v:
            equal += 1
            continue
        if first is None:
            names = list(values_e) if step_e is not None else list(values_v)
            field = next(
                (n for n in names if values_e.get(n) != values_v.get(n)),
                "missing",
            )
            first = Divergence(
                step=index,
                field=field,
                engined=values_e.get(field, values_e.get("missing")),
                vllm=values_v.get(field, values_v.get("missing")),
                context=_context(engined, vllm, index),
            )
    errors = [f"{side}: {t.error}" for side, t in (("engined", engined), ("vllm", vllm)) if t.error]
    return Verdict(
        scenario=engined.scenario,
        equal=equal,
        total=total,
        first=first,
        errors=errors,
        engined=totals(engined),
        vllm=totals(vllm),
    )


def _short(value: Any, limit: int = 600) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def report(verdict: Verdict) -> list[str]:
    """The verdict line, then the first divergence in detail (and any side's error)."""
    e, v = verdict.engined, verdict.vllm
    lines = [
        f"{verdict.line()} (preemptions {e.preemptions} vs vLLM {v.preemptions}, "
        f"tokens scheduled {e.tokens} vs {v.tokens})"
    ]
    for error in verdict.errors:
        lines.append(f"  ERROR {error.strip().splitlines()[-1]}")
    first = verdict.first
    if first is not None:
        lines.append(f"  first divergence: step {first.step}, field {first.field}")
        lines.append(f"    engined: {_short(first.engined)}")
        lines.append(f"    vllm:    {_short(first.vllm)}")
        lines.extend("    " + line for line in first.context)
    return lines


def table(verdicts: list[Verdict], describe: Callable[[str], str]) -> str:
    """The parity table (markdown): scenario, what it runs, steps equal, first divergence,
    and both sides' preemptions and tokens scheduled (engined / vLLM)."""
    rows = [
        "| scenario | what it runs | steps equal to vLLM | first divergence "
        "| preemptions | tokens scheduled |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        first = f"step {v.first.step}: {v.first.field}" if v.first is not None else "none"
        rows.append(
            f"| `{v.scenario}` | {describe(v.scenario)} | {v.equal}/{v.total} | {first} "
            f"| {v.engined.preemptions} / {v.vllm.preemptions} "
            f"| {v.engined.tokens} / {v.vllm.tokens} |"
        )
    equal = sum(v.equal for v in verdicts)
    total = sum(v.total for v in verdicts)
    rows.append(f"| **all** | | **{equal}/{total}** | | | |")
    return "\n".join(rows) + "\n"
