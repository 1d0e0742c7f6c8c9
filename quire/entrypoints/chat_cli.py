"""`quire chat`: an interactive chat in the terminal. Replies stream as they are generated; the
conversation is kept as history for the next turn. /help lists the commands: /exit (or Ctrl-D)
quits, /reset forgets the conversation; Ctrl-C stops a reply early. Any other line starting with
/ is an error, not a message to the model.

It drives LLMEngine directly: one user, one request at a time, no server in between.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable

from quire.config import EngineConfig
from quire.engine.llm_engine import LLMEngine
from quire.entrypoints.chat_template import check_chat_template, load_chat_template, render_chat
from quire.entrypoints.cli import chosen_lora
from quire.lora_request import LoRARequest
from quire.sampling_params import SamplingParams

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"
HELP_COMMAND = "/help"
HELP_TEXT = (
    "/help         this list\n"
    "/reset        forget the conversation (the system prompt stays)\n"
    "/exit, /quit  quit (as Ctrl-D does); Ctrl-C stops a reply\n"
)


class ChatSession:
    """A conversation with the model (with `lora_request`'s adapter, if given): each `reply`
    adds the user's turn and the model's."""

    def __init__(
        self,
        engine: LLMEngine,
        params: SamplingParams,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if chat_template is not None:
            check_chat_template(engine.tokenizer, chat_template)
        elif not engine.tokenizer.chat_template:
            raise ValueError(
                "This model's tokenizer has no chat template: pass --chat-template PATH, "
                "or use `quire generate`."
            )
        self.engine = engine
        self.params = params
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self.lora_request = lora_request
        self.history: list[dict[str, str]] = []
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.history = []
        if self.system_prompt:
            self.history.append({"role": "system", "content": self.system_prompt})

    def reply(self, user_text: str, on_text: Callable[[str], None] = lambda _: None) -> str:
        """Generates the model's answer to `user_text`, calling `on_text` with each new piece.
        Raises ValueError (history unchanged) when the conversation no longer fits the context.
        On Ctrl-C the reply so far is kept."""
        messages = self.history + [{"role": "user", "content": user_text}]
        tokenizer = self.engine.tokenizer
        text = render_chat(tokenizer, messages, chat_template=self.chat_template)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        request_id = f"chat-{next(self._ids)}"
        self.engine.add_request(
            request_id,
            {"prompt": text, "prompt_token_ids": token_ids},
            self.params,
            lora_request=self.lora_request,
        )
        answer = ""
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    new_text = output.outputs[0].text[len(answer) :]
                    answer = output.outputs[0].text
                    if new_text:
                        on_text(new_text)
        finally:
            self.engine.abort_request(request_id)  # a no-op unless interrupted
            self.history = messages + [{"role": "assistant", "content": answer}]
        return answer


def run_chat(
    session: ChatSession,
    read_line: Callable[[str], str] | None = None,
    write: Callable[[str], object] | None = None,
    flush: Callable[[], object] | None = None,
) -> None:
    """The read-reply loop until /exit or end of input (default: the terminal)."""
    read_line = read_line or input
    write = write or sys.stdout.write
    flush = flush or sys.stdout.flush
    write("Type a message; /help lists the commands, /exit quits.\n")
    while True:
        try:
            line = read_line(">>> ").strip()
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:
            write("\n")
            continue
        if not line:
            continue
        if line.startswith("/"):
            command = line.split()[0]
            if command in EXIT_COMMANDS:
                return
            if command == RESET_COMMAND:
                session.reset()
                write("(conversation cleared)\n")
            elif command == HELP_COMMAND:
                write(HELP_TEXT)
            else:
                write(f"error: unknown command {command}; /help lists the commands\n")
            continue

        def show(piece: str) -> None:
            write(piece)
            flush()

        try:
            session.reply(line, show)
        except KeyboardInterrupt:
            write(" [stopped]")
        except ValueError as error:
            write(f"error: {error} (use /reset to start over)")
        write("\n")


def run_chat_from_args(args: argparse.Namespace, config: EngineConfig) -> int:
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    print("Loading the model...", file=sys.stderr)
    engine = LLMEngine(config)
    lora = chosen_lora(engine, args.lora)
    session = ChatSession(engine, params, args.system, chat_template, lora)
    run_chat(session)
    return 0
