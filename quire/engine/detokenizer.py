"""Incremental detokenization: generated token ids to UTF-8-safe text, cut at stop strings.

Decoding is the tokenizers library's own streaming decoder (`DecodeStream`), primed with the
prompt's last few tokens so that the first generated token keeps its leading space (byte-level
BPE and sentencepiece-style Metaspace alike). Per step it decodes a window of a few tokens, and
holds a token back while its bytes end in half a character.

DecodeStream assumes that decoding more tokens only appends text. Byte-fallback decoders
(Llama-2 style `<0xNN>` tokens) break that on invalid UTF-8: a run of byte tokens with one bad
byte decodes to U+FFFD throughout, so a byte shown alone as a valid character turns into U+FFFD
once a bad byte follows. The stream then fails with "Invalid prefix"; the detokenizer starts a
new stream from the tokens whose text it has not shown yet, and keeps what it has shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from quire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Prompt tokens decoded before the output, as the context for its first token's leading space.
_NUM_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so at most 3 trailing prompt tokens hold part of one.
_MAX_PARTIAL_CHAR_TOKENS = 3
_REPLACEMENT_CHAR = "\ufffd"
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """One completion's text, grown step by step and cut at the first stop string.

    The work per step is bounded by the new tokens and the longest stop string, not by the output
    length: the decode window is a few tokens, the stop search covers the new text plus the
    `len(stop) - 1` characters before it, and the text is kept as pieces, joined when read.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer: Tokenizer = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        context = _decode_context(self._tokenizer, prompt_token_ids, self._skip_special_tokens)
        self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special_tokens)
        self._held_ids: list[int] = []  # output tokens whose text the stream has not given yet
        self._stop: list[str] = params.stop
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        # Characters before the new text in which a stop string ending in the new text can start.
        self._overlap = max(map(len, self._stop), default=1) - 1
        # Characters get_delta_text holds back because they may begin a stop string that is cut.
        # An included stop string is never cut, nor is the text before it.
        self._withhold = 0 if self._include_stop else self._overlap
        self._pieces = [""]
        self._num_chars = 0
        self._tail = ""  # the last `_overlap` characters of the text
        self._unsent: list[str] = []
        self._num_sent = 0

    @property
    def output_text(self) -> str:
        """The text generated so far; never ends with half a character."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0]

    def update(self, new_token_ids: list[int], num_output_tokens: int) -> str | None:
        """Appends newly generated tokens and returns the stop string they complete, if any.

        `num_output_tokens` counts the output tokens including these; stop strings are looked
        for only once it reaches `min_tokens`. When several stop strings match, the one that
        ends first in the text wins (the longer one if they end together), so the result does
        not depend on how tokens are grouped into updates. The text is then cut right before
        the stop string, or right after it with `include_stop_str_in_output`; the completion is
        finished and takes no further updates.
        """
        new_text = self._decode(new_token_ids)
        if not new_text:
            return None
        window = self._tail + new_text
        self._pieces.append(new_text)
        self._unsent.append(new_text)
        self._num_chars += len(new_text)
        self._tail = window[max(len(window) - self._overlap, 0) :]
        if num_output_tokens < self._min_tokens:
            return None
        match = _first_stop(window, len(window) - len(new_text), self._stop)
        if match is None:
            return None
        start, stop = match
        end = start + len(stop) if self._include_stop else start
        self._truncate(self._num_chars - len(window) + end)
        return stop

    def get_delta_text(self, finished: bool) -> str:
        """The text not handed out by earlier calls.

        While not finished, the last `len(longest stop string) - 1` characters are held back
        (unless stop strings are included in the output), so no caller ever sees the start of a
        stop string that is cut later; when finished, everything left.
        """
        end = self._num_chars if finished else self._num_chars - self._withhold
        if end <= self._num_sent:
            return ""
        unsent = "".join(self._unsent)
        split = end - self._num_sent
        self._unsent = [unsent[split:]]
        self._num_sent = end
        return unsent[:split]

    def _decode(self, new_token_ids: list[int]) -> str | None:
        self._held_ids += new_token_ids
        try:
            new_text = self._stream.step(self._tokenizer, new_token_ids)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX_ERROR):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            new_text = self._stream.step(self._tokenizer, self._held_ids)
        if new_text is not None:
            self._held_ids = []
        return new_text

    def _truncate(self, num_chars: int) -> None:
        assert num_chars >= self._num_sent, "a stop string cut text already handed out"
        text = self.output_text[:num_chars]
        self._pieces = [text]
        self._unsent = [text[self._num_sent :]]
        self._num_chars = num_chars


def _decode_context(
    tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool
) -> list[int]:
    """The prompt's last few tokens, ending on a whole character, to decode the output after.

    DecodeStream takes a context whose text ends in U+FFFD (half a character) as no context, and
    would hand its text out again with the output; trailing tokens holding half a character are
    dropped instead, so the output's own bytes decode as they would on their own.
    """
    end = len(prompt_token_ids)
    for _ in range(_MAX_PARTIAL_CHAR_TOKENS + 1):
        context = prompt_token_ids[max(end - _NUM_CONTEXT_TOKENS, 0) : end]
        text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        if not text.endswith(_REPLACEMENT_CHAR):
            return context
        end -= 1
    return []


def _first_stop(text: str, new_start: int, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string ending first in `text` after index `new_start`."""
    matches = []
    for stop in stops:
        start = text.find(stop, max(new_start - len(stop) + 1, 0))
        if start != -1:
            matches.append((start + len(stop), start, stop))
    if not matches:
        return None
    _, start, stop = min(matches)
    return start, stop
