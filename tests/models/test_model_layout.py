"""What the builder reads from the model: GQA and missing head_dim, latent caches, per-layer head
widths, nested caches."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import CacheList

from helpers import arch_models
from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.filters import calibration as cal
from qfilters_mlx.model_info import model_dims, probe_layout

CFG = dict(qfilters_budget=16, qfilters_n_sink=1, qfilters_recent=2, qfilters_calib_tokens=4,
           qfilters_filter_source="keys")


@pytest.fixture(scope="module", autouse=True)
def _no_compile():
    mx.disable_compile()  # compiled activations JIT a C++ kernel each on the CPU
    yield
    mx.enable_compile()


def test_per_layer_head_widths_global_head_dim():
    """gemma4_text: sliding layers of width 8, the global layer of width global_head_dim=16."""
    model = arch_models.build("gemma4_text")
    widths = {s.path: s.key_dim for s in probe_layout(model) if s.plain}
    assert widths == {(1,): 16}
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CFG))
    assert caches[1].config.head_dim == 16
    with pytest.raises(ValueError, match=r"head_dim=8 does not match the model's key head width 16"):
        KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=8, **CFG))
    KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=16, **CFG))  # matches the layer


def test_keys_of_width_qk_nope_plus_qk_rope():
    model = arch_models.build("deepseek_v2")
    a = model.args
    slots = [s for s in probe_layout(model) if s.plain]
    assert {(s.key_dim, s.value_dim) for s in slots} == {(a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)}
    KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=12, **CFG))
    with pytest.raises(ValueError, match="head_dim=8 .* 12"):
        KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=8, **CFG))


@pytest.mark.parametrize("name", ["gemma3", "mistral3", "qwen3_5", "gpt2", "gpt_bigcode", "phixtral"])
def test_wrappers_and_other_arg_spellings_build(name):
    """Sizes under text_config, GPT-2 style n_embd/n_head, other field names: no head_dim guess."""
    model = arch_models.build(name)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CFG))
    ours = [c for c in caches if isinstance(c, QFiltersKVCache)]
    model(mx.array([list(range(30))]), cache=caches)
    assert ours and all(c.size() <= 16 and c.offset == 30 for c in ours)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite", "kimi_linear"])
def test_mla_refused_at_build_time_naming_mla(name):
    model = arch_models.build(name)
    with pytest.raises(ValueError, match=r"multi-head latent attention \(MLA\)"):
        KVCacheBuilder.for_model(model, KVCacheConfig(**CFG))


@pytest.mark.parametrize("name", ["mamba", "rwkv7", "recurrent_gemma"])
def test_nothing_to_budget_is_refused(name):
    with pytest.raises(ValueError, match="no layer stores per-head keys"):
        KVCacheBuilder.for_model(arch_models.build(name), KVCacheConfig(**CFG))


def test_cache_list_attention_part_is_budgeted():
    """falcon_h1: CacheList(ArraysCache, KVCache) per layer; 60 tokens at budget 16."""
    model = arch_models.build("falcon_h1")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CFG))
    assert all(isinstance(c, CacheList) and isinstance(c[1], QFiltersKVCache) for c in caches)
    assert "partial" in repr(caches) and "ArraysCache at 0.0, 1.0" in repr(caches)
    for start in range(0, 60, 20):
        model(mx.array([list(range(start, start + 20))]), cache=caches)
    assert all(c[1].size() <= 16 and c[1].offset == 60 for c in caches)
    assert model_dims(model)[0] == 2


def test_filters_file_covers_budgeted_layers_and_refuses_mixed_widths(tmp_path):
    model = arch_models.build("gemma3_text")  # layer 0 sliding, layer 1 global
    assert model_dims(model) == (1, 2, 8)
    f = cal.calibrate_filters(model, [list(range(20))], samples=50)
    path = str(tmp_path / "f.safetensors")
    cal.save_filters(path, f, model)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_filters=path, **CFG))
    np.testing.assert_array_equal(np.array(caches[1].filter), np.array(f[0]))
    # openelm with per-layer KV heads: one [n_layers, n_kv_heads, head_dim] tensor cannot hold them
    import mlx_lm.models.openelm as openelm

    args = {**arch_models.tiny_args(openelm), "num_kv_heads": [2, 1]}
    mixed = openelm.Model(openelm.ModelArgs.from_dict(args))
    assert [s.n_kv_heads for s in probe_layout(mixed)] == [2, 1]
    with pytest.raises(ValueError, match=r"needs one shape for all budgeted layers.*\(1, 8\): layers \['1'\]"):
        model_dims(mixed)
    caches = KVCacheBuilder.for_model(mixed, KVCacheConfig(**CFG))  # online filters still work
    mixed(mx.array([list(range(30))]), cache=caches)
    assert [c.keys.shape[1] for c in caches] == [2, 1] and all(c.size() == 16 for c in caches)
