"""Chat templates rendered exactly as transformers and vLLM render them, and the sandbox."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engined.openai.chat_template import (
    MAX_POWER_BITS,
    MAX_RENDERED_CHARS,
    MISSING_TEMPLATE,
    RANGE_BUDGET,
    ChatTemplateError,
    compile_template,
)
from engined.openai.model_source import DEFAULT_MODEL_DIR
from engined.openai.tokenizer import Tokenizer, load_tokenizer

# Llama 3's layout: BOS, a header per message, the content trimmed, <|eot_id|>.
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
PARTS = (
    "{% for m in messages %}{% for p in m['content'] %}[{{ p.type }}:{{ p.text }}]{% endfor %}"
    "{% endfor %}"
)
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": [{"type": "text", "text": "one"}, "two", {"type": "text"}]},
]


@pytest.fixture(scope="module")
def builtin() -> Tokenizer:
    return load_tokenizer(None, None)


def model_with(tmp_path: Path, **config: Any) -> Tokenizer:
    """The embedded tokenizer under another tokenizer_config.json."""
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(path), None)


def test_the_embedded_chatml_template(builtin: Tokenizer) -> None:
    expected = (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\none\ntwo<|im_end|>\n"
    )
    assert builtin.apply_chat_template(CHAT, add_generation_prompt=False) == expected
    assert builtin.apply_chat_template(CHAT) == expected + "<|im_start|>assistant\n"
    prompt = builtin.apply_chat_template([{"role": "assistant", "content": None}])
    assert prompt == "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
    assert builtin.encode(prompt) == [2, 2279, 4, 3, 4, 2, 2279, 4]


def test_a_llama3_style_template(tmp_path: Path) -> None:
    tokenizer = model_with(tmp_path, bos_token="<|begin_of_text|>", chat_template=LLAMA3)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "  What is 2+2?\n"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
    )
    assert tokenizer.apply_chat_template(messages) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_content_is_a_list_of_parts_for_templates_that_iterate_over_it(tmp_path: Path) -> None:
    tokenizer = model_with(tmp_path, chat_template=PARTS)
    assert compile_template(PARTS).content_format == "openai"
    assert tokenizer.apply_chat_template(CHAT[1:]) == (
        "[text:hi there][text:hello][text:one][text:two]"
    )
    aliased = (
        "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
        "{% for p in m.content | list %}{{ p.text }};{% endfor %}{% endfor %}"
    )
    assert compile_template(aliased).content_format == "openai"
    assert tokenizer.apply_chat_template(CHAT, chat_template=aliased) == "hi there;hello;one;two;"
    assert compile_template(LLAMA3).content_format == "string"


def test_templates_by_name_and_from_the_request(tmp_path: Path, builtin: Tokenizer) -> None:
    named = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length if tools else 0 }}"},
    ]
    tokenizer = model_with(tmp_path, chat_template=named)
    assert tokenizer.apply_chat_template(CHAT) == "D4"
    assert tokenizer.apply_chat_template(CHAT, tools=[{"type": "function"}]) == "T1"
    assert tokenizer.apply_chat_template(CHAT, chat_template="tool_use") == "T0"
    assert builtin.apply_chat_template(CHAT, chat_template="{{ eos_token }}") == "<|im_end|>"


def test_a_model_without_a_template_gets_vllms_message(tmp_path: Path) -> None:
    tokenizer = model_with(tmp_path, eos_token="<|im_end|>")
    with pytest.raises(ChatTemplateError) as refused:
        tokenizer.apply_chat_template(CHAT)
    assert str(refused.value) == MISSING_TEMPLATE


def test_raise_exception_and_the_template_globals(builtin: Tokenizer) -> None:
    alternate = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError) as refused:
        builtin.apply_chat_template(CHAT, chat_template=alternate)
    assert str(refused.value) == "Conversation roles must alternate user/assistant"
    to_json = "{{ messages[0].content | tojson }}|{{ {'a': [1]} | tojson(indent=1) }}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "<b>é</b> & 'q'"}]
    assert builtin.apply_chat_template(messages, chat_template=to_json) == (
        '"<b>é</b> & \'q\'"|{\n "a": [\n  1\n ]\n}'
    )
    year = builtin.apply_chat_template(messages, chat_template="{{ strftime_now('%Y') | int }}")
    assert 2024 <= int(year) <= 9999
    loops = (
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}"
        "{% endfor %}"
    )
    assert builtin.apply_chat_template(CHAT, chat_template=loops) == "userassistantuser"
    tagged = "{% generation %}{{ messages[0].role }}{% endgeneration %}"
    assert builtin.apply_chat_template(CHAT, chat_template=tagged) == "system"


def test_chat_template_kwargs_reach_the_template_as_vllm_filters_them(builtin: Tokenizer) -> None:
    template = (
        "{{ enable_thinking }}|{{ unknown_flag is defined }}|{{ add_generation_prompt }}"
        "|{{ documents | length }}"
    )
    kwargs: dict[str, Any] = {"enable_thinking": False, "other": 1, "add_generation_prompt": False}
    kwargs["documents"] = [{"title": "t", "text": "x"}]
    assert (
        builtin.apply_chat_template(CHAT, chat_template=template, chat_template_kwargs=kwargs)
        == "False|False|True|1"
    )
    with pytest.raises(ChatTemplateError) as refused:
        builtin.apply_chat_template(CHAT, chat_template_kwargs={"tokenize": True})
    assert str(refused.value) == "Found unexpected chat template kwargs from request: {'tokenize'}"


def test_continue_final_message(builtin: Tokenizer) -> None:
    messages: list[dict[str, Any]] = [*CHAT[:2], {"role": "assistant", "content": "the answer is"}]
    assert builtin.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    ) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\nthe answer is"
    )
    assert messages[-1] == {"role": "assistant", "content": "the answer is"}
    with pytest.raises(ChatTemplateError, match=r"^continue_final_message and add_generation"):
        builtin.apply_chat_template(messages, continue_final_message=True)


def test_developer_messages_become_system_ones_unless_the_template_knows_them(
    builtin: Tokenizer,
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "rule one"},
        {"role": "system", "content": [{"type": "text", "text": "rule two"}]},
    ]
    assert builtin.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nrule one\n\nrule two<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"
    assert builtin.apply_chat_template(messages, chat_template=knows) == "D"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        pytest.param(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "Unsupported chat content part type: 'image_url'. Supported types: input_text, "
            "output_text, refusal, text, thinking.",
            id="image",
        ),
        pytest.param(
            [{"role": "user", "content": [{"text": "x"}]}],
            "Missing 'type' field in multimodal part.",
            id="no-type",
        ),
        pytest.param(
            [{"role": "user", "content": 5}],
            "the content of a user message must be a string or a list of parts",
            id="content-int",
        ),
        pytest.param([{"content": "x"}], "each message must be an object with a string 'role'"),
        pytest.param(
            [], "Cannot apply chat template to an empty conversation. Provide at least one message."
        ),
    ],
)
def test_malformed_messages_are_refused(
    builtin: Tokenizer, messages: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ChatTemplateError) as refused:
        builtin.apply_chat_template(messages)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("template", "message"),
    [
        pytest.param(
            "{{ messages.__class__.__mro__ }}",
            "access to attribute '__class__' of 'list' object is unsafe.",
            id="dunder",
        ),
        pytest.param(
            "{% for m in messages %}{{ messages.append(m) }}{% endfor %}",
            "access to attribute 'append' of 'list' object is unsafe.",
            id="mutation-loop",
        ),
        pytest.param(
            "{% for i in range(10 ** 12) %}x{% endfor %}",
            "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).",
            id="range",
        ),
        pytest.param(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            f"the template's ranges hand out more than {RANGE_BUDGET} items in all",
            id="nested-ranges",
        ),
        pytest.param(
            "{{ 'x' * 10 ** 12 }}",
            f"the template repeats a sequence past {MAX_RENDERED_CHARS} items",
            id="repeat",
        ),
        pytest.param(
            "{{ 7 ** 100000 }}",
            f"the template computes a power past {MAX_POWER_BITS} bits",
            id="power",
        ),
        pytest.param(
            "{% for i in range(100000) %}{% for m in messages %}{{ m.content }}{% endfor %}"
            "{% endfor %}",
            f"the chat template renders more than {MAX_RENDERED_CHARS} characters",
            id="output",
        ),
        pytest.param(
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "maximum recursion depth exceeded",
            id="recursion",
        ),
        pytest.param(
            "{% for m in messages %}",
            "the chat template does not compile: Unexpected end of template.",
            id="syntax",
        ),
    ],
)
def test_the_sandbox_refuses_unsafe_and_unbounded_templates(
    builtin: Tokenizer, template: str, message: str
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "x" * 1000}]
    with pytest.raises(ChatTemplateError) as refused:
        builtin.apply_chat_template(messages, chat_template=template)
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)
    assert messages == [{"role": "user", "content": "x" * 1000}]
