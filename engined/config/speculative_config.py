"""vLLM's `--speculative-config` JSON (and its `--spec-method`, `--spec-model` and
`--spec-tokens` shorthands), read onto engined's MTP keys.

A `vllm serve` line with speculative decoding changes what the scheduler does (drafts,
lookahead slots, padded admissions) and what KV events say (lookahead block hashes), so
ignoring the flag, as engined did, gave a stream no vLLM would publish. The methods vLLM
0.33 schedules alike are modelled: `mtp` (and the model-specific names it folds into it,
`deepseek_mtp` ...), `eagle`, `eagle3` and `draft_model`: each drafts
`num_speculative_tokens` a step with that many lookahead slots, which is
`engine.aic_nextn` (`--nextn`). The first three hash blocks with the token after them
(lookahead block hashes); `draft_model`, and the others with both
`disable_lookahead_block_hashes` and `disable_eagle_block_drop`, hash them plainly
(`engine.lookahead_block_hashes = false`), and a draft model takes one more input slot per
scheduled request (`engine.drafting_slots = 1`). With `disable_lookahead_block_hashes` alone
vLLM hashes plainly and drops a prefix hit's last block (`engine.eagle_block_drop`). No
draft `model` is ever loaded. vLLM's synthetic
rejection sampling is what engined draws from: `synthetic_acceptance_rates` (unconditional
per position) or `synthetic_acceptance_length` become `engine.aic_nextn_accept_rates`
(conditional, as vLLM's sampler converts them); with any other `rejection_sample_method` the
acceptance is a model's, and engined's `--nextn-accept-rates` (or its default) stands in.

Methods whose scheduling differs (`ngram`, `suffix`, `dflash`, `dspark`, ...) are not
modelled: the flag is then ignored with a warning, as before, so a manifest still starts.
Settings that would make engined's stream differ from vLLM's without a warning are refused:
`num_speculative_tokens_per_batch_size` (dynamic speculative decoding) and more drafts than
engined models.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import msgspec

from engined.config.schema import ConfigError
from engined.core.args_rules import MAX_NEXTN

FLAG = "--speculative-config"
NEXTN = "engine.aic_nextn"
RATES = "engine.aic_nextn_accept_rates"
HASHES = "engine.lookahead_block_hashes"
SLOTS = "engine.drafting_slots"
DROP = "engine.eagle_block_drop"

# vLLM 0.33's MTPModelTypes: the per-model names it replaces with "mtp".
_MTP_NAMES = frozenset(
    (
        "mtp",
        "deepseek_mtp",
        "dots3_note_mtp",
        "mimo_mtp",
        "mimo_v2_mtp",
        "glm4_moe_mtp",
        "glm4_moe_lite_mtp",
        "glm_ocr_mtp",
        "ernie_mtp",
        "nemotron_h_mtp",
        "exaone_moe_mtp",
        "exaone4_5_mtp",
        "qwen3_next_mtp",
        "qwen4_exp_mtp",
        "qwen3_5_mtp",
        "longcat_flash_mtp",
        "bailing_hybrid_v3_mtp",
        "minimax_m3_mtp",
        "bailing_hybrid_mtp",
        "kimi_k3_mtp",
        "pangu_ultra_moe_mtp",
        "step3p5_mtp",
        "step5_mtp",
        "hy_v3_mtp",
        "hy_v4_mtp",
        "gemma4_mtp",
        "inkling_mtp",
        "glm5_next_mtp",
    )
)
# vLLM 0.33 hashes blocks with the token after them for these (lookahead block hashes).
_EAGLE_LIKE = _MTP_NAMES | {"eagle", "eagle3"}
# And schedules these alike, plain hashes apart.
_MODELLED = _EAGLE_LIKE | {"draft_model"}


class _VllmSpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM 0.33's SpeculativeConfig fields a user sets (it refuses any other, as here).
    Those engined reads are typed; the rest shape a draft model or kernels, and are only
    accepted."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: list[float] | None = None
    synthetic_acceptance_length: float | None = None
    disable_lookahead_block_hashes: bool = False
    disable_eagle_block_drop: bool = False
    num_speculative_tokens_per_batch_size: Any = None
    enforce_eager: Any = None
    draft_tensor_parallel_size: Any = None
    tensor_parallel_size: Any = None
    quantization: Any = None
    moe_backend: Any = None
    attention_backend: Any = None
    kv_cache_dtype: Any = None
    max_model_len: Any = None
    revision: Any = None
    code_revision: Any = None
    index_share_for_mtp_iteration: Any = None
    disable_padded_drafter_batch: Any = None
    draft_lm_head_quantization: Any = None
    use_local_argmax_reduction: Any = None
    use_heterogeneous_vocab: Any = None
    prompt_lookup_max: Any = None
    prompt_lookup_min: Any = None
    parallel_drafting: Any = None
    suffix_decoding_max_tree_depth: Any = None
    suffix_decoding_max_cached_requests: Any = None
    suffix_decoding_max_spec_factor: Any = None
    suffix_decoding_min_token_prob: Any = None
    draft_sample_method: Any = None
    enable_adaptive_verification: Any = None
    dspark_draft_topk: Any = None
    xpress_topc: Any = None
    fly_window_size: Any = None
    fly_entropy_threshold: Any = None
    fly_entropy_top_k: Any = None


def speculative_flags(
    text: str | None,
    *,
    method: str | None = None,
    model: str | None = None,
    tokens: int | None = None,
    given: Mapping[str, Any],
) -> tuple[dict[str, Any], list[str]]:
    """The config keys `--speculative-config TEXT` and the `--spec-*` shorthands set, by
    dotted key, and the warnings to print (a method engined does not model).

    Raises:
        ConfigError: not vLLM's JSON, a shorthand beside the same field in the JSON, a
            setting engined cannot honour, or a key also given by its own flag.
    """
    fields = _decode(text)
    for flag, key, value in (
        ("--spec-method", "method", method),
        ("--spec-model", "model", model),
        ("--spec-tokens", "num_speculative_tokens", tokens),
    ):
        if value is None:
            continue
        if key in fields:
            raise ConfigError(
                f"{flag} and {FLAG}['{key}'] are mutually exclusive", key=_key_of(key)
            )
        fields[key] = value
    try:
        config = msgspec.convert(fields, type=_VllmSpeculativeConfig)
    except msgspec.ValidationError as error:
        raise ConfigError(f"{FLAG}: {error}", key=NEXTN) from None
    method = _method(config.method, config.model)
    if method not in _MODELLED:
        what = method or ("a draft model" if config.model else "no method")
        return {}, [
            f"engined serve: ignoring {FLAG}: speculative decoding with {what} is not "
            "modelled (only mtp, eagle, eagle3 and draft_model are); running without it"
        ]
    keys = _keys(config, method)
    both = sorted(key for key in keys if key in given)
    if both:
        raise ConfigError(
            f"{FLAG}: also given by flag as {', '.join(both)}; set each once", key=both[0]
        )
    return keys, []


def _decode(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        fields = msgspec.json.decode(text.encode())
    except msgspec.DecodeError as error:
        raise ConfigError(f"{FLAG}: {error}", key=NEXTN) from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{FLAG}: expected a JSON object, got {text!r}", key=NEXTN)
    return fields


def _key_of(field: str) -> str:
    return NEXTN if field in ("method", "num_speculative_tokens") else "model"


def _method(method: str | None, model: str | None) -> str | None:
    """The method vLLM 0.33 settles on before reading a draft model's config: none given
    is `ngram`, a custom proposer (a dotted import path) or `draft_model`; a per-model MTP
    name is `mtp`; a draft model named like an EAGLE, DFlash or DSpark head is that."""
    if method is None:
        if model is None:
            return None
        if model in ("ngram", "[ngram]"):
            return "ngram"
        parts = model.split(".")
        if "/" not in model and len(parts) >= 2 and all(p.isidentifier() for p in parts):
            return "custom_class"
        method = "draft_model"
    if method in _MTP_NAMES:
        return "mtp"
    if method == "draft_model" and model is not None:
        name = model.lower()
        for marker, named in (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash")):
            if marker in name:
                return named
        if "dspark" in name:
            return "dspark"
    return method


def _keys(config: _VllmSpeculativeConfig, method: str) -> dict[str, Any]:
    prefix = f"{FLAG}: "
    plain_hashes = method == "draft_model"
    # vLLM's trailing-block drop: its EAGLE-like methods without lookahead hashes.
    block_drop = False
    if method in _EAGLE_LIKE and config.disable_lookahead_block_hashes:
        plain_hashes = True
        block_drop = not config.disable_eagle_block_drop
    if config.num_speculative_tokens_per_batch_size is not None:
        raise ConfigError(
            prefix + "num_speculative_tokens_per_batch_size (dynamic speculative decoding) "
            "is not modelled",
            key=NEXTN,
        )
    # vLLM takes an MTP model's own number of MTP layers when none is given: one, for
    # every model engined's single-module MTP stands in for.
    nextn = 1 if config.num_speculative_tokens is None else config.num_speculative_tokens
    if not 1 <= nextn <= MAX_NEXTN:
        raise ConfigError(
            prefix + f"num_speculative_tokens must be in [1, {MAX_NEXTN}] (engined's "
            f"--nextn), got {nextn}",
            key=NEXTN,
        )
    keys: dict[str, Any] = {NEXTN: nextn}
    if plain_hashes:
        keys[HASHES] = False
    if block_drop:
        keys[DROP] = True
    if method == "draft_model":
        # vLLM's `max_num_new_slots_for_drafting`: the draft model's input keeps one token.
        keys[SLOTS] = 1
    rates = _synthetic_rates(config, nextn)
    if rates is not None:
        keys[RATES] = ",".join(repr(rate) for rate in _conditional(rates))
    return keys


def _synthetic_rates(config: _VllmSpeculativeConfig, n: int) -> list[float] | None:
    """vLLM's per-position unconditional rates, checked with vLLM's own messages."""
    rates, length = config.synthetic_acceptance_rates, config.synthetic_acceptance_length
    if config.rejection_sample_method != "synthetic":
        if rates is not None or length is not None:
            raise ConfigError(
                f"{FLAG}: synthetic_acceptance_rates / synthetic_acceptance_length are only "
                "valid with rejection_sample_method='synthetic'.",
                key=RATES,
            )
        return None
    if (rates is None) == (length is None):
        raise ConfigError(
            f"{FLAG}: rejection_sample_method='synthetic' requires exactly one of "
            "synthetic_acceptance_rates or synthetic_acceptance_length.",
            key=RATES,
        )
    if rates is not None:
        if len(rates) != n:
            problem = f"must have length {n}, got {rates}."
        elif not all(0.0 <= rate <= 1.0 for rate in rates):
            problem = f"entries must be in [0, 1], got {rates}."
        elif any(later > earlier for earlier, later in itertools.pairwise(rates)):
            problem = f"must be non-increasing, got {rates}."
        else:
            return list(rates)
        raise ConfigError(f"{FLAG}: synthetic_acceptance_rates {problem}", key=RATES)
    assert length is not None
    if not 1.0 <= length <= n + 1:
        raise ConfigError(
            f"{FLAG}: synthetic_acceptance_length must be in [1, {n + 1}], got {length}.",
            key=RATES,
        )
    # vLLM's minimum-variance schedule: every draft accepted up to the whole part of the
    # expected count, the fraction at the next position, none after.
    drafts = length - 1
    whole = int(drafts)
    return ([1.0] * whole + [drafts - whole] + [0.0] * n)[:n]


def _conditional(rates: list[float]) -> list[float]:
    """Unconditional rates (all of the first i+1 drafts accepted) as the conditional ones
    vLLM's synthetic sampler draws each position with, and engined's accept rates are."""
    return [
        rate / before if before > 0.0 else 0.0
        for rate, before in zip(rates, [1.0, *rates[:-1]], strict=True)
    ]
