"""Chat templates rendered as transformers renders them, inside bounds a request cannot pass.

The environment is transformers' (`apply_chat_template`): jinja2's immutable sandbox with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and the `{% generation %}`
tag, `raise_exception` and `strftime_now`, and a `tojson` filter that does not escape HTML.
So a model's template gives the prompt that vLLM would give it, byte for byte.

The sandbox refuses attribute access to Python internals and any mutation of the inputs, and
jinja2 refuses a `range` past 100,000 items. It cannot stop a template from looping long
over a small input or from building a huge string, so a render also has bounds of its own
(README, "Limits and guarantees"): `range` hands out at most `RANGE_BUDGET` items in all,
`*` and `**` refuse results past `MAX_RENDERED_CHARS` items or `MAX_POWER_BITS` bits, and
the output stops at `MAX_RENDERED_CHARS` characters. A template that keeps within them but
loops over the messages quadratically still takes its time: a template supplied by a
request is the serving layer's to refuse, as vLLM refuses it by default.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

ContentFormat = Literal["string", "openai"]

MISSING_TEMPLATE: Final = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must "
    "provide a chat template if the tokenizer does not define one."
)
MAX_RENDERED_CHARS: Final = 64 * 2**20
RANGE_BUDGET: Final = 1_000_000
MAX_POWER_BITS: Final = 65_536
# The parameters of transformers' apply_chat_template: a request may set them through
# chat_template_kwargs although the template does not name them (vLLM lets them through).
HF_PARAMETERS: Final = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
_REFUSED_KWARGS: Final = frozenset({"chat_template", "tokenize"})
_CONTINUE_TAG: Final = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(Exception):
    """The request's messages cannot be rendered; the message is vLLM's (a 400 for the client)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant spans with it;
    the text renders unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with `*` and `**` refusing results past the render's bounds."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        if operator == "*":
            for items, times in ((left, right), (right, left)):
                if (
                    isinstance(items, str | list | tuple)
                    and isinstance(times, int)
                    and len(items) * times > MAX_RENDERED_CHARS
                ):
                    raise SecurityError(
                        f"the template repeats a sequence past {MAX_RENDERED_CHARS} items"
                    )
        elif (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and abs(left).bit_length() * right > MAX_POWER_BITS
        ):
            raise SecurityError(f"the template computes a power past {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> _BoundedSandbox:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _RangeBudget:
    """`range` for one render: jinja2's sandboxed range, at most RANGE_BUDGET items in all."""

    def __init__(self) -> None:
        self.left = RANGE_BUDGET

    def __call__(self, *args: int) -> range:
        items = safe_range(*args)
        self.left -= len(items)
        if self.left < 0:
            raise SecurityError(
                f"the template's ranges hand out more than {RANGE_BUDGET} items in all"
            )
        return items


def _reason(exc: BaseException) -> str:
    """vLLM's reason for a failed render: the innermost jinja2 error's text, else the error's."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc) or type(exc).__name__


class ChatTemplate:
    """One compiled template, with what vLLM reads off its source."""

    def __init__(self, source: str) -> None:
        self.source = source
        env = _environment()
        try:
            tree = env.parse(source)
            self._template = env.from_string(tree)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(tree))
        self.content_format: ContentFormat = "openai" if _loops_over_content(tree) else "string"
        self.supports_developer_role = '"developer"' in source or "'developer'" in source

    def template_kwargs(self, chat_template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The request's `chat_template_kwargs` that reach the template, as vLLM filters them.

        Raises:
            ChatTemplateError: `chat_template` or `tokenize` among them.
        """
        refused = _REFUSED_KWARGS & chat_template_kwargs.keys()
        if refused:
            raise ChatTemplateError(
                f"Found unexpected chat template kwargs from request: {set(sorted(refused))}"
            )
        accepted = self.variables | HF_PARAMETERS
        return {k: v for k, v in chat_template_kwargs.items() if k in accepted}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        documents: Sequence[Mapping[str, Any]] | None,
        variables: Mapping[str, Any],
    ) -> str:
        """The prompt text; `variables` are the special tokens and the template kwargs.

        Raises:
            ChatTemplateError: the template raised, broke a bound, or cannot continue the
                final message.
        """
        if not messages:
            raise ChatTemplateError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final "
                "message, and add_generation_prompt when you want to add a header that will "
                "prompt it to start a new assistant message instead."
            )
        final = _mark_final_message(messages, self.source) if continue_final_message else ""
        context = {
            **{k: v for k, v in variables.items() if k not in HF_PARAMETERS},
            "messages": messages,
            "tools": None if tools is None else list(tools),
            "documents": None if documents is None else list(documents),
            "add_generation_prompt": add_generation_prompt,
            "range": _RangeBudget(),
        }
        try:
            rendered = "".join(_bounded(self._template.generate(context)))
        except ChatTemplateError:
            raise
        except Exception as exc:  # whatever the template raised (jinja2 or Python)
            raise ChatTemplateError(" ".join(_reason(exc).split())) from None
        return _cut_at_final_message(rendered, final) if continue_final_message else rendered


def _bounded(chunks: Iterator[str]) -> Iterator[str]:
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise ChatTemplateError(
                f"the chat template renders more than {MAX_RENDERED_CHARS} characters"
            )
        yield chunk


def _mark_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """Tag the final message's text as transformers does; return that text."""
    last = dict(messages[-1])
    messages[-1] = last
    content = last.get("content")
    if content is None:
        raise ChatTemplateError(
            'continue_final_message is set but the final message has no "content" to continue!'
        )
    if "content" not in source:
        raise ChatTemplateError(
            'continue_final_message is set to "content" but this is not an accepted field '
            "in the chat_template"
        )
    if isinstance(content, list):
        parts = [dict(part) if isinstance(part, dict) else part for part in content]
        last["content"] = parts
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError(
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!"
        )
    last["content"] = str(content) + _CONTINUE_TAG
    return str(content)


def _cut_at_final_message(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message "
            "in your chat to ensure they are compatible."
        )
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> ChatTemplate:
    """A compiled template, cached: a request may name the same template again and again."""
    return ChatTemplate(source)


def _unwrapped(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """The expression under filters, tests and slices (`messages[1:] | list`)."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        return _unwrapped(node.node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _unwrapped(node.node)
    return node


def _accesses(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """`node` reads one of `names` (or its `key` item), through filters, tests and slices."""
    node = _unwrapped(node)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _accesses(node.node, names)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _accesses(node.node, names) and node.attr == key
    return False


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (vLLM's "openai" format),
    following the names assigned from `messages` (`{% set loop_messages = messages[1:] %}`)."""
    lists = {"messages"}
    grown = True
    while grown:
        grown = False
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in lists
                and _accesses(assign.node, lists)
            ):
                lists.add(target.name)
                grown = True
    loops = list(tree.find_all(jinja2.nodes.For))
    items = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name) and _accesses(loop.iter, lists)
    }
    in_macros = {
        id(loop)
        for macro in tree.find_all(jinja2.nodes.Macro)
        for loop in macro.find_all(jinja2.nodes.For)
    }
    return any(
        _accesses(loop.iter, items, "content")
        or (id(loop) not in in_macros and _accesses(loop.iter, {"content"}))
        for loop in loops
    )
