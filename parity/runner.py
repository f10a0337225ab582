"""Running both sides: engined in this process, vLLM in its venv's interpreter, once.

The vLLM venv is made by `.ci/vllm-venv`. Its interpreter is `--vllm-python`, else
`PARITY_VLLM_PYTHON`, else `.venv-vllm/bin/python` of this checkout; a missing or broken one
raises `VllmVenvError` saying how to make it (the tests fail on it, never skip).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import msgspec

from parity import engined_side
from parity.compare import Verdict, compare
from parity.scenario import Scenario, VllmJob
from parity.trace import Trace

ROOT = Path(__file__).resolve().parent.parent
# One vLLM process for every scenario: its import alone takes 15-100 s.
VLLM_TIMEOUT_S = 1800.0
HOW_TO = "make it with `.ci/vllm-venv` (docs/parity.md), or point PARITY_VLLM_PYTHON at one"


class VllmVenvError(RuntimeError):
    """The vLLM venv is missing or does not run the scheduler."""


def vllm_python(explicit: str | None = None) -> Path:
    chosen = explicit or os.environ.get("PARITY_VLLM_PYTHON")
    path = Path(chosen) if chosen else ROOT / ".venv-vllm" / "bin" / "python"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise VllmVenvError(f"no vLLM venv interpreter at {path}: {HOW_TO}")
    return path


def run_vllm(jobs: list[VllmJob], python: Path) -> list[Trace]:
    """The vLLM traces of `jobs`, from one `python -m parity.vllm_side` process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu")
    try:
        done = subprocess.run(
            [str(python), "-m", "parity.vllm_side"],
            input=msgspec.msgpack.encode(jobs),
            capture_output=True,
            env=env,
            cwd=ROOT,
            timeout=VLLM_TIMEOUT_S,
            check=False,
        )
    except OSError as error:
        raise VllmVenvError(f"cannot run {python} ({error}): {HOW_TO}") from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-15:]
        raise VllmVenvError(
            f"{python} -m parity.vllm_side exited {done.returncode}: {HOW_TO}\n" + "\n".join(tail)
        )
    traces = msgspec.msgpack.decode(done.stdout, type=list[Trace])
    if len(traces) != len(jobs):
        raise VllmVenvError(f"vLLM side returned {len(traces)} traces for {len(jobs)} scenarios")
    return traces


def run_scenarios(
    scenarios: list[Scenario], python: Path, *, raw_hashes: bool = True
) -> list[Verdict]:
    """engined first (its tokens feed vLLM), then every scenario through vLLM, compared."""
    engined = [engined_side.run(scenario) for scenario in scenarios]
    jobs = [
        VllmJob(scenario=scenario, output_tokens=trace.output_tokens, bursts=trace.bursts)
        for scenario, trace in zip(scenarios, engined, strict=True)
    ]
    vllm = run_vllm(jobs, python)
    return [compare(e, v, raw_hashes=raw_hashes) for e, v in zip(engined, vllm, strict=True)]
