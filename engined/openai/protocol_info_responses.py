"""vLLM 0.33's bodies of the endpoints that generate nothing: `/v1/models`, `/tokenize`,
`/detokenize`, `/version`.

Apart from `engined.openai.protocol_responses` (the completion and chat bodies, which
re-exports these) because none of them has a usage, a choice or a stream; the same rule
holds: every field vLLM writes, in its order.
"""

from __future__ import annotations

import uuid

import msgspec


class ModelPermission(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct, kw_only=True):
    """One served name: `root` is the model path vLLM was started with, `parent` null; or one
    LoRA adapter: `root` its path, `parent` the served name it is for, no `max_model_len`."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = []


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard] = []


def model_card(
    name: str, root: str, max_model_len: int | None, created: int, *, parent: str | None = None
) -> ModelCard:
    """`/v1/models`' card for one served name or adapter, with vLLM's one default permission
    (its id vLLM's `random_uuid()`: 16 hex digits)."""
    permission = ModelPermission(id=f"modelperm-{uuid.uuid4().hex[:16]}", created=created)
    return ModelCard(
        id=name,
        created=created,
        root=root,
        parent=parent,
        max_model_len=max_model_len,
        permission=[permission],
    )


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str
