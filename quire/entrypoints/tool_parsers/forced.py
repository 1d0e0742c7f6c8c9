"""Parsers for the calls that tool_choice "required" and a named function force.

The output is generated under a JSON schema (structured outputs), so its shape is known:
"required" writes a JSON array of `{"name": ..., "parameters": {...}}` objects (one or more
calls, vLLM's format), a named function writes the arguments object alone. While streaming, a
call is reported once its object is complete; the content is always empty.
"""

from __future__ import annotations

import json

from quire.entrypoints.tool_parsers.base import (
    FunctionCall,
    ParsedOutput,
    ToolParser,
    function_call,
)

_decoder = json.JSONDecoder()
_SEPARATORS = " \t\r\n,"


class RequiredCallsParser(ToolParser):
    """tool_choice "required": a JSON array of calls."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[FunctionCall] = []
        pos = text.find("[") + 1
        if pos == 0:
            return ParsedOutput("")
        while True:
            while pos < len(text) and text[pos] in _SEPARATORS:
                pos += 1
            if pos == len(text) or text[pos] == "]":
                break
            try:
                obj, pos = _decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # still arriving, or cut short by max_tokens
            call = function_call(obj, ("parameters",))
            if call is None:
                break
            calls.append(call)
        return ParsedOutput("", calls)


class NamedFunctionParser(ToolParser):
    """tool_choice naming a function: the output is that call's arguments. A call forced by
    name finishes with "stop", as on OpenAI's API (and vLLM's)."""

    name = "named"
    calls_finish_reason = "stop"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        if not final:
            return ParsedOutput("")
        return ParsedOutput("", [FunctionCall(self.function_name, text.strip())])
