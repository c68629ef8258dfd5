"""Tokenizers and chat templates for targets: HF directories and GGUF files, through transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_model.files import cache_root
from dflash_model.weights import GGUFSource

# GGUF metadata key (after "tokenizer.") -> the name transformers' GGUF tokenizer converter expects.
_GGUF_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}


def converted_tokenizer_dir(path: Path) -> Path:
    """Where the converted tokenizer of a GGUF file is kept: parsing the GGUF takes ~10-20 s per process. The name
    holds the file's size and mtime, so a changed file is converted again."""
    stat = path.stat()
    return cache_root() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def _gguf_tokenizer(path: Path):
    """transformers' own GGUF -> fast-tokenizer converter, fed from the `gguf` reader; cached on disk.

    `AutoTokenizer.from_pretrained(gguf_file=...)` would do the same but refuses to run without torch, which
    must never be a runtime dependency here; the conversion itself does not need torch.
    """
    # transformers takes seconds to import: only the paths that build a tokenizer pay for it.
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import convert_gguf_tokenizer

    cached = converted_tokenizer_dir(path)
    if (cached / "done").is_file():
        meta = json.loads((cached / "meta.json").read_text())
        tok = PreTrainedTokenizerFast(tokenizer_file=str(cached / "tokenizer.json"), **meta["kwargs"])
        tok.chat_template = meta["chat_template"]
        return tok

    meta = GGUFSource(path).metadata
    fields = {new: meta[f"tokenizer.{old}"] for old, new in _GGUF_TOKENIZER_KEYS.items() if f"tokenizer.{old}" in meta}
    if "tokens" not in fields:
        raise ValueError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    backend, extra = convert_gguf_tokenizer(meta.get("general.architecture", "llama"), fields)
    tokens = fields["tokens"]
    special = {
        f"{name}_token": tokens[fields[f"{name}_token_id"]]
        for name in ("bos", "eos", "unk", "pad")
        if f"{name}_token_id" in fields
    }
    # The GGUF's own special-token ids win over the converter's guesses (for this 'llama' + gpt2-BPE file it
    # names <|im_start|> as eos, where the metadata says id 2, <|im_end|>). No clean-up: it corrupts BPE text.
    kwargs = extra | special | {"clean_up_tokenization_spaces": False}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    if meta.get("tokenizer.chat_template"):
        tok.chat_template = meta["tokenizer.chat_template"]
    try:  # a cache that cannot be written (read-only home) only costs time
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        backend.save(str(tmp / "tokenizer.json"))
        kwargs = {k: v for k, v in kwargs.items() if isinstance(v, (str, bool, int, type(None)))}
        (tmp / "meta.json").write_text(json.dumps({"kwargs": kwargs, "chat_template": tok.chat_template}))
        (tmp / "done").write_text("")
        tmp.rename(cached)
    except OSError:
        pass
    return tok


def load_tokenizer(path: str | Path):
    """The tokenizer (with chat template) of an HF model directory or a GGUF file."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    from transformers import AutoTokenizer  # slow to import: see _gguf_tokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json / tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path))


def chat_prompt_ids(tokenizer, messages: list[dict] | str, *, thinking: bool = False) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, ready for the assistant's turn.

    Thinking is off by default (the DFlash drafters are trained and evaluated that way); templates without
    an `enable_thinking` switch ignore the flag.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template; pass plain prompts instead of --chat")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end a response: eos plus the chat template's end-of-turn markers when they are tokens."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"):
        if marker in vocab:
            ids.add(int(vocab[marker]))
    return sorted(ids)
