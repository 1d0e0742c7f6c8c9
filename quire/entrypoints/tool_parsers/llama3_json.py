"""`llama3_json`: Llama 3.1-3.3's JSON tool calls. The output is one or more objects
`{"name": ..., "parameters": {...}}` ("arguments" is accepted too) separated by `;`, optionally
after `<|python_tag|>`; an output that does not start with an object (or the tag) is content.

Text after the last call, or an object that is not a call, is content from there on.
"""

from __future__ import annotations

import json

from quire.entrypoints.tool_parsers.base import (
    FunctionCall,
    ParsedOutput,
    ToolParser,
    function_call,
)

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"
_decoder = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = len(text) - len(text.lstrip())
        rest = text[start:]
        if not final and PYTHON_TAG.startswith(rest):  # nothing, or the tag's beginning
            return ParsedOutput("")
        if rest.startswith(PYTHON_TAG):
            start += len(PYTHON_TAG)
        elif not rest.startswith("{"):
            return ParsedOutput(text)
        calls: list[FunctionCall] = []
        pos = start
        while True:
            while pos < len(text) and text[pos] in _SEPARATORS:
                pos += 1
            if pos == len(text):
                break
            if text[pos] != "{":
                return ParsedOutput(_content(text, calls, pos), calls)
            try:
                obj, end = _decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                if final:  # an object that never closed, or is not JSON
                    return ParsedOutput(_content(text, calls, pos), calls)
                break  # may still be arriving
            call = function_call(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedOutput(_content(text, calls, pos), calls)
            calls.append(call)
            pos = end
        return ParsedOutput("" if calls or not final else text, calls)


def _content(text: str, calls: list[FunctionCall], pos: int) -> str:
    """The content once parsing stopped at `pos`: the rest, or all of it if no call came first."""
    return text[pos:] if calls else text
