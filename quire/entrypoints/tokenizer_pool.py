"""TokenizerPool: the server's tokenization, chat-template rendering and detokenization, on a
few threads so the event loop never waits for them.

A prompt of a few MB takes seconds to tokenize. On the event loop that froze every other
client, /health included; on a pool thread it runs beside the loop, because transformers'
`encode` goes through tokenizers' `encode_batch`, which releases the GIL (tokenizers' single
`encode` does not: docs/BENCHMARKS.md, "Server under hostile load", has the measurement). Chat
templates are Jinja (Python), which the interpreter switches away from every 5 ms.

Only a few threads: enough that one long prompt does not hold up every short one, few enough not
to take the cores from the engine's step. The threads share the front end's tokenizer: every
call only reads it (no truncation or padding is ever set), which tokenizers allows concurrently.

`max_prompt_chars` is the cheap check that comes first: no token covers more characters than the
vocabulary's longest token string (byte-level BPE spells each byte as one character, and a UTF-8
character is at least one byte; SentencePiece spells characters as themselves), so a prompt longer than `max_model_len` times that cannot fit
and is rejected without tokenizing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from transformers import PreTrainedTokenizerBase

_MAX_THREADS = 4
_NICE = 10

_P = ParamSpec("_P")
_T = TypeVar("_T")


class TokenizerPool:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab())
        self.max_prompt_chars = max_model_len * self.max_token_chars
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(_MAX_THREADS, os.cpu_count() or 1),
            thread_name_prefix="quire-tokenizer",
            initializer=_lower_priority,
        )

    async def run(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`fn(*args, **kwargs)` on a pool thread (a tokenizer call); its exceptions propagate.
        Cancelling the caller does not stop a call already running: it finishes and is dropped."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Drops queued calls and returns without waiting for running ones."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Makes the calling thread yield the CPU to the engine's step and the event loop (Linux
    sets a nice value per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
