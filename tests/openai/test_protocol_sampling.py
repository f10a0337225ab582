"""The checks after decoding, and the error builders, with vLLM 0.33's exact messages.

The messages of `check_engine` were recorded from vLLM's `SamplingParams.verify` (vocabulary
1000, max_logprobs 20); the others are its source's strings.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engined.openai.api_errors import (
    ApiError,
    beam_search_stream,
    body_parse_error,
    context_length_error,
    empty_prompt,
    engine_dead,
    http_error,
    method_not_allowed,
    prefill_backlog_full,
    prompt_chars_error,
    route_not_found,
    token_out_of_vocabulary,
    unsupported_media_type,
)
from engined.openai.protocol import decode_chat_request, decode_completion_request
from engined.openai.protocol_sampling import (
    check_completion_prompt,
    check_engine,
    check_sampling,
    echo_only,
    effective_max_tokens,
    requested_max_tokens,
    sample_logprobs,
)

VOCAB = 1000
CONTEXT = 100


def _completion(**fields: Any) -> Any:
    return decode_completion_request(json.dumps({"prompt": "x", **fields}).encode())


def _chat(**fields: Any) -> Any:
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    return decode_chat_request(json.dumps(body).encode())


def _engine_refusal(request: Any, prompt: list[int] | None = None) -> tuple[str | None, str]:
    with pytest.raises(ApiError) as info:
        tokens = [1, 2] if prompt is None else prompt
        check_engine(request, tokens, max_model_len=CONTEXT, vocab_size=VOCAB)
    assert (info.value.status, info.value.type) == (400, "BadRequestError")
    return info.value.param, info.value.message


def test_the_engine_refuses_ids_outside_the_vocabulary() -> None:
    assert _engine_refusal(_completion(logit_bias={"5000": 1.0, "-1": 2.0, "3": 1.0})) == (
        "logit_bias",
        "token_id(s) [5000, -1] in logit_bias contain out-of-vocab token ids. Vocabulary size: "
        "1000 (parameter=logit_bias, value=[5000, -1])",
    )
    assert _engine_refusal(_completion(stop_token_ids=[5, 1000, 1000, -3])) == (
        "stop_token_ids",
        "token_id(s) [1000, -3] in stop_token_ids contain out-of-vocab token ids. Vocabulary "
        "size: 1000 (parameter=stop_token_ids, value=[1000, -3])",
    )
    assert _engine_refusal(_completion(allowed_token_ids=[])) == (
        "allowed_token_ids",
        "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])",
    )
    assert _engine_refusal(_completion(allowed_token_ids=[1, 1000])) == (
        "allowed_token_ids",
        "allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids, "
        "value=[1000])",
    )


def test_the_engine_refuses_logprobs_beyond_its_limits() -> None:
    assert _engine_refusal(_completion(logprobs=1, logprob_token_ids=list(range(129)))) == (
        "logprob_token_ids",
        "Requested logprob_token_ids of length 129, which is greater than max allowed: 128 "
        "(parameter=logprob_token_ids, value=129)",
    )
    assert _engine_refusal(_completion(logprobs=1, logprob_token_ids=[1, 1000])) == (
        "logprob_token_ids",
        "token_id(s) [1000] in logprob_token_ids contain out-of-vocab token ids. Vocabulary "
        "size: 1000 (parameter=logprob_token_ids, value=[1000])",
    )
    assert _engine_refusal(_completion(prompt_logprobs=21)) == (
        "prompt_logprobs",
        "Requested prompt logprobs of 21, which is greater than max allowed: 20 "
        "(parameter=prompt_logprobs, value=21)",
    )
    assert _engine_refusal(_completion(logprobs=-1))[1].startswith(
        "Requested sample logprobs of 1000, which is greater than max allowed: 20"
    )
    assert _engine_refusal(_chat(logprobs=True, top_logprobs=21))[0] == "logprobs"
    check_engine(
        _completion(logprobs=-1), [1], max_model_len=CONTEXT, vocab_size=VOCAB, max_logprobs=-1
    )


def test_the_engine_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ApiError) as info:
        check_engine(
            _completion(min_p=0.5), [1], max_model_len=CONTEXT, vocab_size=VOCAB, speculative=True
        )
    assert info.value.message == (
        "The min_p and logit_bias sampling parameters are not yet supported with speculative "
        "decoding."
    )
    greedy = _completion(min_p=0.5, temperature=0)
    check_engine(greedy, [1], max_model_len=CONTEXT, vocab_size=VOCAB, speculative=True)
    assert _engine_refusal(_chat(thinking_token_budget=10)) == (
        None,
        "thinking_token_budget is set but reasoning_config is not configured. Please set "
        "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.",
    )
    check_engine(_chat(thinking_token_budget=-1), [1], max_model_len=CONTEXT, vocab_size=VOCAB)


def test_the_engine_refuses_a_prompt_it_cannot_hold() -> None:
    request = _completion()
    assert _engine_refusal(request, []) == (None, "The decoder prompt cannot be empty")
    assert _engine_refusal(request, [1, -5, 7]) == (None, "Token id -5 is out of vocabulary")
    assert _engine_refusal(request, [1, 1000, 7]) == (None, "Token id 1000 is out of vocabulary")
    assert _engine_refusal(request, [1] * CONTEXT)[1] == (
        "The decoder prompt (length 100) plus the number of requested output tokens (at least 1) "
        "is longer than the maximum model length of 100. Make sure that `max_model_len` is no "
        "smaller than the number of text tokens (prompt + requested output tokens)."
    )


def test_context_length_in_vllms_order() -> None:
    error = context_length_error(CONTEXT, 150, 101)
    assert error is not None and error.message == (
        "max_tokens=101 cannot be greater than max_model_len=100. Please request fewer output "
        "tokens. (parameter=max_tokens, value=101)"
    )
    error = context_length_error(CONTEXT, 150, 5, truncate_prompt_tokens=200)
    assert error is not None and error.param == "truncate_prompt_tokens"
    error = context_length_error(CONTEXT, 150, 5, from_text=True)
    assert error is not None and error.message == (
        "This model's maximum context length is 100 tokens. However, your prompt contains at "
        "least 101 input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt. (parameter=input_tokens, value=101)"
    )
    error = context_length_error(CONTEXT, 150, 5)
    assert error is not None and "contains 150 input tokens" in error.message
    assert context_length_error(CONTEXT, 100, 5) is None
    assert context_length_error(CONTEXT, 90, 100, max_tokens_param="max_completion_tokens") is None


def test_max_tokens_shrinks_to_the_context_left() -> None:
    assert effective_max_tokens(CONTEXT, 90, _completion(max_tokens=50)) == 10
    assert effective_max_tokens(CONTEXT, 90, _completion()) == 10
    assert effective_max_tokens(CONTEXT, 10, _completion()) == 16
    assert effective_max_tokens(CONTEXT, 10, _chat()) == 90
    both = _chat(max_tokens=5, max_completion_tokens=7)
    assert (effective_max_tokens(CONTEXT, 10, both), requested_max_tokens(both)) == (
        7,
        (7, "max_completion_tokens"),
    )
    assert requested_max_tokens(_completion(max_tokens=0)) == (0, "max_tokens")
    echo = _completion(max_tokens=0, echo=True)
    assert (echo_only(echo), effective_max_tokens(CONTEXT, 10, echo)) == (True, 0)
    check_sampling(echo, 0)
    with pytest.raises(ApiError, match=r"^max_tokens must be at least 1, got 0\. "):
        check_sampling(_completion(max_tokens=0), 0)


def test_sample_logprobs_follow_vllms_mapping() -> None:
    assert sample_logprobs(_completion(logprobs=3)) == 3
    assert sample_logprobs(_completion(logprobs=3, logprob_token_ids=[1, 2])) is None
    assert sample_logprobs(_chat(logprobs=True, top_logprobs=4)) == 4
    assert sample_logprobs(_chat(logprobs=False)) is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"suffix": "z", "echo": True}, "suffix", "Echo is unsupported with suffix."),
        (
            {"suffix": "z"},
            "suffix",
            "suffix is only supported for models with FIM completion rendering",
        ),
        (
            {"suffix": "z", "prompt": [1, 2]},
            "suffix",
            "suffix requires text prompt input for FIM completion rendering",
        ),
        ({"prompt_embeds": "abc", "echo": True}, None, "Echo is unsupported with prompt embeds."),
        (
            {"prompt_embeds": "abc"},
            "prompt_embeds",
            "You must set `--enable-prompt-embeds` to input `prompt_embeds`. "
            "(parameter=prompt_embeds)",
        ),
    ],
)
def test_completion_prompts_this_engine_cannot_render(
    fields: dict[str, Any], param: str | None, message: str
) -> None:
    with pytest.raises(ApiError) as info:
        check_completion_prompt(_completion(**fields))
    assert (info.value.param, info.value.message, info.value.type) == (
        param,
        message,
        "BadRequestError",
    )


def test_error_builders_answer_as_vllm() -> None:
    answers = {
        "media": unsupported_media_type().body(),
        "parse": body_parse_error().body(),
        "route": route_not_found().body(),
        "method": method_not_allowed().body(),
        "dead": engine_dead().body(),
        "backlog": prefill_backlog_full().body(),
        "empty": empty_prompt().body(),
        "vocab": token_out_of_vocabulary(7, param="kv_transfer_params.prompt_token_ids").body(),
        "chars": prompt_chars_error(100, 5000, 30).body(),
        "http": http_error(413, "Request body too large").body(),
        "beam": beam_search_stream().body(),
    }
    assert answers == {
        "media": b'{"error":{"message":"1 validation error:\\n  Unsupported Media Type: Only '
        b'\'application/json\' is allowed","type":"Bad Request","param":null,"code":400}}',
        "parse": b'{"detail":"There was an error parsing the body"}',
        "route": b'{"detail":"Not Found"}',
        "method": b'{"detail":"Method Not Allowed"}',
        "dead": b'{"error":{"message":"The server had an error while processing your request.",'
        b'"type":"InternalServerError","param":null,"code":500}}',
        "backlog": b'{"error":{"message":"The engine has reached its prefill token backlog limit. '
        b'Please try again later or on a different instance.","type":"Service Unavailable",'
        b'"param":null,"code":503}}',
        "empty": b'{"error":{"message":"The decoder prompt cannot be empty","type":'
        b'"BadRequestError","param":null,"code":400}}',
        "vocab": b'{"error":{"message":"Token id 7 is out of vocabulary (parameter=kv_transfer_'
        b'params.prompt_token_ids)","type":"BadRequestError","param":"kv_transfer_params.prompt'
        b'_token_ids","code":400}}',
        "chars": b'{"error":{"message":"This model\'s maximum context length is 100 tokens. '
        b"However, your prompt contains 5000 characters (more than 3000 characters, which is "
        b"the upper bound for 100 input tokens). Please reduce the length of the input prompt. "
        b'(parameter=input_text, value=5000)","type":"BadRequestError","param":"input_text",'
        b'"code":400}}',
        "http": b'{"error":{"message":"Request body too large","type":"Request Entity Too Large",'
        b'"param":null,"code":413}}',
        "beam": b'{"error":{"message":"Streaming is not currently supported with beam search",'
        b'"type":"BadRequestError","param":null,"code":400}}',
    }
    assert [route_not_found().status, method_not_allowed().status] == [404, 405]


def test_messages_are_sanitized_as_vllm_does() -> None:
    error = ApiError(400, "bad <obj at 0xdeadbeef> in /home/u/m.bin and /a/b/c.txt  ", "X")
    assert error.message == "bad <obj> in <path> and <path>"
