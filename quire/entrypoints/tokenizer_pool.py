"""TokenizerPool: the server's tokenization, chat-template rendering and detokenization, on a
few threads so the event loop never waits for them.

A prompt of a few MB takes seconds to tokenize. On the event loop that froze every other
client, /health included; on a pool thread it runs beside the loop, because transformers'
`encode` goes through tokenizers' `encode_batch`, which releases the GIL (tokenizers' single
`encode` does not: docs/BENCHMARKS.md, "Server under hostile load", has the measurement). Chat
templates are Jinja (Python), which the interpreter switches away from every 5 ms.

Two lanes, so that a long call never delays a short one: calls on texts (or token lists) up to
`LONG_CALL_SIZE` run on a short lane of two threads; longer ones queue for the one thread of
the long lane. A burst of huge prompts then waits behind itself only, and takes one core at
most. (Not at a lower priority: a niced thread that holds the GIL while it builds the token
list, then loses its core to other processes, stalls the event loop with it.) The threads share
the engine's tokenizer with the engine thread, which detokenizes with it: every call only reads
it (no truncation or padding is ever set), which tokenizers allows concurrently.

`max_prompt_chars` is the cheap check that comes first: no token covers more characters than the
vocabulary's longest token string (byte-level BPE spells each byte as one character, and a UTF-8
character is at least one byte; SentencePiece spells characters as themselves), so a prompt
longer than `max_model_len` times that cannot fit and is rejected without tokenizing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from transformers import PreTrainedTokenizerBase

# About 16k tokens of text: tokenized in tens of milliseconds.
LONG_CALL_SIZE = 2**16
_SHORT_LANE_THREADS = 2

_P = ParamSpec("_P")
_T = TypeVar("_T")


class TokenizerPool:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab())
        self.max_prompt_chars = max_model_len * self.max_token_chars
        self._short_lane = concurrent.futures.ThreadPoolExecutor(
            max_workers=_SHORT_LANE_THREADS, thread_name_prefix="quire-tokenizer"
        )
        self._long_lane = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="quire-tokenizer-long"
        )

    async def run(
        self, size: int, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """`fn(*args, **kwargs)` (a tokenizer call on `size` characters or tokens) on a pool
        thread; its exceptions propagate. Cancelling the caller does not stop a call already
        running: it finishes and is dropped."""
        lane = self._short_lane if size <= LONG_CALL_SIZE else self._long_lane
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(lane, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Drops queued calls and returns without waiting for running ones."""
        self._short_lane.shutdown(wait=False, cancel_futures=True)
        self._long_lane.shutdown(wait=False, cancel_futures=True)
