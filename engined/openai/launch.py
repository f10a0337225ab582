"""What `engined serve` takes from its model before the daemon starts.

The ranks must draw ids the API server can detokenize and never its EOS or another special
token (so that every completion has exactly its `max_tokens`), and must refuse what vLLM
refuses for the model's context: so the vocabulary and, unless set, `max_model_len` come
from the tokenizer's model directory, into the engine's own settings, before any rank is
built. A model that cannot be used is a configuration error, named, before a socket is bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from engined.config import ConfigError, DaemonConfig
from engined.core.args import EngineType

if TYPE_CHECKING:
    from engined.openai.tokenizer import Tokenizer


def uses_model(config: DaemonConfig) -> bool:
    """A daemon with an API server, or given a model, draws from the model's vocabulary."""
    return config.api_port is not None or bool(config.model) or bool(config.tokenizer)


def with_model(
    config: DaemonConfig,
    *,
    vocab_given: bool,
    max_model_len_given: bool,
    budget_given: bool = True,
) -> DaemonConfig:
    """`config` with the engine's vocabulary and context taken from the model, and vLLM's
    token budget for that context.

    `vocab_given`: the user set `vocab_size` (it is then checked against the model rather
    than replaced); `max_model_len_given`: likewise for `max_model_len`; `budget_given`:
    the user set `max_num_batched_tokens` (`unset_budget`).

    Raises:
        ConfigError: the model or tokenizer cannot be loaded, or the given vocabulary would
            let the ranks draw ids the tokenizer cannot decode or its special tokens.
    """
    if uses_model(config):
        config = _from_model(
            config, vocab_given=vocab_given, max_model_len_given=max_model_len_given
        )
    return config if budget_given else unset_budget(config)


def unset_budget(config: DaemonConfig) -> DaemonConfig:
    """vLLM's budget when none was given: without chunked prefill a sequence is prefilled in
    one pass, so vLLM raises its default budget to `max_model_len`
    (`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`). Under the mocker's
    semantics, or with chunked prefill, the default stays.
    """
    engine = config.engine
    budget, context = engine.max_num_batched_tokens, engine.max_model_len
    if (
        engine.enable_chunked_prefill
        or not engine.runs_vllm_semantics()
        or budget is None
        or context is None
        or context <= budget
    ):
        return config
    engine = msgspec.structs.replace(engine, max_num_batched_tokens=context).normalized()
    return msgspec.structs.replace(config, engine=engine)


def _from_model(
    config: DaemonConfig, *, vocab_given: bool, max_model_len_given: bool
) -> DaemonConfig:
    # NOTE: imported here: the tokenizer stack (tokenizers, jinja2) costs about 35 ms of a
    # daemon's 0.5 s start-up CPU, and one without an API server or a model never needs it.
    from engined.openai.tokenizer import TokenizerError, load_tokenizer

    try:
        tokenizer = load_tokenizer(config.model or None, config.tokenizer or None)
    except TokenizerError as error:
        raise ConfigError(f"model: {error}", key="model") from None
    engine = config.engine
    excluded = tuple(sorted(tokenizer.excluded_token_ids))
    if vocab_given:
        _check_vocabulary(engine.vocab_size, engine.excluded_token_ids, tokenizer)
        changes: dict[str, object] = {}
    else:
        changes = {"vocab_size": tokenizer.vocab_size, "excluded_token_ids": excluded}
    positions = tokenizer.max_position_embeddings
    # NOTE: max_model_len is a vLLM setting; the TRT-LLM policy refuses it (engined.core.args).
    if not max_model_len_given and positions is not None and engine.engine_type is EngineType.VLLM:
        changes["max_model_len"] = positions
    if not changes:
        return config
    engine = msgspec.structs.replace(engine, **changes).normalized()
    return msgspec.structs.replace(config, engine=engine)


def _check_vocabulary(
    vocab_size: int | None, excluded: tuple[int, ...], tokenizer: Tokenizer
) -> None:
    if vocab_size is None:
        return
    if vocab_size > tokenizer.vocab_size:
        raise ConfigError(
            f"engine.vocab_size: {vocab_size} is more than the tokenizer's {tokenizer.vocab_size}: "
            "ids past it would decode to nothing; leave vocab_size unset to use the model's",
            key="engine.vocab_size",
        )
    missing = sorted(set(tokenizer.excluded_token_ids) - set(excluded))
    missing = [token for token in missing if token < vocab_size]
    if missing:
        raise ConfigError(
            f"engine.excluded_token_ids: must include the model's special tokens {missing} "
            "(an EOS would end completions early); leave vocab_size unset to use the model's",
            key="engine.excluded_token_ids",
        )
