"""A real benchmark client, `vllm bench serve`, against `engined serve` (issue 22, Acceptance 1).

vLLM 0.33's own benchmark runs from the parity harness's venv (`.ci/vllm-venv`, named by
`PARITY_VLLM_PYTHON` as tests/parity find it; without it the test fails saying how to make
it). It sends a short random profile through both OpenAI endpoints, counting tokens with the
embedded model's tokenizer, and its saved detailed result must show every request served
with exactly the output length asked for (`--ignore-eos`). About 25 s: most of it is vLLM's
import time.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import engined.openai
from parity.runner import VllmVenvError, vllm_python
from tests.openai.api_harness import ApiDaemon, start_api

PROMPTS = 64
INPUT_LEN = 64
OUTPUT_LEN = 32
BENCH_TIMEOUT_S = 300
DEFAULT_MODEL = Path(engined.openai.__file__).parent / "default_model"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    tmp = tmp_path_factory.mktemp("bench")
    with start_api(tmp, "--speedup-ratio", "0", "--block-size", "16") as daemon:
        yield daemon


def bench(api: ApiDaemon, backend: str, endpoint: str, out: Path) -> dict[str, object]:
    try:
        python = vllm_python()
    except VllmVenvError as error:
        pytest.fail(str(error), pytrace=False)
    command = [
        str(python.parent / "vllm"),
        "bench",
        "serve",
        f"--backend={backend}",
        f"--base-url=http://127.0.0.1:{api.port}",
        f"--endpoint={endpoint}",
        "--model=engined",
        f"--tokenizer={DEFAULT_MODEL}",
        "--dataset-name=random",
        f"--random-input-len={INPUT_LEN}",
        f"--random-output-len={OUTPUT_LEN}",
        f"--num-prompts={PROMPTS}",
        "--ignore-eos",
        "--seed=0",
        "--save-result",
        "--save-detailed",
        f"--result-dir={out}",
        "--result-filename=result.json",
        "--disable-tqdm",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"vllm bench serve failed:\n{done.stdout}\n{done.stderr}"
    result: dict[str, object] = json.loads((out / "result.json").read_text())
    return result


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve(api: ApiDaemon, backend: str, endpoint: str, tmp_path: Path) -> None:
    result = bench(api, backend, endpoint, tmp_path)
    assert (result["completed"], result["failed"]) == (PROMPTS, 0)
    assert result["errors"] == [""] * PROMPTS
    assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
