"""The GGUF reader on tiny files written with the ``gguf`` package's own writer.

References, written out here in numpy: the Q8_0 and Q4_1 block layouts of ggml's
``ggml-common.h`` (``block_q8_0``: float16 ``d``, 32 int8 ``qs``, value ``d * q``;
``block_q4_1``: float16 ``d``, float16 ``m``, 16 bytes of nibbles, value ``d * q + m`` with the
low nibbles first), and llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``,
``LlamaModel.permute``), which the reader must undo for llama and leave alone for qwen2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from qfilters_mlx.assets import gguf as reader  # noqa: E402
from qfilters_mlx.assets.gguf_tokenizer import build_tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
RNG = np.random.default_rng(7)


def q8_0_blocks(rows: int, cols: int):
    """Random Q8_0 bytes ``(rows, cols/32*34)`` and their float32 values ``(rows, cols)``."""
    d = RNG.uniform(0.001, 0.05, (rows, cols // 32)).astype(np.float16)
    q = RNG.integers(-128, 128, (rows, cols // 32, 32), dtype=np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    values = d.astype(np.float32)[..., None] * q.astype(np.float32)
    return raw.reshape(rows, -1), values.reshape(rows, cols)


def q4_1_blocks(rows: int, cols: int):
    """Random Q4_1 bytes ``(rows, cols/32*20)`` and their float32 values ``(rows, cols)``."""
    d = RNG.uniform(0.001, 0.05, (rows, cols // 32)).astype(np.float16)
    m = RNG.uniform(-0.3, 0.0, (rows, cols // 32)).astype(np.float16)
    nib = RNG.integers(0, 16, (rows, cols // 32, 32), dtype=np.uint8)
    packed = nib[..., :16] | (nib[..., 16:] << 4)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), packed], axis=-1)
    values = d.astype(np.float32)[..., None] * nib.astype(np.float32) + m.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), values.reshape(rows, cols)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


BYTE_TOKENS = [chr(c) for c in range(33, 127)]  # enough for the ASCII strings below


def write_model(path, arch: str, pre: str):
    """A 1-layer model: hidden 64, 2 query heads, 1 KV head (head_dim 32), ffn 64, vocab 100.
    Returns the float32 weights the reader must give, under Hugging Face names."""
    hidden, heads, kv_heads, ffn = 64, 2, 1, 64
    tokens = BYTE_TOKENS + ["Ġ", "he", "ll", "<|im_end|>"]
    tokens += [f"<pad{i}>" for i in range(100 - len(tokens))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(BYTE_TOKENS) + 3) + [3] + [1] * (100 - len(BYTE_TOKENS) - 4))
    w.add_token_merges(["h e", "l l"])
    w.add_eos_token_id(len(BYTE_TOKENS) + 3)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    expected = {}

    def quantized(gname, hname, rows, cols, kind, permute_heads=None):
        raw, values = (q8_0_blocks if kind == Q.Q8_0 else q4_1_blocks)(rows, cols)
        stored = raw
        if permute_heads:  # llama.cpp permutes the float rows before quantizing them
            stored = llama_cpp_permute(raw.reshape(rows, -1), permute_heads)
        w.add_tensor(gname, stored, raw_dtype=kind)
        expected[hname] = values

    def f32(gname, hname, shape):
        values = RNG.standard_normal(shape).astype(np.float32)
        w.add_tensor(gname, values)
        expected[hname] = values

    permute = arch == "llama"
    quantized("token_embd.weight", "model.embed_tokens.weight", 100, hidden, Q.Q8_0)
    quantized("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", heads * 32, hidden,
              Q.Q4_1, heads if permute else None)
    quantized("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", kv_heads * 32, hidden,
              Q.Q8_0, kv_heads if permute else None)
    quantized("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", kv_heads * 32, hidden, Q.Q4_1)
    quantized("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", hidden, hidden, Q.Q8_0)
    quantized("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", ffn, hidden, Q.Q4_1)
    quantized("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", ffn, hidden, Q.Q4_1)
    quantized("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", hidden, ffn, Q.Q8_0)
    f32("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", (hidden,))
    f32("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", (hidden,))
    f32("output_norm.weight", "model.norm.weight", (hidden,))
    if arch == "qwen2":
        f32("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias", (heads * 32,))
        f32("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias", (kv_heads * 32,))
        f32("blk.0.attn_v.bias", "model.layers.0.self_attn.v_proj.bias", (kv_heads * 32,))
        quantized("output.weight", "lm_head.weight", 100, hidden, Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_q8_0_and_q4_1_blocks_match_the_numpy_reference(tmp_path):
    path = tmp_path / "blocks.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raw8, want8 = q8_0_blocks(3, 96)
    raw4, want4 = q4_1_blocks(5, 64)
    w.add_tensor("a", raw8, raw_dtype=Q.Q8_0)
    w.add_tensor("b", raw4, raw_dtype=Q.Q4_1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    np.testing.assert_array_equal(reader.dequantized(tensors["a"]), want8)
    np.testing.assert_allclose(reader.dequantized(tensors["b"]), want4, rtol=0, atol=1e-7)


@pytest.mark.parametrize("arch,pre", [("llama", "smollm"), ("qwen2", "qwen2")])
def test_read_gguf_names_layout_and_config(tmp_path, arch, pre):
    path = tmp_path / f"{arch}.gguf"
    expected = write_model(path, arch, pre)
    weights, config, meta = reader.read_gguf(path)
    assert set(weights) == set(expected)
    for name, want in expected.items():
        assert weights[name].dtype == np.float32 and weights[name].flags.c_contiguous
        np.testing.assert_allclose(weights[name], want, rtol=0, atol=1e-7, err_msg=name)
    assert config["model_type"] == arch
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 32)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 1e6
    assert config["vocab_size"] == 100
    assert config["tie_word_embeddings"] is (arch == "llama")
    assert config["eos_token_id"] == len(BYTE_TOKENS) + 3
    json.dumps(config)  # plain Python values
    assert meta["tokenizer.ggml.pre"] == pre


def test_unsupported_architecture_and_pre_tokenizer(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        reader.read_gguf(path)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-llm",
            "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [1]}
    with pytest.raises(ValueError, match="'deepseek-llm'"):
        build_tokenizer(meta)


def test_pre_tokenizers_follow_the_gguf(tmp_path):
    """smollm: digits alone, GPT-2 pattern (``(`` apart from a word); qwen2: digits alone, a
    letter run keeps one leading non-letter (``(word``), contractions in any case."""
    metas = {}
    for arch, pre in (("llama", "smollm"), ("qwen2", "qwen2")):
        write_model(tmp_path / f"{arch}.gguf", arch, pre)
        metas[pre] = reader.read_metadata(gguf.GGUFReader(str(tmp_path / f"{arch}.gguf")))
    text = "f(x) IS 123 it'S"
    pieces = {pre: [p for p, _ in build_tokenizer(m).pre_tokenizer.pre_tokenize_str(text)]
              for pre, m in metas.items()}
    assert pieces["smollm"] == ["f", "(", "x", ")", "ĠIS", "Ġ", "1", "2", "3", "Ġit", "'", "S"]
    assert pieces["qwen2"] == ["f", "(x", ")", "ĠIS", "Ġ", "1", "2", "3", "Ġit", "'S"]
    tok = build_tokenizer(metas["qwen2"])
    assert tok.encode("hell<|im_end|>").tokens == ["he", "ll", "<|im_end|>"]
