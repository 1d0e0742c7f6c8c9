"""The tool-parser contract and what the server builds on it.

A parser reads a model's output text and splits it into content and the function calls it
contains. `parse(text, final=False)` is asked about a prefix of the output while it streams: its
content then leaves out whatever could still turn into a call (an unclosed `<tool_call>`, a
partial tag at the end), and its calls are only the complete ones. Parsers promise that the
content of a prefix is a prefix of the content of any longer text, and the same of the calls;
`ToolCallStream` relies on it to stream deltas by re-parsing the text so far, which makes the
streamed content and calls equal to the non-streamed ones by construction.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass
class ParsedOutput:
    content: str
    calls: list[FunctionCall] = field(default_factory=list)


class ToolParser(ABC):
    """Splits model output into content and function calls (see the module's contract)."""

    name: str
    # A choice that called and then stopped ends with this finish_reason.
    calls_finish_reason = "tool_calls"

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput: ...


def function_call(obj: Any, argument_keys: tuple[str, ...]) -> FunctionCall | None:
    """`{"name": str, <argument key>: {...}}` as a FunctionCall; None for anything else. A missing
    argument object means no arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (0 if none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: FunctionCall) -> dict[str, Any]:
    return {
        "id": tool_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def assistant_message(
    parser: ToolParser, text: str, max_calls: int | None
) -> tuple[str | None, list[FunctionCall]]:
    """A whole output's message content and calls (at most `max_calls`). With calls, the
    content is the text around them with trailing whitespace cut, or None when only
    whitespace; without, it is the text as the model wrote it."""
    parsed = parser.parse(text, final=True)
    calls = parsed.calls[:max_calls]
    if not calls:
        return parsed.content, []
    return parsed.content.rstrip() or None, calls


class ToolCallStream:
    """One streamed choice: `update(text so far)` gives the new content and the new calls to
    send. Trailing whitespace is held back (it is cut if calls follow), so the pieces join to
    what `assistant_message` returns for the whole text."""

    def __init__(self, parser: ToolParser, max_calls: int | None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.num_content_chars = 0
        self.num_calls = 0

    def update(self, text: str, final: bool) -> tuple[str, list[FunctionCall]]:
        if final:
            content, calls = assistant_message(self.parser, text, self.max_calls)
            content = content or ""
        else:
            parsed = self.parser.parse(text, final=False)
            content, calls = parsed.content.rstrip(), parsed.calls[: self.max_calls]
        new_content = content[self.num_content_chars :]
        new_calls = calls[self.num_calls :]
        self.num_content_chars = len(content)
        self.num_calls = len(calls)
        return new_content, new_calls
