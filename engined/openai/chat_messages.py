"""OpenAI chat messages as vLLM hands them to a chat template.

vLLM reads each message's content as a list of parts and gives the template either one
string (the "string" content format: the text parts joined with newlines) or the list of
`{"type": "text", "text": ...}` parts (the "openai" format), whichever the template iterates
over (engined/openai/chat_template.py detects it). Assistant tool calls get their JSON
`arguments` as objects, and a `developer` message becomes a `system` one when the template
does not know that role. engined serves text only: a part that is not text is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from engined.openai.chat_template import ChatTemplateError, ContentFormat

# vLLM's text part types, and the field each keeps its text in.
TEXT_PARTS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def _texts(role: str, content: object) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"the content of a {role} message must be a string or a list of parts"
        )
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError("a content part must be an object with a 'type'")
        kind = part.get("type")
        if kind is None:
            raise ChatTemplateError("Missing 'type' field in multimodal part.")
        if not isinstance(kind, str):
            raise ChatTemplateError("Invalid 'type' field in multimodal part.")
        if kind not in TEXT_PARTS:
            raise ChatTemplateError(
                f"Unsupported chat content part type: {kind!r}. Supported types: "
                f"{', '.join(sorted(TEXT_PARTS))}."
            )
        text = part.get(TEXT_PARTS[kind])
        if text is None:
            continue  # vLLM skips a text part without text
        if not isinstance(text, str):
            raise ChatTemplateError(f"the {TEXT_PARTS[kind]!r} of a {kind!r} part must be a string")
        texts.append(text)
    return texts


def _tool_calls(calls: object) -> list[Any] | None:
    """Assistant tool calls with `arguments` as an object (JSON text parsed, else {})."""
    if not isinstance(calls, list):
        return None
    if not calls:
        return None
    parsed: list[Any] = []
    for call in calls:
        if not isinstance(call, Mapping):
            raise ChatTemplateError("assistant tool_calls entries must be objects.")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ChatTemplateError(
                "chat completions only support assistant tool_calls of type 'function'."
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's rewrite for templates without a developer role: developer messages become
    system ones, all merged into one at the front when they are not already alone there."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or index > 0 or bool(systems)
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(
                str(p["text"]) if isinstance(p, dict) else str(p)
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            systems.append(str(content))
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


def prepare_messages(
    messages: Sequence[Mapping[str, Any]],
    content_format: ContentFormat,
    *,
    supports_developer_role: bool,
) -> list[dict[str, Any]]:
    """The messages as the template sees them (fresh dicts; the input is not changed).

    Raises:
        ChatTemplateError: a message is not an object with a string `role`, or has a part
            that is not text.
    """
    prepared: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError("each message must be an object with a string 'role'")
        role: str = message["role"]
        texts = _texts(role, message.get("content"))
        result: dict[str, Any] = {"role": role}
        if content_format == "openai":
            result["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            result["content"] = "\n".join(texts)
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"))
            if calls is not None:
                result["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if isinstance(reasoning, str):
                result["reasoning"] = result["reasoning_content"] = reasoning
        elif role == "tool":
            # Most templates want a tool's result as one string, whatever the format.
            result["content"] = "\n".join(texts)
            if "tool_call_id" in message:
                result["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        if role == "developer":
            result["tools"] = message.get("tools")
        prepared.append(result)
    if not supports_developer_role and any(m["role"] == "developer" for m in prepared):
        prepared = _developer_as_system(prepared)
    return prepared
