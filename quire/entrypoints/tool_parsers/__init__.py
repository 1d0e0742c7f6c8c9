"""Tool-call parsers by vLLM's names (`--tool-call-parser`): they find the function calls in a
model's output for `tool_choice="auto"`."""

from __future__ import annotations

from quire.entrypoints.tool_parsers.base import (
    FunctionCall,
    ParsedOutput,
    ToolCallStream,
    ToolParser,
    assistant_message,
    tool_call_json,
)
from quire.entrypoints.tool_parsers.hermes import HermesToolParser
from quire.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}

__all__ = [
    "TOOL_PARSERS",
    "FunctionCall",
    "ParsedOutput",
    "ToolCallStream",
    "ToolParser",
    "assistant_message",
    "tool_call_json",
]
