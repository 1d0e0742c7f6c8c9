"""Loads the tokenizer and chat template of a model folder or GGUF file (via transformers).

A GGUF file's tokenizer is built from the vocabulary, merges and special tokens of the header
quire has already read (gguf_loader.open_gguf), by the builders transformers' own GGUF path uses:
the same tokenizer, without transformers parsing the file again for a config it does not need.
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from quire.model.gguf_loader import open_gguf
from quire.model.model_config import ModelFileError

# special token -> the metadata key (under tokenizer.ggml.) of its id
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def load_tokenizer(model: str, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    source = tokenizer or model
    if source.endswith(".gguf"):
        return gguf_tokenizer(source)
    if not any(
        os.path.isfile(os.path.join(source, name))
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise FileNotFoundError(
            f"{source!r} has no tokenizer files (tokenizer.json / tokenizer_config.json): "
            "add them, or pass tokenizer= pointing at a folder that has them."
        )
    return AutoTokenizer.from_pretrained(source)


def gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer of a GGUF file, as `AutoTokenizer.from_pretrained(dir, gguf_file=name)`
    builds it (transformers' get_gguf_tokenizer and convert_gguf_tokenizer, on the metadata read
    once). Raises ModelFileError when the file has no tokenizer quire can build."""
    # imported here: it loads the tokenizer classes of several families (0.6 s)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    metadata = open_gguf(path).metadata
    settings, config = (
        {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for renames in (
            GGUF_TOKENIZER_MAPPING["tokenizer"],
            GGUF_TOKENIZER_MAPPING["tokenizer_config"],
        )
    )
    tokens = settings.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelFileError(f"{path}: the GGUF metadata has no tokenizer.ggml.tokens")
    if settings.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ModelFileError(
                f"{path}: tokenizer.ggml.{key} is {token_id}, outside the {len(tokens)}-token "
                "vocabulary"
            )
        config[name] = None if token_id is None else tokens[token_id]
    try:
        backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], settings)
    except ValueError as error:
        raise ModelFileError(f"{path}: {error}") from None
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, name_or_path=os.path.dirname(path), **config, **extra
    )
