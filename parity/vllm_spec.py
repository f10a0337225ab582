"""MTP on the vLLM side (inside the vLLM venv): the model that enables it, and its steps.

vLLM derives MTP's scheduling from the target model's config: a GLM-4.5 (`glm4_moe`) with
one next-token-prediction layer gives method `mtp` with EAGLE-style drafting (lookahead
slots, one prefill lookahead token), full attention, no MLA (on CPU vLLM turns chunked
prefill and prefix caching off for MLA models such as DeepSeek-V3, which would test
something else). Nothing is loaded: the scheduler reads lengths and limits only.

A step with MTP is `EngineCore.step()` then `post_step()`: the model output samples, for
each request that catches up, as many tokens as engined's side gave at that sampling step
(1 + the drafts it accepted, `VllmJob.bursts`; vLLM counts the rest rejected), and the
drafter proposes `num_speculative_tokens` drafts for every scheduled request
(`update_draft_token_ids`, which ignores those mid-prefill and finished ones). Under async
scheduling the `AsyncScheduler` gives each request placeholder drafts itself (the worker
drafts them) and no `post_step()` proposes; a batch's tokens start after those the batches
still in flight will deliver, as many as their model outputs hold (`in_flight`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from parity.scenario import Config

# On top of the tiny Llama: GLM-4.5's MoE fields, small, and one MTP layer.
MTP_MODEL = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "head_dim": 16,
}


def speculative_config(
    model_config: Any, num_speculative_tokens: int, config: Config, draft_dir: str
) -> Any:
    """vLLM's `--speculative-config '{"method": METHOD, "num_speculative_tokens": N}'`: `mtp`
    from the target's own MTP layer (with `disable_lookahead_block_hashes` as the scenario
    sets it), or `draft_model` with the tiny Llama at `draft_dir` as the draft (its config
    only: nothing is loaded)."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    method = config.speculative_method
    return SpeculativeConfig(
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
        method=method,
        model=draft_dir if method == "draft_model" else None,
        num_speculative_tokens=num_speculative_tokens,
        disable_lookahead_block_hashes=config.disable_lookahead_block_hashes,
    )


class Drafts:
    """The MTP half of the fabricated model output: bursts and drafts."""

    def __init__(self, num_speculative_tokens: int, bursts: dict[str, list[int]]) -> None:
        self.num_spec = num_speculative_tokens
        self._bursts = {rid: deque(counts) for rid, counts in bursts.items()}
        self._in_flight: dict[str, int] = {}

    def sampled(self, request_id: str, scheduled_drafts: list[int] | None) -> int:
        """How many tokens a sampling step of `request_id` gives: engined's count for that
        step, at most 1 + the drafts it verifies (engined accepts no padding placeholder)."""
        counts = self._bursts.get(request_id)
        count = counts.popleft() if counts else 1
        return max(1, min(count, 1 + len(scheduled_drafts or ())))

    def in_flight(self, request_id: str) -> int:
        """The tokens batches still in flight will deliver to `request_id`."""
        return self._in_flight.get(request_id, 0)

    def promise(self, request_id: str, count: int) -> None:
        """A batch going into flight will deliver `count` tokens to `request_id`."""
        self._in_flight[request_id] = self._in_flight.get(request_id, 0) + count

    def settle(self, runner_output: Any) -> None:
        """The batch of `runner_output` is being delivered (or dropped)."""
        for request_id, index in runner_output.req_id_to_index.items():
            delivered = len(runner_output.sampled_token_ids[index])
            if not delivered:
                continue
            left = self._in_flight[request_id] - delivered
            if left:
                self._in_flight[request_id] = left
            else:
                del self._in_flight[request_id]

    def propose(self, scheduler: Any, request_ids: list[str]) -> None:
        """`post_step()`: drafts for every request the step ran."""
        from vllm.v1.outputs import DraftTokenIds

        drafts = [[0] * self.num_spec for _ in request_ids]
        scheduler.update_draft_token_ids(DraftTokenIds(list(request_ids), drafts))
