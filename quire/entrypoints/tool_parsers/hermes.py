"""`hermes`: calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes,
Qwen2.5/3, SmolLM2's tool format), any number of them, with text around them as content.

A block whose JSON is not a call stays in the content as written; an unclosed block at the end
of the output is a call if its JSON is complete (a model may stop right after the object).
"""

from __future__ import annotations

import json

from quire.entrypoints.tool_parsers.base import (
    FunctionCall,
    ParsedOutput,
    ToolParser,
    function_call,
    partial_suffix_len,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[FunctionCall] = []
        pos = 0
        while True:
            start = text.find(OPEN_TAG, pos)
            if start == -1:
                tail = text[pos:]
                if not final:  # the end may be the beginning of a tag
                    tail = tail[: len(tail) - partial_suffix_len(tail, OPEN_TAG)]
                content.append(tail)
                break
            end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
            block_end = len(text) if end == -1 else end
            # The last opening tag before the block's end opens it: earlier ones are prose
            # ("answer with a <tool_call> block: <tool_call>{...}</tool_call>").
            start = text.rfind(OPEN_TAG, start, block_end)
            content.append(text[pos:start])
            if end == -1 and not final:  # still arriving
                break
            call = _parse_call(text[start + len(OPEN_TAG) : block_end])
            pos = len(text) if end == -1 else end + len(CLOSE_TAG)
            if call is None:
                content.append(text[start:pos])
            else:
                calls.append(call)
            if end == -1:
                break
        return ParsedOutput("".join(content), calls)


def _parse_call(body: str) -> FunctionCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return function_call(obj, ("arguments",))
