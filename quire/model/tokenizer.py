"""Loads the tokenizer and chat template of a model folder or GGUF file (via transformers)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model: str, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    source = tokenizer or model
    if source.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(source)), gguf_file=os.path.basename(source)
        )
    if not any(
        os.path.isfile(os.path.join(source, name))
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise FileNotFoundError(
            f"{source!r} has no tokenizer files (tokenizer.json / tokenizer_config.json): "
            "add them, or pass tokenizer= pointing at a folder that has them."
        )
    return AutoTokenizer.from_pretrained(source)
