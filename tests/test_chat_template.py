"""render_chat: one prompt renderer for LLM.chat, the server and `quire chat`; bad messages and
templates raise ValueError saying what to change."""

from __future__ import annotations

import os

import pytest
from conftest import make_llm

from quire.entrypoints.chat_template import load_chat_template, render_chat
from quire.model.tokenizer import load_tokenizer

HERMES_TEMPLATE = os.path.join(
    os.path.dirname(__file__), "..", "examples", "tool_chat_template_hermes.jinja"
)
HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SMOLLM2_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return load_tokenizer(default_model)


@pytest.fixture(scope="module")
def hermes_template() -> str:
    return load_chat_template(HERMES_TEMPLATE)


def test_renders_the_models_template(tokenizer):
    assert render_chat(tokenizer, HI) == SMOLLM2_HI


def test_add_generation_prompt_false_leaves_out_the_assistant_header(tokenizer):
    assert render_chat(tokenizer, HI, add_generation_prompt=False) == SMOLLM2_HI.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_a_template_override_replaces_the_models(tokenizer):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert render_chat(tokenizer, HI, chat_template=template) == "[user] Hi\n"


def test_text_parts_render_as_their_text_joined_by_newlines(tokenizer):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    assert render_chat(tokenizer, [{"role": "user", "content": parts}]) == render_chat(
        tokenizer, joined
    )


def test_null_content_renders_as_an_empty_string(tokenizer):
    messages = HI + [{"role": "assistant", "content": None}]
    expected = HI + [{"role": "assistant", "content": ""}]
    assert render_chat(tokenizer, messages) == render_chat(tokenizer, expected)


def test_tools_and_tool_call_history_reach_the_template(tokenizer, hermes_template):
    messages = HI + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    text = render_chat(
        tokenizer,
        messages,
        [WEATHER_TOOL],
        add_generation_prompt=False,
        chat_template=hermes_template,
    )
    assert (
        '<tools>\n{"name": "get_weather", "description": "The weather in a city", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}\n</tools>'
    ) in text
    assert text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
    )


def test_the_hermes_template_without_tools_renders_as_smollm2s_own(tokenizer, hermes_template):
    assert render_chat(tokenizer, HI, chat_template=hermes_template) == SMOLLM2_HI


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one message"),
        ([{"content": "Hi"}], r"messages\[0\] must be a dict with a string 'role'"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            r"messages\[0\].content: only parts of type 'text'",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
            r"messages\[0\].tool_calls\[0\].function.arguments must be a JSON object",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            r"messages\[0\].tool_calls\[0\] must be",
        ),
    ],
)
def test_bad_messages_raise_value_error_naming_the_field(tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(tokenizer, messages)


def test_tool_call_arguments_that_are_not_json_reach_the_template_as_written(tokenizer):
    call = {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    template = "{{ messages[0].tool_calls[0].function.arguments }}"
    assert render_chat(tokenizer, messages, chat_template=template) == "{oops"


def test_bad_tools_raise_value_error(tokenizer):
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        render_chat(tokenizer, HI, [{"type": "function", "function": {}}])


@pytest.mark.parametrize(
    "template",
    ["{{ raise_exception('roles must alternate') }}", "{% for m in messages %}", "{{ 1 + 'a' }}"],
)
def test_a_template_that_cannot_render_raises_value_error(tokenizer, template):
    with pytest.raises(ValueError, match="The chat template cannot render these messages"):
        render_chat(tokenizer, HI, chat_template=template)


def test_a_model_without_template_raises_value_error(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        render_chat(tokenizer, HI)


def test_an_unreadable_template_file_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="--chat-template: cannot read"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_serve_refuses_a_template_of_bad_syntax_before_loading_the_model(
    tmp_path, monkeypatch, capsys
):
    from quire.entrypoints import api_server
    from quire.entrypoints.cli import main

    served: list[object] = []
    monkeypatch.setattr(api_server, "serve", lambda *args, **kwargs: served.append(args))
    path = tmp_path / "bad.jinja"
    path.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    assert main(["serve", "--chat-template", str(path)]) == 2
    assert capsys.readouterr().err == f"error: --chat-template: '{path}' line 2: unexpected '}}'\n"
    assert served == []


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, dtype="float32")


def test_llm_chat_renders_with_the_template_override_and_tools(llm):
    from quire import SamplingParams

    template = "{{ tools[0].function.name }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    outputs = llm.chat(
        HI,
        SamplingParams(max_tokens=1),
        chat_template=template,
        tools=[WEATHER_TOOL],
        use_tqdm=False,
    )
    assert outputs[0].prompt == "get_weather|Hi"


def test_llm_chat_refuses_an_empty_conversation(llm):
    with pytest.raises(ValueError, match="at least one message"):
        llm.chat([])
