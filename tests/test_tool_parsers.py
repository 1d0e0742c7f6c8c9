"""Tool-call parsers on recorded model outputs: the calls and content they find, and the same
result however the output is split into stream chunks."""

from __future__ import annotations

import json

import pytest

from quire.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    FunctionCall,
    ToolCallStream,
    assistant_message,
)

PARIS = FunctionCall("get_weather", json.dumps({"city": "Paris"}))
TOKYO = FunctionCall("get_weather", json.dumps({"city": "Tokyo", "unit": "celsius"}))

# (output text, expected content, expected calls)
HERMES_CASES = [
    # SmolLM2-135M-Instruct, greedy, asked to repeat a call (tests/test_tool_calling.py's prompt):
    # the first <tool_call> is prose, the second opens the call.
    (
        "To call a function, answer with one <tool_call> block per call, each holding a JSON "
        'object with the name and the arguments:\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>',
        "To call a function, answer with one <tool_call> block per call, each holding a JSON "
        "object with the name and the arguments:",
        [PARIS],
    ),
    # Qwen2.5-style: a call and nothing else.
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [PARIS],
    ),
    # Two calls in one message.
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}'
        "\n</tool_call>",
        None,
        [PARIS, TOKYO],
    ),
    # Stopped right after the object, before the closing tag.
    (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "Sure.",
        [PARIS],
    ),
    # A block that is not a call stays as written.
    (
        "Use <tool_call>{not json}</tool_call> tags.",
        "Use <tool_call>{not json}</tool_call> tags.",
        [],
    ),
    # No call at all: the content is the text as written, whitespace included.
    ("The weather in Paris is mild. <", "The weather in Paris is mild. <", []),
    ('Unfinished <tool_call>\n{"name": "get_wea', 'Unfinished <tool_call>\n{"name": "get_wea', []),
]

LLAMA3_CASES = [
    # Llama 3.1 8B Instruct's JSON tool call.
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}',
        None,
        [PARIS, TOKYO],
    ),
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ('{"city": "Paris"} is what I know.', '{"city": "Paris"} is what I know.', []),
    (
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {"city": "Par',
        [],
    ),
]

CASES = [("hermes", *case) for case in HERMES_CASES] + [
    ("llama3_json", *case) for case in LLAMA3_CASES
]


def streamed(parser_name: str, pieces: list[str]) -> tuple[str, list[FunctionCall]]:
    """The content and calls a stream sends when the output arrives in `pieces`."""
    stream = ToolCallStream(TOOL_PARSERS[parser_name](), max_calls=None)
    content, calls, text = "", [], ""
    for i, piece in enumerate(pieces):
        text += piece
        new_content, new_calls = stream.update(text, final=i == len(pieces) - 1)
        content += new_content
        calls += new_calls
    return content, calls


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES)
def test_parser_finds_the_calls_and_the_content(parser_name, text, content, calls):
    assert assistant_message(TOOL_PARSERS[parser_name](), text, None) == (content, calls)


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES)
def test_a_stream_split_at_any_position_sends_the_same_message(parser_name, text, content, calls):
    expected = (content or "", calls)
    for split in range(len(text) + 1):
        assert streamed(parser_name, [text[:split], text[split:]]) == expected, split
    assert streamed(parser_name, list(text)) == expected


def test_a_call_is_sent_as_soon_as_its_block_closes():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=None)
    assert stream.update(text[:-1], final=False) == ("", [])
    assert stream.update(text, final=False) == ("", [PARIS])
    assert stream.update(text + "\n", final=True) == ("", [])


def test_content_before_a_possible_tag_is_held_back_until_it_is_not_one():
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=None)
    assert stream.update("Hi <tool_ca", final=False) == ("Hi", [])
    assert stream.update("Hi <tool_cat", final=False) == (" <tool_cat", [])


def test_max_calls_keeps_the_first_call_only():
    text = HERMES_CASES[2][0]
    assert assistant_message(TOOL_PARSERS["hermes"](), text, 1) == (None, [PARIS])
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=1)
    assert stream.update(text, final=True) == ("", [PARIS])
