"""Which tool parser reads a chat request's output, from its `tools` and `tool_choice` and what
the server was started with.

`tool_choice` defaults to "auto" when tools are given and "none" otherwise (OpenAI's rule).
"none" hands the tools to the template and reads the output as plain content. "auto" needs the
server's `--enable-auto-tool-choice` with a `--tool-call-parser`: the output is parsed for calls.
"required" and a named function must force the model to call, which takes structured outputs
(grammar-constrained decoding); quire does not have them yet, so they get a 400 that says so.
"""

from __future__ import annotations

from quire.entrypoints.openai_protocol import ChatCompletionTool, NamedToolChoice
from quire.entrypoints.tool_parsers import ToolParser


def request_tool_parser(
    tools: list[ChatCompletionTool] | None,
    tool_choice: str | NamedToolChoice | None,
    auto_tool_parser: type[ToolParser] | None,
) -> ToolParser | None:
    """The parser for this request's output, or None for plain content. Raises ValueError
    (starting with the field at fault) for a choice this server cannot honour."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise ValueError("tool_choice needs tools: give the functions the model may call.")
    if tool_choice == "auto":
        if auto_tool_parser is None:
            raise ValueError(
                'tool_choice "auto" (the default when tools are given) needs a server started '
                "with --enable-auto-tool-choice and --tool-call-parser; or send "
                'tool_choice "none".'
            )
        return auto_tool_parser()
    what = '"required"' if tool_choice == "required" else "naming a function"
    raise ValueError(
        f"tool_choice {what} needs structured outputs (constrained decoding), which quire does "
        'not support yet: use "auto" or "none".'
    )
