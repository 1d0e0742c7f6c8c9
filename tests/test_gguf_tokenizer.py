"""A GGUF file's tokenizer, built from the header quire read (model/tokenizer.py) or read back
from quire's cache, is the one `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds: the
same tokens for the default model's whole vocabulary, the same special tokens and the same chat
rendering."""

from __future__ import annotations

import os

import pytest

from quire import envs
from quire.model.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "  two leading spaces,\ttabs\n\nand blank lines\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "数字 12345 émigré naïve 🙂🚀",
    "def f(x):\n    return x ** 2  # squared\n",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another?"},
]


@pytest.fixture(scope="module")
def reference(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(default_model), gguf_file=os.path.basename(default_model)
    )


@pytest.fixture(scope="module", params=["built", "from the cache"])
def tokenizer(default_model, request, tmp_path_factory):
    """The first load of a file builds its tokenizer; a later one reads it from the cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(envs, "XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        tokenizer = load_tokenizer(default_model)
        if request.param == "from the cache":
            tokenizer = load_tokenizer(default_model)
    return tokenizer


def test_every_vocabulary_token_encodes_as_transformers_does(tokenizer, reference):
    pieces = [reference.decode([i]) for i in range(len(reference))]
    assert tokenizer(pieces)["input_ids"] == reference(pieces)["input_ids"]
    assert len(tokenizer) == len(reference) == 49152


def test_text_encodes_and_decodes_as_transformers_does(tokenizer, reference):
    ids = [reference.encode(text) for text in TEXTS]
    assert [tokenizer.encode(text) for text in TEXTS] == ids
    assert [tokenizer.decode(i, skip_special_tokens=True) for i in ids] == [
        reference.decode(i, skip_special_tokens=True) for i in ids
    ]


def test_special_tokens_are_transformers_own(tokenizer, reference):
    assert (
        tokenizer.special_tokens_map
        == reference.special_tokens_map
        == {
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|im_end|>",
        }
    )
    assert tokenizer.all_special_ids == reference.all_special_ids
    assert tokenizer.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()


def test_the_chat_template_renders_as_transformers_does(tokenizer, reference):
    rendered = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.chat_template == reference.chat_template
    assert (
        tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        == rendered
    )
    assert rendered.endswith("<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\n")
