"""Tiny random-weight models of every decoder-only architecture in the installed mlx-lm.

Used by ``tests/models/test_architectures.py`` and ``tools/arch_table.py``. Modules are
enumerated with ``pkgutil`` (never hand-picked); :data:`SKIP` lists the ones
that are not built and why, :data:`OVERRIDES` the tiny args a module needs on
top of the generic ones (:func:`tiny_args`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import pkgutil
import typing

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten

VOCAB = 64

COMMON = {
    # llama-style
    "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "head_dim": 8, "tie_word_embeddings": True, "partial_rotary_factor": 1.0,
    # GPT-2 / other spellings
    "n_embd": 32, "n_head": 4, "n_layer": 2, "n_ctx": 256, "n_positions": 256, "n_inner": 64,
    "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "hidden_dim": 32, "dim": 32, "n_heads": 4,
    "n_kv_heads": 2, "n_layers": 2, "d_model": 32, "ffn_hidden_size": 64, "kv_channels": 8,
    "num_query_groups": 2, "multi_query_group_num": 2,
    # MoE
    "num_experts": 4, "num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_local_experts": 4,
    "num_shared_experts": 1, "moe_num_experts": 4, "n_group": 1, "topk_group": 1,
    # MLA
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    # windows / hybrids
    "sliding_window": 8, "sliding_window_pattern": 2, "conv_kernel": 4, "state_size": 8,
    "ssm_state_size": 8, "window_size": 8, "attention_window_size": 8,
}
"""Generic tiny values, used for every ``ModelArgs`` field of that name."""

SKIP: dict[str, str] = {
    "bitnet": "needs a Metal kernel (BitLinear) even for a forward pass",
    "muse_spark": "needs a Metal kernel even for a forward pass",
    "phi3small": "the tiny model segfaults in MLX on the CPU with its own KVCache (no Q-Filters cache involved)",
    "prism_hadamard_qwen35": "needs a packed Hadamard-quantized checkpoint to build",
}
"""Modules not built, with the reason (shown in the table of docs/mlx-lm.md)."""

_TWO = ["sliding_attention", "full_attention"]
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
        "v_head_dim": 8}
_LLAMA = {k: COMMON[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                 "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                 "vocab_size", "head_dim", "rope_theta", "max_position_embeddings",
                                 "tie_word_embeddings")}
_YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0}
_LLAMA4_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                "original_max_position_embeddings": 256}
_QWEN35 = {"linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3, "full_attention_interval": 2}

OVERRIDES: dict[str, dict] = {
    # Sizes and layer patterns that the generic values cannot give; several follow the
    # configs of mlx-lm's own tests/test_models.py (test_all_models), shrunk to 2 layers.
    "afm7": {"num_layers": 2, "num_kv_reuse_layers": 1},
    "afmoe": {"layer_types": _TWO, "num_dense_layers": 1},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2, "tie_word_embeddings": False},
    "cohere2": {"sliding_window_pattern": 2},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "deepseek_v2": {**_MLA, "rope_scaling": _YARN, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "topk_method": "greedy", "n_group": 1, "topk_group": 1},
    "exaone_moe": {"layer_types": _TWO, "is_moe_layer": [False, True]},
    "gear": {"layer_types": ["sliding_attention", "full_attention"]},
    # Released gemma3n checkpoints share the KV of their last layers (num_kv_shared_layers > 0):
    # keep that feature in the tiny model, so the matrix tests what users load.
    "gemma3n": {"text_config": {"model_type": "gemma3n", "hidden_size": 32, "num_hidden_layers": 4,
                                "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8,
                                "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "num_key_value_heads": 2,
                                "num_kv_shared_layers": 2, "vocab_size_per_layer_input": VOCAB,
                                "sliding_window": 8, "max_position_embeddings": 256,
                                "rope_local_base_freq": 10000.0, "rope_theta": 10000.0,
                                "final_logit_softcapping": 30.0, "layer_types": _TWO * 2,
                                "activation_sparsity_pattern": [0.0] * 4,
                                "hidden_size_per_layer_input": 8, "altup_num_inputs": 2,
                                "altup_coef_clip": 1.0, "altup_correct_scale": True,
                                "altup_active_idx": 0, "laurel_rank": 4}},
    "gemma4": {"text_config": {"model_type": "gemma4_text", **_LLAMA, "num_hidden_layers": 3,
                               "global_head_dim": 16, "num_kv_shared_layers": 1,
                               "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                               "sliding_window": 8, "layer_types": [*_TWO, "sliding_attention"]}},
    "gemma4_text": {"num_hidden_layers": 3, "global_head_dim": 16, "num_kv_shared_layers": 1,
                    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                    "layer_types": [*_TWO, "sliding_attention"]},
    "glm_moe_dsa": {**_MLA, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                    "moe_layer_freq": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
                    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                    "attention_bias": False},
    "gpt_neox": {"rotary_emb_base": 10000, "rotary_pct": 0.5},
    "gptj": {"rotary_dim": 4},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
                         "mamba_d_head": 8, "mamba_d_state": 8, "mamba_d_conv": 4,
                         "mamba_n_groups": 1, "shared_intermediate_size": 32,
                         "embedding_multiplier": 1.0, "attention_multiplier": 0.25,
                         "logits_scaling": 1.0, "residual_multiplier": 1.0},
    "hunyuan": {"moe_topk": 2, "num_shared_expert": 1, "use_mixed_mlp_moe": True, "use_qk_norm": True,
                "use_cla": False, "cla_share_factor": 2, "rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1.0}, "moe_intermediate_size": 32},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2},
    "kimi_k3": {**_MLA, "linear_attn_config": {"num_heads": 4, "head_dim": 8, "kda_layers": [1],
                                               "short_conv_kernel_size": 3},
                "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32},
    "kimi_linear": {**_MLA, "linear_attn_config": {"num_heads": 4, "head_dim": 8, "kda_layers": [1]},
                    "model_max_length": 256, "num_experts": 4, "moe_intermediate_size": 32},
    "lfm2": {"conv_bias": False, "conv_L_cache": 3, "block_dim": 32, "block_ff_dim": 64,
             "block_multiple_of": 4, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1]},
    "lfm2-vl": {"text_config": {"model_type": "lfm2", **_LLAMA, "norm_eps": 1e-5, "conv_bias": False,
                                "conv_L_cache": 3, "block_dim": 32, "block_ff_dim": 64,
                                "block_multiple_of": 4, "block_ffn_dim_multiplier": 1.0,
                                "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1]}},
    "lfm2_moe": {"conv_bias": False, "conv_L_cache": 3, "full_attn_idxs": [1],
                 "num_dense_layers": 1, "norm_topk_prob": True, "use_expert_bias": False},
    "lille-130m": {"block_size": 256, "n_embd": 128, "n_kv_heads": 2},
    "exaone4": {"sliding_window_pattern": "LG"},
    "llama4": {"text_config": {**_LLAMA, "model_type": "llama4", "attention_bias": False,
                               "attention_chunk_size": 8, "rope_scaling": None,
                               "num_hidden_layers": 4, "interleave_moe_layer_step": 2,
                               "intermediate_size_mlp": 64, "num_experts_per_tok": 1,
                               "num_local_experts": 2, "use_qk_norm": True}},
    "llama4_text": {"intermediate_size_mlp": 64, "no_rope_layers": [0, 1], "use_qk_norm": True},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "moe_topk": 2,
                      "expert_ffn_hidden_size": 32, "zero_expert_num": 2, "mla_scale_q_lora": True,
                      "mla_scale_kv_lora": True, "routed_scaling_factor": 1.0},
    "longcat_flash_ngram": {"attention_method": "MLA", "zero_expert_type": "identity", "moe_topk": 2,
                            "expert_ffn_hidden_size": 32, "zero_expert_num": 2,
                            "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
                            "routed_scaling_factor": 1.0},
    "mamba2": {"n_groups": 1, "time_step_limit": [0.001, 100.0], "time_step_rank": "auto",
               "use_bias": False, "use_conv_bias": True},
    "mellum": {"layer_types": _TWO, "norm_topk_prob": True, "rope_parameters": {
        "sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 10000.0}}},
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "sliding_window_size": 8, "routed_scaling_factor": None, "topk_method": "noaux_tc",
                      "scoring_func": "sigmoid", "norm_topk_prob": True, "layernorm_epsilon": 1e-5,
                      "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "v_head_dim": 8, "swa_head_dim": 8,
                      "swa_v_head_dim": 8},
    "minicpm3": {**_MLA, "rope_scaling": {"original_max_position_embeddings": 256,
                                          "short_factor": 1.0, "long_factor": 1.0}, "dim_model_base": 32, "scale_depth": 1.0, "scale_emb": 1.0},
    "ministral3": {"layer_types": _TWO, "rope_parameters": _LLAMA4_ROPE},
    "mistral3": {"text_config": {**_LLAMA, "model_type": "ministral3", "layer_types": _TWO,
                                 "rope_parameters": _LLAMA4_ROPE}},
    "mistral4": {**_MLA, "rope_parameters": _LLAMA4_ROPE, "norm_topk_prob": True, "first_k_dense_replace": 1,
                 "routed_scaling_factor": 1.0},
    "muse_glimmer": {"layer_types": _TWO},
    "muse_spark": {"text_config": {**_LLAMA, "post_norm_eps": 1e-5,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                   "layer_rope_theta": [10000.0, 10000.0], "layer_types": _TWO,
                                   "sliding_window": 8, "final_logit_softcapping": 30.0,
                                   "output_multiplier": 1.0, "num_local_experts": 4,
                                   "num_experts_per_tok": 2, "moe_hidden_size": 32,
                                   "moe_intermediate_size": 32}},
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2, "no_op": False,
                                                      "replace_with_linear": False},
                                        "ffn": {"ffn_mult": 1.0, "no_op": False,
                                                "replace_with_linear": False}}] * 2},
    "nemotron_h": {"hybrid_override_pattern": ["*", "M"], "mamba_num_heads": 4, "mamba_head_dim": 8,
                   "n_groups": 1, "time_step_limit": [0.001, 100.0], "mamba_proj_bias": False,
                   "mlp_bias": False, "use_bias": False, "use_conv_bias": True,
                   "residual_in_fp32": True, "attention_bias": False},
    "olmo3": {"layer_types": _TWO},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                    "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3,
                    "linear_allow_neg_eigval": False},
    "openelm": {"num_transformer_layers": 2, "model_dim": 32, "ffn_dim_divisor": 8,
                "num_query_heads": [4, 4], "num_kv_heads": [2, 2], "ffn_multipliers": [1.0, 1.0]},
    "pixtral": {"text_config": {**_LLAMA, "model_type": "mistral"}},
    "phixtral": {"num_vocab": VOCAB, "model_dim": 32, "rotary_dim": 4},
    "plamo": {"n_shared_head": 2},
    "plamo2": {"hidden_size_per_head": 8, "mamba_num_heads": 4, "mamba_d_state": 8,
               "mamba_chunk_size": 8},
    "plamo3": {"sliding_window_pattern": 2},
    "qwen2_vl": {"text_config": {**_LLAMA, "model_type": "qwen2"}},
    "qwen3_5": {"text_config": {**_LLAMA, **_QWEN35, "model_type": "qwen3_5"}},
    "qwen3_5_moe": {"text_config": {**_LLAMA, **_QWEN35, "model_type": "qwen3_5_moe",
                                    "num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32,
                                    "shared_expert_intermediate_size": 32}},
    "qwen3_next": {"linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3, "decoder_sparse_step": 1,
                   "mlp_only_layers": [0], "full_attention_interval": 2},
    "qwen3_vl": {"text_config": {**_LLAMA, "model_type": "qwen3"}},
    "qwen3_vl_moe": {"text_config": {**_LLAMA, "model_type": "qwen3_moe", "decoder_sparse_step": 1,
                                     "mlp_only_layers": [], "num_experts_per_tok": 2, "num_experts": 4,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}},
    "recurrent_gemma": {"conv1d_width": 4, "logits_soft_cap": 30.0, "attention_bias": False,
                        "block_types": ["recurrent", "attention"]},
    "spark2_5": {"layer_types": _TWO, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "step3p5": {"num_attention_groups": 2, "layer_types": _TWO, "moe_num_experts": 4, "moe_top_k": 2,
                "moe_intermediate_size": 32, "share_expert_dim": 32},
}
"""Per-module args on top of :data:`COMMON`."""


def _guess(f: dataclasses.Field):
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if "dict" in t.lower():
        return {}
    if "list" in t.lower():
        return []
    if "int" in t:
        return 2
    if "float" in t:
        return 1e-5
    if "bool" in t:
        return False
    if "str" in t:
        return ""
    return None


def tiny_args(mod) -> dict:
    """Tiny args for ``mod.ModelArgs``: :data:`COMMON` for known field names, a guess
    from the annotation for other required fields, then :data:`OVERRIDES`."""
    name = mod.__name__.rsplit(".", 1)[1]
    args = {"model_type": name}
    for f in dataclasses.fields(mod.ModelArgs):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name in COMMON:
            args[f.name] = COMMON[f.name]
        elif f.name == "text_config":
            args[f.name] = {**COMMON, "model_type": name}
        elif required and f.name != "model_type":
            args[f.name] = _guess(f)
    extra = OVERRIDES.get(name, {})
    args.update(extra)
    if isinstance(args.get("text_config"), dict) and "text_config" not in extra:
        args["text_config"] = {**args["text_config"], **extra}  # wrappers: sizes live inside
    return args


IMPORT_ERRORS: dict[str, str] = {}
"""Modules that cannot be imported here, with the error (filled by :func:`decoder_modules`)."""


def decoder_modules() -> list[str]:
    """Every ``mlx_lm.models`` module that defines ``Model`` and ``ModelArgs``, plus the
    modules that fail to import (recorded in :data:`IMPORT_ERRORS`; olmo exits when
    ``hf_olmo`` is missing)."""
    out = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said):
                mod = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (ImportError, SystemExit) as err:  # olmo prints what it needs, then exits
            IMPORT_ERRORS[info.name] = said.getvalue().strip() or f"{type(err).__name__}: {err}"
            out.append(info.name)
            continue
        if hasattr(mod, "Model") and hasattr(mod, "ModelArgs"):
            out.append(info.name)
    return sorted(out)


MAX_PARAMETERS = 1_000_000
"""Tiny means tiny: the whole matrix must stay fast (a module above this needs an override)."""


def build(name: str, seed: int = 0):
    """A float32 random-weight model of module ``name`` (seeded), evaluated.

    Raises:
        ImportError: the module cannot be imported here (see :data:`IMPORT_ERRORS`).
    """
    if name in IMPORT_ERRORS:
        raise ImportError(IMPORT_ERRORS[name])
    if name in SKIP:
        raise NotImplementedError(SKIP[name])
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    args = mod.ModelArgs.from_dict(tiny_args(mod))
    mx.random.seed(seed)
    model = mod.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    n = sum(p.size for _, p in tree_flatten(model.parameters()))
    if n > MAX_PARAMETERS:
        raise AssertionError(f"{name}: {n} parameters with the generic tiny args; add an OVERRIDES entry")
    return model
