"""Which tool parser reads a chat request's output, from its `tools` and `tool_choice` and what
the server was started with, and the constraint that forces a call.

`tool_choice` defaults to "auto" when tools are given and "none" otherwise (OpenAI's rule).
"none" hands the tools to the template and reads the output as plain content. "auto" needs the
server's `--enable-auto-tool-choice` with a `--tool-call-parser`: the output is parsed for calls.
"required" and a named function force the call with structured outputs (vLLM's way): the
output is generated under a JSON schema built from the functions' `parameters`, so the
arguments always validate. "required" writes a JSON array of `{"name", "parameters"}` objects
(exactly one with `parallel_tool_calls` false); a named function writes its arguments alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quire.entrypoints.openai_protocol import ChatCompletionTool, NamedToolChoice
from quire.entrypoints.tool_parsers import ToolParser
from quire.entrypoints.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from quire.sampling_params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function without `parameters`


@dataclass
class ToolChoice:
    parser: ToolParser | None  # None: the output is plain content
    structured_outputs: StructuredOutputsParams | None = None  # forces the call, if it must


def request_tool_choice(
    tools: list[ChatCompletionTool] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool,
    auto_tool_parser: type[ToolParser] | None,
) -> ToolChoice:
    """How this request's output is read and constrained. Raises ValueError (starting with the
    field at fault) for a choice this server cannot honour."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice(None)
    if not tools:
        raise ValueError("tool_choice needs tools: give the functions the model may call.")
    if tool_choice == "auto":
        if auto_tool_parser is None:
            raise ValueError(
                'tool_choice "auto" (the default when tools are given) needs a server started '
                "with --enable-auto-tool-choice and --tool-call-parser; or send "
                'tool_choice "none".'
            )
        return ToolChoice(auto_tool_parser())
    if tool_choice == "required":
        schema = required_calls_schema(tools, parallel_tool_calls)
        return ToolChoice(RequiredCallsParser(), StructuredOutputsParams(json=schema))
    name = tool_choice.function.name
    function = next((t.function for t in tools if t.function.name == name), None)
    if function is None:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools.")
    schema = function.parameters or _ANY_OBJECT
    return ToolChoice(NamedFunctionParser(name), StructuredOutputsParams(json=schema))


def required_calls_schema(tools: list[ChatCompletionTool], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls (exactly one unless parallel), each
    `{"name": <a function's>, "parameters": <its arguments>}`."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema
