"""The vLLM parity run shared by tests/parity: every scenario once, one vLLM process.

The vLLM venv comes from `.ci/vllm-venv`; `PARITY_VLLM_PYTHON` names its interpreter
(default `.venv-vllm/bin/python` of this checkout). Without a working one these tests fail
with how to make it: parity that cannot be checked is not parity.
"""

from __future__ import annotations

import pytest

from parity.compare import Verdict
from parity.runner import VllmVenvError, run_scenarios, vllm_python
from parity.scenarios import all_scenarios


@pytest.fixture(scope="session")
def verdicts() -> dict[str, Verdict]:
    try:
        python = vllm_python()
        results = run_scenarios(all_scenarios(), python)
    except VllmVenvError as error:
        pytest.fail(str(error), pytrace=False)
    return {verdict.scenario: verdict for verdict in results}
