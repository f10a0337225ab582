"""The rules of `EngineArgs`: ranges, upstream's schema checks, MTP accept rates, Rust spellings.

Apart from the field declarations (`engined.core.args_fields`) so both stay readable, and each
refusal names its key in `InvalidArgsError.key` as well as in upstream's text. A rule across
fields is keyed to the first field its message names (`num_g3_blocks requires num_g2_blocks`:
`num_g3_blocks`), as the daemon reported it before errors had keys; `engine_type` aside, which
only says when a rule applies (`engine_type=trtllm v1 supports only capacity_scheduler_policy=`
is about `trtllm.capacity_scheduler_policy`).
"""

from __future__ import annotations

import decimal
import enum
import functools
import math
import re
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from engined.core.args_fields import (
    EngineFields,
    EngineType,
    PreemptionMode,
    PrefixHitRule,
    SchedulingPolicy,
    Semantics,
    WorkerType,
)
from engined.core.errors import InvalidArgsError
from engined.core.types import KvTransferTimingMode
from engined.core.vllm_hashing import HashAlgo

# Rust's `{:?}` spelling of EngineType, which upstream messages embed.
_RUST_ENGINE_NAME = {
    EngineType.VLLM: "Vllm",
    EngineType.SGLANG: "Sglang",
    EngineType.TRTLLM: "Trtllm",
}

_DEFAULT_ACCEPT_RATES = (0.85, 0.3, 0.0, 0.0, 0.0)
_U64_MAX = 2**64 - 1
_U16_MAX = 2**16 - 1

# Upstream's `FromStr` texts; like upstream, parsing lowercases the value first.
ENUM_MESSAGES: dict[str, tuple[type[enum.StrEnum], str]] = {
    "engine_type": (EngineType, "Invalid engine_type '{}'. Must be 'vllm', 'sglang', or 'trtllm'."),
    "worker_type": (
        WorkerType,
        "Invalid worker_type '{}'. Must be 'aggregated', 'prefill', or 'decode'.",
    ),
    "preemption_mode": (PreemptionMode, "Invalid preemption_mode: '{}'. Must be 'lifo' or 'fifo'."),
    "kv_transfer_timing_mode": (
        KvTransferTimingMode,
        "Invalid kv_transfer_timing_mode '{}'. Must be 'full_prompt' or 'destination_missing'.",
    ),
    "prefix_hit_rule": (
        PrefixHitRule,
        "Invalid prefix_hit_rule '{}'. Must be 'vllm' or 'mocker-1.3.0'.",
    ),
    "scheduling_policy": (
        SchedulingPolicy,
        "Invalid scheduling_policy '{}'. Input should be 'fcfs' or 'priority'.",
    ),
    "semantics": (
        Semantics,
        "Invalid semantics '{}'. Must be 'vllm' or 'mocker-1.3.0'.",
    ),
    # vLLM's (pydantic's) words for a value outside its `PrefixCachingHashAlgo` literal.
    "prefix_caching_hash_algo": (
        HashAlgo,
        "Invalid prefix_caching_hash_algo '{}'. "
        "Input should be 'sha256', 'sha256_cbor', 'xxhash' or 'xxhash_cbor'.",
    ),
}

_FIELD_TYPES: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(EngineFields)}
NON_NULLABLE_FIELDS: tuple[str, ...] = tuple(
    name
    for name, annotation in _FIELD_TYPES.items()
    if type(None) not in typing.get_args(annotation)
)

# The most draft tokens MTP proposes a step (the mocker's limit, kept under vLLM semantics).
MAX_NEXTN = 5


def legacy_worker_type(flags: dict[str, Any]) -> WorkerType | None:
    """Map the booleans that predate `worker_type`; upstream reads them only without it."""
    for name, value in flags.items():
        if value is None:
            raise InvalidArgsError(f"{name} must not be null", key=name)
    if flags.get("is_prefill") and flags.get("is_decode"):
        # NOTE: about both flags; keyed to the first, as its message names it first.
        raise InvalidArgsError(
            "Invalid worker configuration: is_prefill and is_decode cannot both be true.",
            key="is_prefill",
        )
    if flags.get("is_prefill"):
        return WorkerType.PREFILL
    return WorkerType.DECODE if flags.get("is_decode") else None


def refused_key(raw: Mapping[str, Any]) -> str | None:
    """The key of `raw` that `msgspec.convert(raw, EngineArgs)` refused, found from the types.

    msgspec walks a mapping in its order and stops at the first unknown key or wrong type,
    so the first such key here is the one its message is about; a sub-table names its field.
    """
    for name, value in raw.items():
        annotation = _FIELD_TYPES.get(name)
        if annotation is None:
            return name
        if _fits(value, annotation):
            continue
        table = _table(annotation)
        if table is not None and isinstance(value, Mapping):
            sub_types = {f.name: f.type for f in msgspec.structs.fields(table)}
            for sub_name, sub_value in value.items():
                if sub_name not in sub_types or not _fits(sub_value, sub_types[sub_name]):
                    return f"{name}.{sub_name}"
        return name
    return None


def _fits(value: Any, annotation: Any) -> bool:
    try:
        msgspec.convert(value, annotation)
    except msgspec.ValidationError:
        return False
    return True


def _table(annotation: Any) -> type[msgspec.Struct] | None:
    for member in typing.get_args(annotation):
        if isinstance(member, type) and issubclass(member, msgspec.Struct):
            return member
    return None


_BANDWIDTHS = ("g1_to_g2", "g2_to_g1", "g2_to_g3", "g3_to_g2", "g2_to_g4", "g4_to_g2")
_AIC_SIZES = ("aic_tp_size", "aic_moe_tp_size", "aic_moe_ep_size", "aic_attention_dp_size")
_FRACTIONS = ("gpu_memory_utilization", "mem_fraction_static", "free_gpu_memory_fraction")
_PORTS = ("bootstrap_port", "zmq_kv_events_port", "zmq_replay_port")
_FIXED_COSTS = ("fixed_prefill_ms_per_token", "fixed_pass_overhead_ms", "fixed_decode_ms_per_pass")
_SGLANG_SIZES = ("page_size", "max_prefill_tokens", "chunked_prefill_size", "clip_max_new_tokens")

# (field path, minimum, maximum or None), checked in this order. Unsigned upstream types get a
# lower bound of 0 so a negative value is refused here rather than deep inside the core.
_RANGES: tuple[tuple[str, float, float | None], ...] = (
    *((name, 1, None) for name in ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens")),
    ("block_size", 0, None),
    ("speedup_ratio", 0.0, None),
    ("decode_speedup_ratio", 0.0, None),
    ("dp_size", 1, None),
    ("startup_time", 0.0, None),
    ("max_model_len", 1, None),
    ("long_prefill_token_threshold", 0, None),
    ("max_num_active_seqs", 1, None),
    ("max_num_scheduled_tokens", 1, None),
    ("drafting_slots", 0, None),
    ("max_loras", 1, None),
    ("prefill_schedule_interval", 1, None),
    ("aic_nextn", 1, MAX_NEXTN),
    ("aic_mtp_seed", 0, _U64_MAX),
    ("kv_bytes_per_token", 1, None),
    ("kv_transfer_bandwidth", 0.0, None),
    ("handoff_session_timeout_ms", 1, None),
    *((name, 1, None) for name in ("num_g2_blocks", "num_g3_blocks", "offload_batch_size")),
    *((f"bandwidth_{link}_gbps", 0.0, None) for link in _BANDWIDTHS),
    *((name, 0, None) for name in _AIC_SIZES),
    *((name, 0.0, 1.0) for name in _FRACTIONS),
    *((name, 0, _U16_MAX) for name in _PORTS),
    ("seed", 0, None),
    *((name, 0.0, None) for name in _FIXED_COSTS),
    *((f"sglang.{name}", 1, None) for name in _SGLANG_SIZES),
    ("sglang.schedule_conservativeness", 0.0, 1.0),
)


def check_ranges(args: EngineFields) -> None:
    for path, lo, hi in _RANGES:
        value: Any = args
        for part in path.split("."):
            value = getattr(value, part, None)
        if value is None:
            continue
        if isinstance(value, float) and math.isinf(value):
            problem = "must be finite"
        elif hi is None and not value >= lo:
            problem = f"must be >= {_fmt(lo)}"
        elif hi is not None and not lo <= value <= hi:
            problem = f"must be in [{_fmt(lo)}, {_fmt(hi)}]"
        else:
            continue
        raise InvalidArgsError(
            f"Failed to validate MockEngineArgs: {path} {problem}, got {_fmt(value)}", key=path
        )


def schema_problem(args: EngineFields) -> tuple[str, str] | None:
    """Upstream `validate_mock_engine_args`: (key, message) of the first broken rule, or None."""
    engine = _RUST_ENGINE_NAME[args.engine_type]
    if args.block_size == 0:
        return "block_size", "block_size must be greater than 0"
    if args.engine_type != EngineType.SGLANG and args.block_size < 2:
        return "block_size", (
            "the vLLM/TRT-LLM scheduler requires block_size to be at least 2 "
            f"for engine_type={engine}, got block_size={args.block_size}"
        )
    if args.num_g3_blocks is not None and args.num_g2_blocks is None:
        return "num_g3_blocks", (
            "num_g3_blocks requires num_g2_blocks because mocker stages G3 through G2"
        )
    if args.max_model_len is not None and args.engine_type != EngineType.VLLM:
        return "max_model_len", (
            f"max_model_len is supported only for engine_type=vllm, got engine_type={engine}"
        )
    active, seqs = args.max_num_active_seqs, args.max_num_seqs
    if active is not None and seqs is not None and active > seqs:
        # vLLM's `SchedulerConfig.verify_max_model_len`.
        return "max_num_active_seqs", (
            f"max_num_active_seqs ({active}) cannot be greater than max_num_seqs ({seqs})."
        )
    if not 0.0 <= args.watermark < 1.0:
        return "watermark", f"watermark must be in [0, 1), got {_fmt(args.watermark)}"
    threshold = args.long_prefill_token_threshold
    if args.max_model_len is not None and threshold > args.max_model_len:
        # vLLM's `SchedulerConfig.verify_max_model_len`.
        return "long_prefill_token_threshold", (
            f"long_prefill_token_threshold ({threshold}) cannot be greater than the "
            f"max_model_len ({args.max_model_len})."
        )
    if args.enable_g4_storage and args.num_g2_blocks is None:
        return "enable_g4_storage", (
            "enable_g4_storage requires num_g2_blocks because mocker stages G4 through G2"
        )
    if args.aic_nextn is not None and args.decode_speedup_ratio != 1.0:
        return "aic_nextn", (
            "aic_nextn requires decode_speedup_ratio=1.0 because MTP output acceleration is "
            f"modeled by burst sampling, got {rust_f64(args.decode_speedup_ratio)}"
        )
    if args.aic_nextn is None and args.aic_nextn_accept_rates is not None:
        return "aic_nextn_accept_rates", "aic_nextn_accept_rates requires aic_nextn"
    if args.aic_nextn is None and args.drafting_slots:
        return "drafting_slots", "drafting_slots requires aic_nextn"
    if args.eagle_block_drop and (args.aic_nextn is None or args.lookahead_block_hashes):
        return "eagle_block_drop", (
            "eagle_block_drop requires aic_nextn and lookahead_block_hashes = false (vLLM "
            "drops the trailing block only under its plain hashes)"
        )
    if not 0.0 < args.kv_cache_metrics_sample <= 1.0:
        return "kv_cache_metrics_sample", (
            f"kv_cache_metrics_sample must be in (0, 1], got {_fmt(args.kv_cache_metrics_sample)}"
        )
    # NOTE: upstream checks the trtllm table whatever the engine_type; so do we.
    policy = args.trtllm.capacity_scheduler_policy if args.trtllm is not None else None
    if policy is not None and policy != "guaranteed_no_evict":
        return "trtllm.capacity_scheduler_policy", (
            "engine_type=trtllm v1 supports only "
            f"capacity_scheduler_policy='guaranteed_no_evict', got '{policy}'"
        )
    if args.engine_type != EngineType.SGLANG or args.sglang is None:
        return None
    page_size = args.sglang.page_size
    if page_size is not None and page_size != args.block_size:
        return "block_size", (
            "engine_type=sglang requires block_size and sglang.page_size to match when both "
            f"are set, got block_size={args.block_size} and sglang.page_size={page_size}"
        )
    chunk = args.sglang.chunked_prefill_size
    if chunk is not None and chunk % args.block_size != 0:
        return "sglang.chunked_prefill_size", (
            "engine_type=sglang requires sglang.chunked_prefill_size to be divisible by "
            f"block_size, got chunked_prefill_size={chunk} and block_size={args.block_size}"
        )
    return None


# Rust's `str::parse::<f64>` grammar; Python's float() also takes '_' and surrounding spaces.
_RUST_FLOAT = re.compile(
    r"[+-]?(?:inf|infinity|nan|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)",
    re.IGNORECASE | re.ASCII,
)


@functools.lru_cache(maxsize=64)
def normalize_rates(nextn: int, rates: str | None) -> tuple[float, ...]:
    """Upstream `normalize_conditional_accept_rates`; cached because the sampler asks often."""
    if not 1 <= nextn <= 5:
        raise InvalidArgsError(f"aic_nextn must be in 1..=5, got {nextn}", key="aic_nextn")
    text = rates.strip() if rates is not None else ""
    parsed: list[float] = []
    if not text:
        parsed.extend(_DEFAULT_ACCEPT_RATES)
    for part in text.split(",") if text else ():
        # NOTE: the message quotes the part untrimmed, as upstream's closure does.
        trimmed = part.strip()
        if not trimmed:
            reason = "cannot parse float from empty string"
        elif _RUST_FLOAT.fullmatch(trimmed) is None:
            reason = "invalid float literal"
        else:
            parsed.append(float(trimmed))
            continue
        raise InvalidArgsError(
            f"invalid aic_nextn_accept_rates value {_rust_debug_str(part)}: {reason}",
            key="aic_nextn_accept_rates",
        )
    for index, rate in enumerate(parsed):
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise InvalidArgsError(
                f"aic_nextn_accept_rates[{index}] must be finite and in [0, 1], "
                f"got {rust_f64(rate)}",
                key="aic_nextn_accept_rates",
            )
    parsed = parsed[:nextn] + [0.0] * (nextn - len(parsed))
    return tuple(parsed)


def rust_f64(value: float) -> str:
    """Rust's `Display` for f64: shortest round-trip digits, never an exponent, no `.0`."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = format(decimal.Decimal(repr(value)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _fmt(value: float) -> str:
    return rust_f64(value) if isinstance(value, float) else str(value)


_RUST_STR_ESCAPES = {"\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}


def _rust_debug_str(text: str) -> str:
    """Rust's `{:?}` for a str: quoted, with escapes and `\\u{..}` for unprintable characters."""
    return '"' + "".join(_RUST_STR_ESCAPES.get(c) or _printable(c) for c in text) + '"'


def _printable(char: str) -> str:
    return char if char.isprintable() else f"\\u{{{ord(char):x}}}"
