"""Engine arguments: Dynamo's `MockEngineArgs` (dynamo-mocker 1.3.0) plus engined's own knobs.

A Dynamo mocker JSON (or the same keys as a TOML table) loads unchanged, and every refusal carries
the upstream message so an operator can search Dynamo's issues for it. Validation runs in the
upstream order (ranges, then the schema checks one by one) because a config that breaks two rules
must report the same rule upstream reports. Two checks come from later upstream
(`block_size >= 2` for vllm/trtllm, `max_model_len` for vllm only): 1.3.0 panics on the first and
lacks the field of the second, and a daemon must refuse a config rather than panic on it.
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

from engined.core.errors import InvalidArgsError
from engined.core.types import KvTransferTimingMode
from engined.core.vocab import canonical_excluded, vocabulary_error


class EngineType(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


class WorkerType(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class PreemptionMode(enum.StrEnum):
    LIFO = "lifo"
    FIFO = "fifo"


class PerfModelKind(enum.StrEnum):
    POLYNOMIAL = "polynomial"
    FIXED = "fixed"


class PrefixHitRule(enum.StrEnum):
    """How much of a cached prompt counts as a prefix hit (engined/core/prefix_hit.py)."""

    # vLLM's `get_computed_blocks` (and later upstream mocker): the hit stops one token short
    # of the known sequence, in whole blocks, so a fully cached prompt recomputes its last block.
    VLLM = "vllm"
    # dynamo-mocker 1.3.0: every cached block is a hit, even when that leaves nothing to compute.
    MOCKER_1_3_0 = "mocker-1.3.0"


# Rust's `{:?}` spelling of EngineType, which upstream messages embed.
_RUST_ENGINE_NAME = {
    EngineType.VLLM: "Vllm",
    EngineType.SGLANG: "Sglang",
    EngineType.TRTLLM: "Trtllm",
}

_DEFAULT_BLOCK_SIZE = {EngineType.VLLM: 64, EngineType.TRTLLM: 32}
_DEFAULT_ACCEPT_RATES = (0.85, 0.3, 0.0, 0.0, 0.0)
_U64_MAX = 2**64 - 1
_U16_MAX = 2**16 - 1


class TrtllmArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    capacity_scheduler_policy: str | None = None


class SglangArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schedule_policy: str | None = None
    page_size: int | None = None
    max_prefill_tokens: int | None = None
    chunked_prefill_size: int | None = None
    clip_max_new_tokens: int | None = None
    schedule_conservativeness: float | None = None


class EngineArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Validated engine configuration; build it with `from_mapping` or call `normalized()`.

    A directly constructed instance is raw (e.g. `block_size == 0`); only `normalized()` output
    is fit for a core. Keys after `trtllm`/`sglang` that the core never reads are kept so a
    Dynamo mocker JSON loads without edits.
    """

    engine_type: EngineType = EngineType.VLLM
    num_gpu_blocks: int = 16384
    block_size: int = 0  # 0 = engine default, filled in by normalized()
    max_num_seqs: int | None = 256
    max_num_batched_tokens: int | None = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speedup_ratio: float = 1.0
    decode_speedup_ratio: float = 1.0
    dp_size: int = 1
    startup_time: float | None = None
    worker_type: WorkerType = WorkerType.AGGREGATED
    preemption_mode: PreemptionMode = PreemptionMode.LIFO
    max_model_len: int | None = None
    aic_nextn: int | None = None
    aic_nextn_accept_rates: str | None = None
    aic_mtp_seed: int = 42
    kv_bytes_per_token: int | None = None
    kv_transfer_bandwidth: float | None = None  # GB/s
    kv_transfer_timing_mode: KvTransferTimingMode = KvTransferTimingMode.FULL_PROMPT
    handoff_session_timeout_ms: int = 300000
    num_g2_blocks: int | None = None
    num_g3_blocks: int | None = None
    enable_g4_storage: bool = False
    offload_batch_size: int | None = None
    bandwidth_g1_to_g2_gbps: float | None = None
    bandwidth_g2_to_g1_gbps: float | None = None
    bandwidth_g2_to_g3_gbps: float | None = None
    bandwidth_g3_to_g2_gbps: float | None = None
    bandwidth_g2_to_g4_gbps: float | None = None
    bandwidth_g4_to_g2_gbps: float | None = None
    trtllm: TrtllmArgs | None = None
    sglang: SglangArgs | None = None
    planner_profile_data: str | None = None
    aic_backend: str | None = None
    aic_system: str | None = None
    aic_backend_version: str | None = None
    aic_model_path: str | None = None
    aic_gemm_dtype: str | None = None
    aic_moe_dtype: str | None = None
    aic_fmha_dtype: str | None = None
    aic_kv_cache_dtype: str | None = None
    aic_comm_dtype: str | None = None
    aic_tp_size: int | None = None
    aic_moe_tp_size: int | None = None
    aic_moe_ep_size: int | None = None
    aic_attention_dp_size: int | None = None
    gpu_memory_utilization: float | None = None
    mem_fraction_static: float | None = None
    free_gpu_memory_fraction: float | None = None
    enable_local_indexer: bool = False
    bootstrap_port: int | None = None
    reasoning: dict[str, Any] | None = None
    response_replay_trace_path: str | None = None
    zmq_kv_events_port: int | None = None
    zmq_replay_port: int | None = None
    router_queue_policy: str | None = None
    # engined extensions
    seed: int = 0  # unplanned output tokens and caching-off block identities
    perf_model: PerfModelKind = PerfModelKind.POLYNOMIAL
    fixed_prefill_ms_per_token: float = 0.02
    fixed_pass_overhead_ms: float = 1.0
    fixed_decode_ms_per_pass: float = 10.0
    # Unplanned output ids: uniform in [0, vocab_size) minus excluded_token_ids (engined/core/
    # vocab.py); unset vocab_size keeps raw u32 ids.
    vocab_size: int | None = None
    excluded_token_ids: tuple[int, ...] = ()
    prefix_hit_rule: PrefixHitRule = PrefixHitRule.VLLM

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EngineArgs:
        """Load a Dynamo mocker JSON object or a TOML table, then normalise it.

        Args:
            data: key/value pairs as `json.loads` or `tomllib.loads` produce them.

        Returns:
            The `normalized()` arguments.

        Raises:
            InvalidArgsError: unknown key, wrong type, null for a non-nullable key, bad enum
                value, or any `normalized()` failure.
        """
        raw = dict(data)
        raw.pop("has_perf_model", None)
        legacy: dict[str, Any] = {k: raw.pop(k) for k in ("is_prefill", "is_decode") if k in raw}
        for flag, value in legacy.items():
            if not isinstance(value, bool | None):
                kind = type(value).__name__
                raise InvalidArgsError(f"Expected `bool | null`, got `{kind}` - at `$.{flag}`")
        if "worker_type" not in raw:
            worker_type = _legacy_worker_type(legacy)
            if worker_type is not None:
                raw["worker_type"] = worker_type.value
        for name in _non_nullable_fields():
            if name in raw and raw[name] is None:
                # NOTE: upstream deserialises num_gpu_blocks as nullable and keeps the default.
                if name == "num_gpu_blocks":
                    del raw[name]
                    continue
                raise InvalidArgsError(f"{name} must not be null")
        for name, (enum_type, message) in _ENUM_MESSAGES.items():
            value = raw.get(name)
            if isinstance(value, str):
                try:
                    raw[name] = enum_type(value.lower()).value
                except ValueError:
                    raise InvalidArgsError(message.format(value)) from None
        try:
            args = msgspec.convert(raw, cls)
        except msgspec.ValidationError as error:
            raise InvalidArgsError(str(error)) from None
        return args.normalized()

    def normalized(self) -> EngineArgs:
        """Fill engine defaults, validate, canonicalise the MTP accept rates and excluded ids.

        Returns:
            A new instance; normalising it again returns an equal one.

        Raises:
            InvalidArgsError: the first failed rule, with upstream's message.
        """
        args = self._materialized()
        _check_ranges(args)
        error = _schema_error(args) or vocabulary_error(args.vocab_size, args.excluded_token_ids)
        if error is not None:
            raise InvalidArgsError(error)
        args = msgspec.structs.replace(
            args, excluded_token_ids=canonical_excluded(args.excluded_token_ids)
        )
        if args.aic_nextn is not None:
            rates = _normalize_rates(args.aic_nextn, args.aic_nextn_accept_rates)
            args = msgspec.structs.replace(
                args, aic_nextn_accept_rates=",".join(rust_f64(r) for r in rates)
            )
        return args

    def _materialized(self) -> EngineArgs:
        block_size = self.block_size
        if block_size == 0:
            if self.engine_type == EngineType.SGLANG:
                page_size = self.sglang.page_size if self.sglang is not None else None
                block_size = page_size if page_size is not None else 1
            else:
                block_size = _DEFAULT_BLOCK_SIZE[self.engine_type]
        return msgspec.structs.replace(
            self,
            block_size=block_size,
            num_g2_blocks=self.num_g2_blocks or None,
            num_g3_blocks=self.num_g3_blocks or None,
            offload_batch_size=self.offload_batch_size or None,
        )

    @property
    def nextn_accept_rates(self) -> list[float]:
        """Conditional accept rate of each draft position, `aic_nextn` long (empty without MTP)."""
        if self.aic_nextn is None:
            return []
        return list(_normalize_rates(self.aic_nextn, self.aic_nextn_accept_rates))

    @property
    def is_prefill(self) -> bool:
        return self.worker_type == WorkerType.PREFILL

    @property
    def is_decode(self) -> bool:
        return self.worker_type == WorkerType.DECODE

    @property
    def uses_trtllm_policy(self) -> bool:
        """TRT-LLM runs the vLLM core with GUARANTEED_NO_EVICT admission."""
        return self.engine_type == EngineType.TRTLLM


# Upstream's `FromStr` texts; like upstream, parsing lowercases the value first.
_ENUM_MESSAGES: dict[str, tuple[type[enum.StrEnum], str]] = {
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
}


@functools.cache
def _non_nullable_fields() -> tuple[str, ...]:
    return tuple(
        f.name
        for f in msgspec.structs.fields(EngineArgs)
        if type(None) not in typing.get_args(f.type)
    )


def _legacy_worker_type(flags: dict[str, Any]) -> WorkerType | None:
    """Map the booleans that predate `worker_type`; upstream reads them only without it."""
    for name, value in flags.items():
        if value is None:
            raise InvalidArgsError(f"{name} must not be null")
    if flags.get("is_prefill") and flags.get("is_decode"):
        raise InvalidArgsError(
            "Invalid worker configuration: is_prefill and is_decode cannot both be true."
        )
    if flags.get("is_prefill"):
        return WorkerType.PREFILL
    return WorkerType.DECODE if flags.get("is_decode") else None


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
    ("aic_nextn", 1, 5),
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


def _check_ranges(args: EngineArgs) -> None:
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
            f"Failed to validate MockEngineArgs: {path} {problem}, got {_fmt(value)}"
        )


def _schema_error(args: EngineArgs) -> str | None:
    """Upstream `validate_mock_engine_args`: the first broken cross-field rule, or None."""
    engine = _RUST_ENGINE_NAME[args.engine_type]
    if args.block_size == 0:
        return "block_size must be greater than 0"
    if args.engine_type != EngineType.SGLANG and args.block_size < 2:
        return (
            "the vLLM/TRT-LLM scheduler requires block_size to be at least 2 "
            f"for engine_type={engine}, got block_size={args.block_size}"
        )
    if args.num_g3_blocks is not None and args.num_g2_blocks is None:
        return "num_g3_blocks requires num_g2_blocks because mocker stages G3 through G2"
    if args.max_model_len is not None and args.engine_type != EngineType.VLLM:
        return f"max_model_len is supported only for engine_type=vllm, got engine_type={engine}"
    if args.enable_g4_storage and args.num_g2_blocks is None:
        return "enable_g4_storage requires num_g2_blocks because mocker stages G4 through G2"
    if args.aic_nextn is not None and args.decode_speedup_ratio != 1.0:
        return (
            "aic_nextn requires decode_speedup_ratio=1.0 because MTP output acceleration is "
            f"modeled by burst sampling, got {rust_f64(args.decode_speedup_ratio)}"
        )
    if args.aic_nextn is None and args.aic_nextn_accept_rates is not None:
        return "aic_nextn_accept_rates requires aic_nextn"
    # NOTE: upstream checks the trtllm table whatever the engine_type; so do we.
    policy = args.trtllm.capacity_scheduler_policy if args.trtllm is not None else None
    if policy is not None and policy != "guaranteed_no_evict":
        return (
            "engine_type=trtllm v1 supports only "
            f"capacity_scheduler_policy='guaranteed_no_evict', got '{policy}'"
        )
    if args.engine_type != EngineType.SGLANG or args.sglang is None:
        return None
    page_size = args.sglang.page_size
    if page_size is not None and page_size != args.block_size:
        return (
            "engine_type=sglang requires block_size and sglang.page_size to match when both "
            f"are set, got block_size={args.block_size} and sglang.page_size={page_size}"
        )
    chunk = args.sglang.chunked_prefill_size
    if chunk is not None and chunk % args.block_size != 0:
        return (
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
def _normalize_rates(nextn: int, rates: str | None) -> tuple[float, ...]:
    """Upstream `normalize_conditional_accept_rates`; cached because the sampler asks often."""
    if not 1 <= nextn <= 5:
        raise InvalidArgsError(f"aic_nextn must be in 1..=5, got {nextn}")
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
            f"invalid aic_nextn_accept_rates value {_rust_debug_str(part)}: {reason}"
        )
    for index, rate in enumerate(parsed):
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise InvalidArgsError(
                f"aic_nextn_accept_rates[{index}] must be finite and in [0, 1], "
                f"got {rust_f64(rate)}"
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
