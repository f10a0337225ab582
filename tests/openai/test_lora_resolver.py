"""vLLM 0.33's filesystem LoRA resolver (engined/openai/lora_resolver.py): a request naming an
adapter nobody loaded finds it in `VLLM_LORA_RESOLVER_CACHE_DIR` and is served with it, with
VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM's `_check_model` and its plugin do.

The rules are tested on `ServedModels` directly, then once end to end through the official
`openai` client against a real daemon with `--enable-lora`.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from engined.config import ConfigError, DaemonConfig
from engined.openai.api_errors import ApiError
from engined.openai.lora_resolver import CACHE_DIR_ENV, FilesystemResolver, filesystem_resolver
from engined.openai.served_models import NOT_ENABLED, ServedModels, check_startup
from tests.openai.api_harness import start_api

BASE = "org/base-model"
RUNTIME = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def adapter(cache: Path, name: str, config: object = None, *, raw: bytes | None = None) -> str:
    """An adapter directory under `cache` with `config` as its adapter_config.json."""
    path = cache / name
    path.mkdir(parents=True)
    if config is None:
        config = {"peft_type": "LORA", "base_model_name_or_path": BASE, "r": 8}
    (path / "adapter_config.json").write_bytes(
        raw if raw is not None else json.dumps(config).encode()
    )
    return str(path)


def models(cache: Path, *, enable_lora: bool = True, runtime: bool = True) -> ServedModels:
    return ServedModels(
        ["base"],
        BASE,
        4096,
        enable_lora=enable_lora,
        runtime_updating=runtime,
        resolver=FilesystemResolver(cache),
    )


def test_the_plugin_registers_as_vllms_does(tmp_path: Path) -> None:
    assert filesystem_resolver({}) is None
    assert filesystem_resolver({CACHE_DIR_ENV: str(tmp_path)}) == FilesystemResolver(tmp_path)
    # VLLM_PLUGINS loads only the plugins it names.
    both = {CACHE_DIR_ENV: str(tmp_path), "VLLM_PLUGINS": "other,lora_filesystem_resolver"}
    assert filesystem_resolver(both) == FilesystemResolver(tmp_path)
    assert filesystem_resolver({CACHE_DIR_ENV: str(tmp_path), "VLLM_PLUGINS": "other"}) is None
    missing = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="VLLM_LORA_RESOLVER_CACHE_DIR must be set to a valid"):
        filesystem_resolver({CACHE_DIR_ENV: missing})


def test_a_lora_adapter_of_the_base_model_is_found(tmp_path: Path) -> None:
    resolver = FilesystemResolver(tmp_path)
    sql = adapter(tmp_path, "sql")
    adapter(tmp_path, "other-base", {"peft_type": "LORA", "base_model_name_or_path": "x"})
    adapter(tmp_path, "ia3", {"peft_type": "IA3", "base_model_name_or_path": BASE})
    (tmp_path / "no-config").mkdir()
    assert resolver.resolve(BASE, "sql") == sql
    # Hostile names find nothing and raise nothing: a NUL, 100,000 characters, a surrogate.
    for name in ("other-base", "ia3", "no-config", "absent", "a\x00b", "x" * 100_000, "\udcff"):
        assert resolver.resolve(BASE, name) is None, name
    # Nothing outside the directory, though vLLM's os.path.join would reach it.
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    adapter(outside, "evil")
    assert resolver.resolve(BASE, f"../{outside.name}/evil") is None
    assert resolver.resolve(BASE, str(outside / "evil")) is None


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"{", "is not JSON"),
        (b"[1]", "is not a JSON object"),
        (b'{"peft_type": "LORA"}', "has no 'base_model_name_or_path'"),
        (b'{"base_model_name_or_path": "x"}', "has no 'peft_type'"),
        (b"[" * 100_000 + b"]" * 100_000, "is not JSON"),
        (b" " * (1 << 20) + b"{}", "is over 1048576 bytes"),
    ],
)
def test_a_malformed_adapter_config_is_a_500(tmp_path: Path, raw: bytes, problem: str) -> None:
    adapter(tmp_path, "bad", raw=raw)
    with pytest.raises(ApiError) as refused:
        FilesystemResolver(tmp_path).resolve(BASE, "bad")
    assert (refused.value.status, refused.value.message) == (
        500,
        f"LoRA adapter 'bad': its adapter_config.json {problem}",
    )


def test_a_resolved_adapter_is_loaded_and_numbered_as_vllm(tmp_path: Path) -> None:
    """vLLM's resolve_lora takes a number from the adapter counter before it asks the
    resolver, found or not; a found adapter keeps it and is then a loaded one."""
    sql = adapter(tmp_path, "sql")
    served = models(tmp_path)
    with pytest.raises(ApiError) as missing:
        served.check("ghost")
    assert missing.value.status == 404
    found = served.check("sql")
    assert found.name == "sql" and found.lora is not None
    assert (found.lora.lora_int_id, found.lora.lora_path) == (2, sql)
    assert served.check("sql") == found
    assert [a.lora_int_id for a in served.adapters()] == [2]
    served.load("chat", "/adapters/chat")
    assert [a.lora_int_id for a in served.adapters()] == [2, 3]
    assert [c.id for c in served.cards().data] == ["base", "sql", "chat"]
    assert served.cards().data[1].parent == "base"


def test_without_runtime_updating_the_resolver_is_not_asked(tmp_path: Path) -> None:
    adapter(tmp_path, "sql")
    with pytest.raises(ApiError) as refused:
        models(tmp_path, runtime=False).check("sql")
    assert refused.value.status == 404


def test_a_found_adapter_that_cannot_load_is_vllms_400(tmp_path: Path) -> None:
    adapter(tmp_path, "sql")
    served = models(tmp_path, enable_lora=False)
    with pytest.raises(ApiError) as refused:
        served.check("sql")
    assert (refused.value.status, refused.value.type, refused.value.message) == (
        400,
        "BadRequestError",
        "LoRA adapter 'sql' was found but could not be loaded.",
    )
    assert served.adapters() == []
    assert NOT_ENABLED.startswith("Call to add_lora method failed")


def test_serve_refuses_a_cache_dir_that_is_none(tmp_path: Path) -> None:
    env = {CACHE_DIR_ENV: str(tmp_path / "missing")}
    with pytest.raises(ConfigError, match=CACHE_DIR_ENV):
        check_startup(DaemonConfig(api_port=8000), env)
    check_startup(DaemonConfig(api_port=None), env)


def test_a_request_is_served_with_the_adapter_it_names(tmp_path: Path) -> None:
    cache = tmp_path / "loras"
    sql = adapter(cache, "sql", {"peft_type": "LORA", "base_model_name_or_path": "builtin"})
    env = {RUNTIME: "1", CACHE_DIR_ENV: str(cache)}
    flags = ("--speedup-ratio", "0", "--enable-lora", "--max-loras", "2")
    (tmp_path / "daemon").mkdir()
    with (
        start_api(tmp_path / "daemon", *flags, env=env) as api,
        openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client,
    ):
        reply = client.completions.create(model="sql", prompt=[1, 2, 3], max_tokens=3)
        assert reply.model == "sql"
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        cards = {c.id: (c.model_extra or {}).get("root") for c in client.models.list().data}
        assert cards == {"engined": "builtin", "sql": sql}
        for name in ("ghost", "../loras/sql"):
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=1)
