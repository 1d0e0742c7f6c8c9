"""`quire chat`: replies stream in pieces, the conversation is kept, /exit and end of input quit,
/help lists the commands and an unknown /command is an error, never a message to the model."""

from __future__ import annotations

import builtins

import pytest

from quire import SamplingParams
from quire.config import EngineConfig
from quire.engine.llm_engine import LLMEngine
from quire.entrypoints.chat_cli import HELP_TEXT, ChatSession, run_chat
from quire.entrypoints.cli import build_parser, main

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=256))


def scripted(lines: list[str]):
    """A read_line that answers with `lines`, then signals end of input."""
    remaining = iter(lines)

    def read_line(prompt: str) -> str:
        try:
            return next(remaining)
        except StopIteration:
            raise EOFError from None

    return read_line


@pytest.fixture
def prompts(engine, monkeypatch) -> list[str]:
    """The text prompts the engine is given from now on, in order."""
    recorded: list[str] = []
    add_request = engine.add_request

    def recording_add_request(request_id, prompt, params, **kwargs):
        recorded.append(prompt["prompt"])
        add_request(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording_add_request)
    return recorded


def test_reply_streams_pieces_that_join_to_the_reply(engine):
    session = ChatSession(engine, GREEDY)
    pieces: list[str] = []
    reply = session.reply("Hello!", pieces.append)
    assert len(pieces) > 1
    assert "".join(pieces) == reply
    assert not engine.has_unfinished_requests()


def test_history_keeps_every_turn_and_feeds_the_next_prompt(engine, prompts):
    session = ChatSession(engine, GREEDY, system_prompt="Be brief.")
    first = session.reply("Hi")
    second = session.reply("And then?")
    assert session.history == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": second},
    ]
    template = engine.tokenizer.apply_chat_template
    assert prompts[1] == template(session.history[:4], tokenize=False, add_generation_prompt=True)


def test_reset_keeps_only_the_system_prompt(engine):
    session = ChatSession(engine, GREEDY, system_prompt="Be brief.")
    session.reply("Hi")
    session.reset()
    assert session.history == [{"role": "system", "content": "Be brief."}]


def test_a_conversation_too_long_for_the_context_is_refused_and_history_kept(engine):
    session = ChatSession(engine, GREEDY)
    session.reply("Hi")
    history = list(session.history)
    with pytest.raises(ValueError, match="max_model_len"):
        session.reply("word " * 2000)
    assert session.history == history


def test_run_chat_prints_replies_until_exit(engine):
    session = ChatSession(engine, GREEDY)
    written: list[str] = []
    run_chat(session, scripted(["Hello", "", "/exit", "never read"]), written.append, lambda: None)
    output = "".join(written)
    assert len(session.history) == 2
    assert session.history[1]["content"] + "\n" in output


def test_run_chat_ends_at_end_of_input_and_reports_errors(engine):
    session = ChatSession(engine, GREEDY)
    written: list[str] = []
    run_chat(session, scripted(["/reset", "word " * 2000]), written.append, lambda: None)
    output = "".join(written)
    assert "(conversation cleared)" in output
    assert "error: " in output and "max_model_len" in output
    assert session.history == []


def test_help_lists_every_command_and_sends_nothing_to_the_model(engine, prompts):
    session = ChatSession(engine, GREEDY)
    written: list[str] = []
    run_chat(session, scripted(["/help"]), written.append, lambda: None)
    assert "".join(written) == (
        "Type a message; /help lists the commands, /exit quits.\n"
        "/help         this list\n"
        "/reset        forget the conversation (the system prompt stays)\n"
        "/exit, /quit  quit (as Ctrl-D does); Ctrl-C stops a reply\n"
        "\n"
    )
    assert written[1] == HELP_TEXT
    assert (prompts, session.history) == ([], [])


def test_an_unknown_command_is_an_error_line_not_a_message(engine, prompts):
    session = ChatSession(engine, GREEDY)
    written: list[str] = []
    run_chat(session, scripted(["/foo bar", "/exit"]), written.append, lambda: None)
    assert written[1:] == ["error: unknown command /foo; /help lists the commands\n"]
    assert (prompts, session.history) == ([], [])


def test_quire_chat_command_chats_with_the_model(tiny_llama, monkeypatch, capsys):
    args = build_parser().parse_args(["chat", "--model", tiny_llama])
    assert (args.max_tokens, args.temperature, args.system) == (512, 0.7, None)
    monkeypatch.setattr(builtins, "input", scripted(["Hi there", "/exit"]))
    argv = ["chat", "--model", tiny_llama, "--max-tokens", "4", "--temperature", "0"]
    assert main(argv + ["--dtype", "float32", "--num-kv-blocks", "64"]) == 0
    assert "/help lists the commands, /exit quits" in capsys.readouterr().out


def test_a_chat_template_override_renders_the_prompt(engine, prompts):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    ChatSession(engine, GREEDY, chat_template=template).reply("Hi")
    assert prompts == ["<user>Hi"]


def test_a_chat_template_that_cannot_render_is_refused_before_chatting(engine):
    with pytest.raises(ValueError, match="cannot render"):
        ChatSession(engine, GREEDY, chat_template="{% for m in messages %}")


def test_quire_chat_and_serve_take_a_chat_template_file(tmp_path):
    path = str(tmp_path / "template.jinja")
    assert build_parser().parse_args(["chat", "--chat-template", path]).chat_template == path
    args = build_parser().parse_args(["serve", "--chat-template", path])
    assert (args.chat_template, args.enable_auto_tool_choice, args.tool_call_parser) == (
        path,
        False,
        None,
    )


def test_serve_refuses_auto_tool_choice_without_a_parser(capsys):
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
