"""engined's vLLM block hashes equal vLLM 0.33's own, for every algorithm.

The oracle (`vllm_hash_oracle.py`) runs vLLM's hashing code under the vLLM venv's interpreter
(`PARITY_VLLM_PYTHON`, default `/work/main/.venv-vllm/bin/python`; missing, the test fails)
over random token blocks, chains and parents, and salted and LoRA prompts through vLLM's own
request block hasher (an engine's Stored events must carry those hashes and vLLM's extra
keys); exact vectors of the default algorithm are pinned here too, so they hold without the
venv.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engined.core.args import EngineArgs
from engined.core.engine import Engine
from engined.core.types import BlockStored, LoraRequest, Request, Submit
from engined.core.vllm_hashing import (
    DEFAULT_HASH_ALGO,
    BlockHasher,
    HashAlgo,
    cbor_canonical,
    event_block_hash,
    none_hash,
)

VLLM_PYTHON = os.environ.get("PARITY_VLLM_PYTHON", "/work/main/.venv-vllm/bin/python")
ORACLE = Path(__file__).with_name("vllm_hash_oracle.py")


def random_cases() -> list[dict[str, Any]]:
    rng = random.Random(2026)
    cases = []
    for algo in HashAlgo:
        seeds: list[str | None] = ["0", "12345"]
        if algo in (HashAlgo.SHA256, HashAlgo.SHA256_CBOR):
            seeds.append(None)
        for seed in seeds:
            for int_hashes in (True, False):
                chains = [
                    [[rng.randrange(2**32) for _ in range(size)] for _ in range(4)]
                    for size in (16, 32, 1)
                ]
                parented = [
                    (rng.randbytes(rng.choice((16, 32))).hex(), [rng.randrange(2**32)] * 16)
                    for _ in range(4)
                ]
                salted = [
                    {
                        "tokens": [rng.randrange(2**32) for _ in range(3 * size)],
                        "block_size": size,
                        "salt": salt,
                        "lora": lora,
                    }
                    for size, salt, lora in (
                        (16, "tenant-a", None),
                        (4, "ü" * 40, None),
                        (16, None, ["sql-adapter", 3, "/adapters/sql"]),
                        (4, "tenant-b", ["ä" * 30, 12, "/adapters/ä"]),
                    )
                ]
                cases.append(
                    {
                        "algo": algo.value,
                        "python_hash_seed": seed,
                        "int_hashes": int_hashes,
                        "chains": chains,
                        "parented": parented,
                        "salted": salted,
                    }
                )
    return cases


def test_every_algorithm_matches_vllm() -> None:
    assert Path(VLLM_PYTHON).exists(), (
        f"vLLM's interpreter {VLLM_PYTHON} is missing: install the vLLM venv or set "
        "PARITY_VLLM_PYTHON"
    )
    cases = random_cases()
    done = subprocess.run(
        [VLLM_PYTHON, str(ORACLE)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout)
    assert len(expected) == len(cases) == 20
    for case, want in zip(cases, expected, strict=True):
        algo = HashAlgo(case["algo"])
        root = none_hash(algo, case["python_hash_seed"])
        assert root.hex() == want["none_hash"], case["algo"]
        hasher = BlockHasher(algo, root)
        for chain, want_chain in zip(case["chains"], want["chains"], strict=True):
            parent: bytes | None = None
            hashes = []
            for tokens in chain:
                parent = hasher.block_hash(parent, tokens)
                hashes.append(parent)
            assert [h.hex() for h in hashes] == want_chain["hashes"]
            events = [event_block_hash(h, int_hashes=case["int_hashes"]) for h in hashes]
            assert [e.hex() if isinstance(e, bytes) else e for e in events] == want_chain["events"]
        assert [
            hasher.block_hash(bytes.fromhex(parent_hex), tokens).hex()
            for parent_hex, tokens in case["parented"]
        ] == want["parented"]
        for prompt, want_salted in zip(case["salted"], want["salted"], strict=True):
            assert len(want_salted["hashes"]) == 3
            assert want_salted["extra_keys"] == expected_extra_keys(prompt)
            stored = salted_stored(algo, case["python_hash_seed"], prompt)
            assert stored.block_hashes == [int(h[-16:], 16) for h in want_salted["hashes"]]
            assert [None if k is None else list(k) for k in stored.extra_keys or []] == (
                want_salted["extra_keys"]
            )
            lora = prompt["lora"]
            assert (stored.lora_id, stored.lora_name) == (
                (None, None) if lora is None else (lora[1], lora[0])
            )


def expected_extra_keys(prompt: Any) -> list[list[str] | None]:
    """The events' untagged keys of three blocks: the adapter's name on each, the salt after
    it on the first."""
    salt, lora = prompt["salt"], prompt["lora"]
    names = [] if lora is None else [lora[0]]
    first = names + ([] if salt is None else [salt])
    return [first or None, names or None, names or None]


def salted_stored(algo: HashAlgo, python_hash_seed: str | None, prompt: Any) -> BlockStored:
    """The one Stored of a salted or LoRA prompt of three whole blocks run through an engine."""
    size = prompt["block_size"]
    args = EngineArgs(
        block_size=size,
        num_gpu_blocks=16,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        prefix_caching_hash_algo=algo,
        enable_lora=True,
    )
    core = Engine(args, python_hash_seed=python_hash_seed)
    lora = prompt["lora"]
    request = Request(
        token_ids=prompt["tokens"],
        max_tokens=1,
        request_id="salted",
        cache_salt=prompt["salt"],
        lora_request=None if lora is None else LoraRequest(*lora),
    )
    core.apply(Submit(request), now_ms=0.0)
    (stored,) = core.execute_pass(0.0).kv_events
    assert isinstance(stored, BlockStored)
    return stored


# --- pinned vectors of the default (no vLLM needed) -------------------------------------------

SHA256_NONE_HASH = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
SHA256_FIRST = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
SHA256_SECOND = "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629"


def test_default_algorithm_is_vllms() -> None:
    assert DEFAULT_HASH_ALGO is HashAlgo.SHA256
    assert [a.value for a in HashAlgo] == ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def test_sha256_vectors_are_pinned() -> None:
    """Unset PYTHONHASHSEED: the fixed "vllm-none-hash" seed; blocks 0..15 then 16..31."""
    root = none_hash(HashAlgo.SHA256, None)
    assert root.hex() == SHA256_NONE_HASH
    hasher = BlockHasher(HashAlgo.SHA256, root)
    first = hasher.block_hash(None, range(16))
    second = hasher.block_hash(first, range(16, 32))
    assert (first.hex(), second.hex()) == (SHA256_FIRST, SHA256_SECOND)
    assert event_block_hash(first) == int(SHA256_FIRST[-16:], 16)
    assert event_block_hash(first, int_hashes=False) == first


def test_unseeded_xxhash_none_hash_is_random_per_call_as_per_process_in_vllm() -> None:
    first, second = none_hash(HashAlgo.XXHASH, None), none_hash(HashAlgo.XXHASH, None)
    assert len(first) == len(second) == 16
    assert first != second
    assert none_hash(HashAlgo.XXHASH, "7") == none_hash(HashAlgo.XXHASH, "7")


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (None, "f6"),
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (2**32 - 1, "1affffffff"),
        (2**64, "c249010000000000000000"),
        (-1, "20"),
        (b"\x01\x02", "420102"),
        ("a", "6161"),
        ((1, (2, 3)), "8201820203"),
    ],
)
def test_cbor_is_rfc8949_canonical(value: Any, encoded: str) -> None:
    assert cbor_canonical(value).hex() == encoded
