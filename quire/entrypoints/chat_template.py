"""Chat prompts: `render_chat` turns OpenAI-style messages (and tools) into the prompt text through
the model's chat template or an override. `LLM.chat`, the server and `quire chat` all render here,
so a conversation gives the same prompt everywhere.

Messages are checked and normalized first (content parts joined, null content as "", tool-call
arguments parsed from their JSON string, as Hermes-style templates print them with `tojson`); a
bad message, a template that cannot render the conversation, or a model without a template raise
ValueError saying what to change.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Keys a template may read; others (refusal, audio, ...) come back when a client sends a response
# message back as history and do not change the prompt.
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
_CHECK_CONVERSATION = [{"role": "user", "content": "Hi"}]


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> str:
    """The prompt text of `messages` (and `tools`, for templates that show them) under
    `chat_template`, or the model's own template when None."""
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ValueError(
            "This model has no chat template: pass one (--chat-template PATH, or chat_template=) "
            "or send a plain prompt to completions."
        )
    conversation = normalize_messages(messages)
    tool_list = check_tools(tools) if tools else None
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tools=tool_list,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as error:
        # Rendering is a pure function of the conversation and the template (a Jinja program
        # that may raise anything, e.g. raise_exception("roles must alternate") or a TypeError
        # on a field it did not expect): whatever it raises, this conversation cannot be
        # rendered by this template.
        raise ValueError(f"The chat template cannot render these messages: {error}") from error


def load_chat_template(path: str) -> str:
    """The text of a Jinja chat template file (`--chat-template PATH`), its syntax checked, so
    that a broken file is refused before the model loads."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise ValueError(f"--chat-template: cannot read {path!r}: {error.strerror}") from error
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template: {path!r} is not UTF-8 text") from None
    try:
        _compile_jinja_template(text)  # what apply_chat_template compiles (cached)
    except TemplateSyntaxError as error:
        raise ValueError(
            f"--chat-template: {path!r} line {error.lineno}: {error.message}"
        ) from None
    return text


def check_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: str) -> None:
    """Raises ValueError at startup when `chat_template` cannot render a one-message
    conversation (a syntax error, say), rather than on every request."""
    render_chat(tokenizer, _CHECK_CONVERSATION, chat_template=chat_template)


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a list of at least one message.")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be a dict with a string 'role'.")
    normalized = {key: message[key] for key in _MESSAGE_KEYS if message.get(key) is not None}
    normalized["content"] = _content_text(where, message.get("content"))
    if "tool_calls" in normalized:
        normalized["tool_calls"] = [
            _template_tool_call(f"{where}.tool_calls[{j}]", call)
            for j, call in enumerate(normalized["tool_calls"])
        ]
    return normalized


def _content_text(where: str, content: Any) -> str:
    """A message's content as one string: null is "", text parts are joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"{where}.content: only parts of type 'text' are supported.")
            texts.append(part.get("text") or "")
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string, a list of text parts, or null.")


def _template_tool_call(where: str, call: Any) -> dict[str, Any]:
    """An assistant message's tool call with its arguments as an object, as templates print
    them. Arguments that are not a JSON object (a model can write broken JSON, and clients send
    its calls back as history) reach the template as the string they are."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}.")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    elif not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object or its string.")
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def check_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's tool list: [{"type": "function", "function": {"name": ..., ...}}, ...]."""
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}.")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}."
            )
    return list(tools)
