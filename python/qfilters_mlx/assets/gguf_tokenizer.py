"""The tokenizer files of an mlx-lm folder, rebuilt from GGUF metadata.

GPT-2 byte-level BPE (``tokenizer.ggml.model = "gpt2"``) from the GGUF's vocabulary
(``tokenizer.ggml.tokens``), merges and token types, with the pre-tokenizer that
``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`):

* ``smollm``: each digit is split on its own before the GPT-2 regex split (SmolLM2's
  ``tokenizer.json``);
* ``qwen2``: NFC normalization, then Qwen2's regex (one digit per piece, letters with one
  leading non-letter, punctuation runs with their newlines) and byte-level mapping without the
  GPT-2 regex (Qwen2's ``tokenizer.json``; llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_QWEN2`` uses the
  same regex).

Control and user-defined tokens (llama.cpp's ``llama_token_type``) become added tokens, control
ones special. Source: ggml's ``docs/gguf.md``.
"""

from __future__ import annotations

from qfilters_mlx.assets.gguf import token_id

__all__ = ["PRE_TOKENIZERS", "QWEN2_PATTERN", "build_tokenizer", "special_tokens",
           "tokenizer_config"]

# GGUF token types (llama.cpp ``llama_token_type``).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

#: Qwen2's pre-tokenizer regex (its ``tokenizer.json``, ``pre_tokenizer.pretokenizers[0]``).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: ``tokenizer.ggml.pre`` values this module builds.
PRE_TOKENIZERS = ("smollm", "qwen2")


def _set_pre_tokenizer(tokenizer, pre: str) -> None:
    from tokenizers import Regex, normalizers, pre_tokenizers

    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        raise ValueError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
                         f"(only {', '.join(PRE_TOKENIZERS)})")


def build_tokenizer(meta: dict):
    """``tokenizers.Tokenizer`` equivalent to the GGUF's GPT-2 style BPE.

    Args:
        meta: the GGUF metadata (:func:`qfilters_mlx.assets.gguf.read_metadata`).

    Raises:
        ValueError: not a byte-level BPE (``gpt2``) tokenizer, a pre-tokenizer outside
            :data:`PRE_TOKENIZERS`, or a malformed merge.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') tokenizers are supported, not {kind!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise ValueError("malformed BPE merge in tokenizer.ggml.merges")
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]

    tokenizer = Tokenizer(
        models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    _set_pre_tokenizer(tokenizer, meta.get("tokenizer.ggml.pre", "smollm"))
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
    tokens = meta["tokenizer.ggml.tokens"]
    ids = {"bos": token_id(meta, "bos"), "eos": token_id(meta, "eos"),
           "pad": token_id(meta, "padding"), "unk": token_id(meta, "unknown")}
    return {f"{k}_token": tokens[i] for k, i in ids.items() if i is not None}


def tokenizer_config(meta: dict, model_max_length: int) -> dict:
    """``tokenizer_config.json``, with the chat template when the GGUF has one."""
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(meta),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out
