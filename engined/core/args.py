"""Engine arguments: Dynamo's `MockEngineArgs` (dynamo-mocker 1.3.0) plus engined's own knobs.

A Dynamo mocker JSON (or the same keys as a TOML table) loads unchanged, and every refusal carries
the upstream message so an operator can search Dynamo's issues for it. Validation runs in the
upstream order (ranges, then the schema checks one by one) because a config that breaks two rules
must report the same rule upstream reports. Two checks come from later upstream
(`block_size >= 2` for vllm/trtllm, `max_model_len` for vllm only): 1.3.0 panics on the first and
lacks the field of the second, and a daemon must refuse a config rather than panic on it.

The fields are declared in `engined.core.args_fields`, the rules in `engined.core.args_rules`;
this module joins them and is where callers import every name from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from engined.core.args_fields import (
    EngineFields,
    EngineType,
    PerfModelKind,
    PreemptionMode,
    PrefixHitRule,
    SchedulingPolicy,
    Semantics,
    SglangArgs,
    TrtllmArgs,
    WorkerType,
)
from engined.core.args_rules import (
    ENUM_MESSAGES,
    NON_NULLABLE_FIELDS,
    check_ranges,
    legacy_worker_type,
    normalize_rates,
    refused_key,
    rust_f64,
    schema_problem,
)
from engined.core.errors import InvalidArgsError
from engined.core.vocab import canonical_excluded, vocabulary_problem

__all__ = [
    "EngineArgs",
    "EngineType",
    "PerfModelKind",
    "PreemptionMode",
    "PrefixHitRule",
    "SchedulingPolicy",
    "Semantics",
    "SglangArgs",
    "TrtllmArgs",
    "WorkerType",
    "rust_f64",
]

_DEFAULT_BLOCK_SIZE = {EngineType.VLLM: 64, EngineType.TRTLLM: 32}


class EngineArgs(EngineFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Validated engine configuration; build it with `from_mapping` or call `normalized()`.

    A directly constructed instance is raw (e.g. `block_size == 0`); only `normalized()` output
    is fit for a core.
    """

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
                raise InvalidArgsError(
                    f"Expected `bool | null`, got `{kind}` - at `$.{flag}`", key=flag
                )
        if "worker_type" not in raw:
            worker_type = legacy_worker_type(legacy)
            if worker_type is not None:
                raw["worker_type"] = worker_type.value
        for name in NON_NULLABLE_FIELDS:
            if name in raw and raw[name] is None:
                # NOTE: upstream deserialises num_gpu_blocks as nullable and keeps the default.
                if name == "num_gpu_blocks":
                    del raw[name]
                    continue
                raise InvalidArgsError(f"{name} must not be null", key=name)
        for name, (enum_type, message) in ENUM_MESSAGES.items():
            value = raw.get(name)
            if isinstance(value, str):
                try:
                    raw[name] = enum_type(value.lower()).value
                except ValueError:
                    raise InvalidArgsError(message.format(value), key=name) from None
        try:
            args = msgspec.convert(raw, cls)
        except msgspec.ValidationError as error:
            raise InvalidArgsError(str(error), key=refused_key(raw)) from None
        return args.normalized()

    def runs_vllm_semantics(self) -> bool:
        """Whether a core built from these args runs vLLM 0.33's scheduler and KV cache
        (engined/core/paged/), short of offload tiers, which only the mocker pool has.

        Where vLLM has no counterpart the mocker's rules stay: TRT-LLM's policy. MTP is
        vLLM's speculative decoding (engined/core/paged/spec_decode.py).
        `prefix_hit_rule = mocker-1.3.0` is the one switch back to all of the mocker's
        behaviour.
        """
        return (
            self.semantics is Semantics.VLLM
            and self.prefix_hit_rule is PrefixHitRule.VLLM
            and self.engine_type is EngineType.VLLM
        )

    def normalized(self) -> EngineArgs:
        """Fill engine defaults, validate, canonicalise the MTP accept rates and excluded ids.

        Returns:
            A new instance; normalising it again returns an equal one.

        Raises:
            InvalidArgsError: the first failed rule, with upstream's message.
        """
        args = self._materialized()
        check_ranges(args)
        problem = schema_problem(args) or vocabulary_problem(
            args.vocab_size, args.excluded_token_ids
        )
        if problem is not None:
            key, message = problem
            raise InvalidArgsError(message, key=key)
        args = msgspec.structs.replace(
            args, excluded_token_ids=canonical_excluded(args.excluded_token_ids)
        )
        if args.aic_nextn is not None:
            rates = normalize_rates(args.aic_nextn, args.aic_nextn_accept_rates)
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
        return list(normalize_rates(self.aic_nextn, self.aic_nextn_accept_rates))

    @property
    def pass_token_budget(self) -> int | None:
        """The tokens one pass may schedule (None: unbounded): vLLM's token budget,
        `max_num_scheduled_tokens` where it is set and below its input budget,
        `max_num_batched_tokens`, which bounds every pass too."""
        budgets = [b for b in (self.max_num_scheduled_tokens, self.max_num_batched_tokens) if b]
        return min(budgets) if budgets else None

    @property
    def enforced_max_model_len(self) -> int | None:
        """`max_model_len` as a rank enforces it before the KV pool caps it (None: unset).

        Without chunked prefill vLLM's scheduler prefills a sequence in one pass, so one pass's
        budget bounds it too. vLLM refuses to start with `max_num_batched_tokens <
        max_model_len` then, because the budget "effectively limits the maximum sequence length
        to max_num_batched_tokens"; engined starts and applies that limit, which also lets a
        preempted request always be prefilled again (it never outgrows the budget). The
        mocker's scheduler has no such wait, so its semantics keep 1.3.0's lengths.
        """
        budget = self.pass_token_budget
        if self.enable_chunked_prefill or budget is None or not self.runs_vllm_semantics():
            return self.max_model_len
        return budget if self.max_model_len is None else min(self.max_model_len, budget)

    @property
    def prompts_cost_prefill(self) -> bool:
        """Whether a rank's prompt tokens cost prefill time: not on a decode worker, whose
        prompts' KV arrives by transfer."""
        return self.worker_type is not WorkerType.DECODE

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


def _schema_error(args: EngineFields) -> str | None:
    """The message of the first broken schema rule; kept for the rule `normalized` never reaches.

    `block_size == 0` only exists before materialisation, so only this direct call shows
    that its message is upstream's.
    """
    problem = schema_problem(args)
    return None if problem is None else problem[1]
