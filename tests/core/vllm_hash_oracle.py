"""Run under vLLM 0.33's interpreter: block hashes by vLLM's own functions, as JSON.

Importing `vllm` drags in torch and the whole engine, so this loads only the code that hashes:
`vllm/utils/hashing.py` as it is, and from `vllm/v1/core/kv_cache_utils.py` the source of
`resolve_none_hash_seed`, `init_none_hash`, `hash_block_tokens`, `maybe_convert_block_hash`,
the request block hasher and the extra keys of block hashes and KV events (cache salts, LoRA
adapters) with the constants they read, executed over stand-ins for `envs`, the logger and the
request. Stdin: a JSON list of cases `{algo, python_hash_seed, int_hashes, chains, parented,
salted}`; stdout: per case the NONE_HASH, each chain's hashes, each parented block's hash (hex)
and their event forms, and for each salted prompt (a salt, an adapter `[name, id, path]`, or
both) the request block hasher's hashes and the events' extra keys.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_WANTED = {
    "resolve_none_hash_seed",
    "init_none_hash",
    "hash_block_tokens",
    "maybe_convert_block_hash",
    "DEFAULT_NONE_HASH_SEED",
    "_NON_CRYPTO_HASH_FUNCTIONS",
    "_NONE_HASH_SEED",
    "get_request_block_hasher",
    "generate_block_hash_extra_keys",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "to_event_extra_keys",
}


def _target_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id} if node.value is not None else set()
    return set()


def load_vllm() -> dict[str, Any]:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vllm is not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    hashing_spec = importlib.util.spec_from_file_location(
        "vllm_hashing_only", root / "utils" / "hashing.py"
    )
    assert hashing_spec is not None and hashing_spec.loader is not None
    hashing = importlib.util.module_from_spec(hashing_spec)
    hashing_spec.loader.exec_module(hashing)
    source = (root / "v1" / "core" / "kv_cache_utils.py").read_text()
    tree = ast.parse(source)
    body = [node for node in tree.body if _target_names(node) & _WANTED]
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    module = ast.fix_missing_locations(ast.Module(body=[future, *body], type_ignores=[]))
    envs = SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
    namespace: dict[str, Any] = {
        "os": os,
        "envs": envs,
        "logger": SimpleNamespace(warning=lambda *a, **k: None),
        "BlockHash": bytes,
        "xxhash": hashing.xxhash,
        "xxhash_cbor": hashing.xxhash_cbor,
    }
    exec(compile(module, str(root / "v1" / "core" / "kv_cache_utils.py"), "exec"), namespace)
    namespace["get_hash_fn_by_name"] = hashing.get_hash_fn_by_name
    return namespace


def salted_prompt(
    vllm: dict[str, Any],
    hash_fn: Any,
    tokens: list[int],
    block_size: int,
    salt: str | None,
    lora: list[Any] | None = None,
) -> dict[str, Any]:
    """A salted (or LoRA) request's block hashes by vLLM's request block hasher, and the
    extra keys a `BlockStored` of all its blocks carries (`BlockPool.cache_full_blocks`'
    calls)."""
    lora_request = None
    if lora is not None:
        name, int_id, path = lora
        lora_request = SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=path)
    request = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=[],
        lora_request=lora_request,
        prompt_embeds=None,
        cache_salt=salt,
    )
    hashes = vllm["get_request_block_hasher"](block_size, hash_fn)(request)
    keys = [
        vllm["generate_block_hash_extra_keys"](request, i * block_size, (i + 1) * block_size, 0)[0]
        for i in range(len(hashes))
    ]
    events = vllm["to_event_extra_keys"](keys)
    return {
        "hashes": [h.hex() for h in hashes],
        "extra_keys": [None if k is None else list(k) for k in events],
    }


def main() -> None:
    vllm = load_vllm()
    envs = vllm["envs"]
    results = []
    for case in json.load(sys.stdin):
        if case["python_hash_seed"] is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = case["python_hash_seed"]
        envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = case["int_hashes"]
        hash_fn = vllm["get_hash_fn_by_name"](case["algo"])
        vllm["init_none_hash"](hash_fn)
        hash_block_tokens = vllm["hash_block_tokens"]
        convert = vllm["maybe_convert_block_hash"]

        chains = []
        for chain in case["chains"]:
            parent = None
            hashes = []
            for tokens in chain:
                parent = hash_block_tokens(hash_fn, parent, tokens)
                hashes.append(parent)
            events = [convert(h) for h in hashes]
            chains.append(
                {
                    "hashes": [h.hex() for h in hashes],
                    "events": [e.hex() if isinstance(e, bytes) else e for e in events],
                }
            )
        parented = [
            hash_block_tokens(hash_fn, bytes.fromhex(parent), tokens).hex()
            for parent, tokens in case["parented"]
        ]
        salted = [salted_prompt(vllm, hash_fn, **prompt) for prompt in case.get("salted", [])]
        results.append(
            {
                "none_hash": vllm["NONE_HASH"].hex(),
                "chains": chains,
                "parented": parented,
                "salted": salted,
            }
        )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
