"""The fields of a Dynamo request that become a control-protocol request, checked.

Apart from `engined.dynamo.handler` (which streams and hands off) because each rule here is
one field's: what Dynamo's preprocessor may put there, and the 400 naming that field when it
is not usable (bad input never reaches the daemon unexplained).
"""

from __future__ import annotations

from typing import Any, Final

import structlog

from engined.core.token_stream import SEED_MAX, SEED_MIN
from engined.dynamo.engine_outputs import OutputOptions, RequestFailed, field_map, output_options

log = structlog.get_logger(__name__)

# The key under `disaggregated_params` that carries engined's handoff (other engines' keys
# never collide with it).
PARAMS_KEY: Final = "engined"


def core_fields(
    request: dict[str, Any], context_length: int
) -> tuple[list[int], int, int | None, int | None]:
    """The prompt, `max_tokens` (vLLM's default: the room the context leaves), the routed
    rank and the seed; a bad one is a 400 naming its field."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise RequestFailed(400, "token_ids: expected a non-empty list of token ids")
    stop = field_map(request, "stop_conditions")
    max_tokens = stop.get("max_tokens")
    if max_tokens is None:
        # vLLM's default: whatever room the context leaves.
        max_tokens = max(context_length - len(token_ids), 0)
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise RequestFailed(
            400, f"stop_conditions.max_tokens: expected an int >= 0, got {max_tokens!r}"
        )
    min_tokens = stop.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > max_tokens:
        raise RequestFailed(
            400, f"stop_conditions.min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})"
        )
    routing = field_map(request, "routing")
    dp_rank = routing.get("dp_rank")
    if dp_rank is not None and (not isinstance(dp_rank, int) or dp_rank < 0):
        raise RequestFailed(400, f"routing.dp_rank: expected an int >= 0, got {dp_rank!r}")
    sampling = field_map(request, "sampling_options")
    seed = sampling.get("seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed <= SEED_MAX
    ):
        raise RequestFailed(400, f"sampling_options.seed: expected an int64 or null, got {seed!r}")
    return token_ids, max_tokens, dp_rank, seed


def single_sample(request: dict[str, Any]) -> OutputOptions:
    """The output options of a P/D request, which carries one sample through the handoff."""
    options = output_options(request)
    if options.n != 1:
        raise RequestFailed(
            400,
            f"sampling_options.n: a prefill/decode handoff carries one sample, got n={options.n}"
            " (serve n > 1 from an aggregated worker)",
        )
    return options


def stop_fields(request: dict[str, Any]) -> tuple[list[int] | None, int]:
    """`stop_conditions.stop_token_ids_hidden` and `min_tokens`, as dynamo.vllm hands them to
    vLLM's `SamplingParams` (the daemon judges the values, `core_fields` the min/max order)."""
    stop = field_map(request, "stop_conditions")
    ids = stop.get("stop_token_ids_hidden")
    if ids is not None and (
        not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)
    ):
        raise RequestFailed(
            400, f"stop_conditions.stop_token_ids_hidden: expected token ids, got {ids!r}"[:200]
        )
    min_tokens = stop.get("min_tokens") or 0
    if not isinstance(min_tokens, int) or min_tokens < 0:
        raise RequestFailed(
            400, f"stop_conditions.min_tokens: expected an int >= 0, got {min_tokens!r}"
        )
    return ids or None, min_tokens


def pin_rank(request: dict[str, Any], rank: int) -> None:
    """Route the request to `rank`, the one a `--worker-per-rank` worker serves: the router
    names it (the registered range is that rank alone), and a request that names none or
    another goes there too, as dynamo.vllm falls back on a rank out of its range."""
    routing = request.get("routing")
    if not isinstance(routing, dict):
        routing = request["routing"] = {}
    asked = routing.get("dp_rank")
    if asked is not None and asked != rank:
        log.warning("request for another rank served here", dp_rank=asked, rank=rank)
    routing["dp_rank"] = rank


def prefill_cached_tokens(prefill_result: Any) -> int:
    """The prompt tokens the prefill found cached, from its result: a decode's usage
    reports them as vLLM's decode side does."""
    details = (prefill_result or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and cached >= 0 else 0


def handoff_params(prefill_result: Any) -> dict[str, Any]:
    """The engined handoff a prefill worker's result names (under PARAMS_KEY); a 400 when
    it names none: the prefill worker is not an engined one."""
    params = (prefill_result or {}).get("disaggregated_params") or {}
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(ours, dict) or not isinstance(ours.get("handoff_id"), str):
        raise RequestFailed(
            400,
            "prefill_result.disaggregated_params carries no engined handoff: the prefill "
            "worker is not an engined dynamo-worker",
        )
    if not isinstance(ours.get("control_endpoint"), str):
        raise RequestFailed(
            400, "prefill_result.disaggregated_params.engined.control_endpoint: missing"
        )
    return ours
