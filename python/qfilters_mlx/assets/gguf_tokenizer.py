"""The tokenizer files of an mlx-lm folder, rebuilt from GGUF metadata.

GPT-2 byte-level BPE (``tokenizer.ggml.model = "gpt2"``) with SmolLM's
pre-tokenizer (``tokenizer.ggml.pre = "smollm"``): each digit is split on its
own before the GPT-2 regex split. Control and user-defined tokens (llama.cpp's
``llama_token_type``) become added tokens. Source: ggml's ``docs/gguf.md``.
"""

from __future__ import annotations

from qfilters_mlx.assets.gguf import metadata_scalar, token_id

__all__ = ["build_tokenizer", "special_tokens", "tokenizer_config"]

# GGUF token types (llama.cpp ``llama_token_type``).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def build_tokenizer(meta: dict):
    """``tokenizers.Tokenizer`` equivalent to the GGUF's GPT-2 style BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors

    kind = metadata_scalar(meta.get("tokenizer.ggml.model"))
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') tokenizers are supported, not {kind!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise ValueError("malformed BPE merge in tokenizer.ggml.merges")
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]

    tokenizer = Tokenizer(
        models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tok, special=(kind_ == _TOKEN_CONTROL), normalized=False)
        for tok, kind_ in zip(tokens, types)
        if kind_ in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)  # keeps each token's own ``special`` flag
    return tokenizer


def special_tokens(meta: dict) -> dict[str, str]:
    """``special_tokens_map.json``: ``{"bos_token": text, ...}`` for the ids the metadata names."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    ids = {"bos": token_id(meta, "bos"), "eos": token_id(meta, "eos"),
           "pad": token_id(meta, "padding"), "unk": token_id(meta, "unknown")}
    return {f"{k}_token": tokens[i] for k, i in ids.items() if i is not None}


def tokenizer_config(meta: dict, model_max_length: int) -> dict:
    """``tokenizer_config.json``, with the chat template when the GGUF has one."""
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(meta),
        "add_bos_token": bool(metadata_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(metadata_scalar(meta.get("tokenizer.ggml.add_eos_token", False))),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = metadata_scalar(meta["tokenizer.chat_template"])
    return out
