"""Loads the tokenizer and chat template of a model folder or GGUF file (via transformers).

A GGUF file's tokenizer is built from the vocabulary, merges and special tokens of the header
quire has already read (gguf_loader.open_gguf), by the builders transformers' own GGUF path uses:
the same tokenizer, without transformers parsing the file again for a config it does not need.
Building it imports transformers' model packages and converts the vocabulary in Python; the
result is cached under $XDG_CACHE_HOME/quire/tokenizers, keyed by the file's identity (path,
size, modification time), this module's source and the versions of transformers and tokenizers,
so that later loads of the file read its tokenizer.json instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import tokenizers
import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from quire import envs
from quire.model.gguf_loader import open_gguf
from quire.model.model_config import ModelFileError

logger = logging.getLogger(__name__)

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
    # imported here: it walks every model package of transformers, which a GGUF file's
    # tokenizer read from the cache does not need
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer of a GGUF file, as `AutoTokenizer.from_pretrained(dir, gguf_file=name)`
    builds it: from the cache when this file's was built before (the module docstring says
    when), else built and cached. Raises ModelFileError when the file has no tokenizer quire can
    build."""
    tokenizer_file, settings_file = _cache_files(path)
    try:
        with open(settings_file) as f:
            settings = json.load(f)
        # the settings are written first: with the tokenizer there too, the entry is whole
        source = {"tokenizer_file": tokenizer_file} if os.path.isfile(tokenizer_file) else None
    except (OSError, ValueError):
        source = None
    if source is None:
        backend, settings = _build_gguf_tokenizer(path)
        _write_cache(tokenizer_file, settings_file, backend, settings)
        source = {"tokenizer_object": backend}
    return PreTrainedTokenizerFast(**source, name_or_path=os.path.dirname(path), **settings)


def _cache_files(path: str) -> tuple[str, str]:
    """Where the tokenizer of the GGUF file at `path` is cached: its tokenizer.json (as
    tokenizers writes it) and the settings PreTrainedTokenizerFast takes with it (JSON)."""
    stat = os.stat(path)
    with open(__file__, "rb") as f:
        key = hashlib.sha256(f.read())
    identity = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    key.update(repr((identity, transformers.__version__, tokenizers.__version__)).encode())
    stem = os.path.join(envs.XDG_CACHE_HOME, "quire", "tokenizers", key.hexdigest()[:16])
    return f"{stem}.json", f"{stem}.settings.json"


def _write_cache(
    tokenizer_file: str, settings_file: str, backend: tokenizers.Tokenizer, settings: dict
) -> None:
    """Each file written whole or not at all (a load racing this reads it or none; what two
    builds of one entry write is the same); a cache that cannot be written costs the next load
    the build, nothing else."""
    files = ((settings_file, json.dumps(settings)), (tokenizer_file, backend.to_str()))
    try:
        os.makedirs(os.path.dirname(tokenizer_file), exist_ok=True)
        for target, text in files:
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(temporary, target)
    except OSError as error:
        logger.warning("Cannot cache the tokenizer at %s: %s", tokenizer_file, error)


def _build_gguf_tokenizer(path: str) -> tuple[tokenizers.Tokenizer, dict]:
    """The tokenizer a GGUF file's metadata describes, and the settings PreTrainedTokenizerFast
    takes with it (special tokens, chat template), as transformers' get_gguf_tokenizer and
    convert_gguf_tokenizer build them, on the metadata read once."""
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
    return backend, {**config, **extra}
