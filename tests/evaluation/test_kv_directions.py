"""Scores from keys and values, and budgets per KV head, in the simulator: the keep rule per head
against numpy, the budgets of retrieval heads summing to the one-budget total, the score components
and the needle attention against numpy written from the captured queries and keys."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.oracle import np_keep
from helpers.query_models import tiny_llama
from qfilters_mlx.config import KVCacheConfig
from qfilters_mlx.evaluation.kv_scores import components, kv_score, kv_score_arm
from qfilters_mlx.evaluation.oracle import attention_received
from qfilters_mlx.filters.needles import NeedlePrompt
from qfilters_mlx.evaluation.retrieval_heads import far_mass, split_budgets
from qfilters_mlx.filters.head_ranking import needle_attention
from qfilters_mlx.evaluation.simulate import MaskedArm, keep_masks, simulated_nll
from qfilters_mlx.filters.window_capture import keys_and_queries

HD = 16


def test_keep_masks_take_one_budget_per_head():
    scores = np.random.default_rng(0).integers(0, 5, (3, 40)).astype(np.float32)
    budgets, recent = (6, 20, 9), (2, 16, 0)
    m = keep_masks(scores, budgets, 2, list(recent), 3)
    for h in range(3):
        for t in range(3, 40):
            want = np.append(np_keep(scores[h, :t], budgets[h], 2, recent[h]), t)
            np.testing.assert_array_equal(np.nonzero(m[h, t])[0], want, err_msg=f"head {h} query {t}")
    with pytest.raises(ValueError, match="keep_masks"):
        keep_masks(scores, (6, 20), 2, list(recent), 3)  # one budget per head


def test_budgets_per_head_equal_per_layer_when_a_layer_s_heads_agree():
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(2).integers(0, 101, 50).tolist()
    cfg = KVCacheConfig(method="l2norm", head_dim=HD, qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4)
    per_layer = simulated_nll(model, tokens, MaskedArm(cfg, budgets=(10, 16)), 4)
    per_head = simulated_nll(model, tokens, MaskedArm(cfg, budgets=((10,) * 3, (16,) * 3)), 4)
    np.testing.assert_allclose(per_head, per_layer, atol=1e-5)
    with pytest.raises(ValueError, match="^layer 1: n_sink 2 \\+ recent window 9 exceed its budget 8$"):
        simulated_nll(model, tokens, MaskedArm(cfg, budgets=((10,) * 3, (16, 8, 16)),
                                               recents=((4, 4, 4), (4, 9, 4))), 4)


def test_split_budgets_sum_to_the_one_budget_total():
    ranking = np.random.default_rng(1).random((30, 3))
    for budget, big in ((128, 512), (64, 256), (100, 333)):
        budgets, recents, top = split_budgets(ranking, budget, big, budget // 2, 4)
        b = np.array(budgets)
        assert b.sum() == 90 * budget  # the bytes held: the sum of the per-head budgets
        k = (90 * budget - 90 * (budget // 2)) // (big - budget // 2)
        want = sorted(divmod(int(i), 3) for i in np.argsort(-ranking, axis=None)[:k])
        assert top == want and all(b[lh] == big for lh in top)
        rest = np.array([b[l, h] for l in range(30) for h in range(3) if (l, h) not in top])
        assert rest.min() >= budget // 2 and rest.max() - rest.min() <= 1  # the left-over tokens spread
        assert np.array_equal(np.array(recents), b - 4)
    budgets, _, top = split_budgets(ranking, 128, 512, None, 4, heads=3)  # three heads, the rest share
    b = np.array(budgets)
    assert b.sum() == 90 * 128 and len(top) == 3 and sorted(b.flat)[-4] in ((90 * 128 - 3 * 512) // 87 + 1,
                                                                            (90 * 128 - 3 * 512) // 87)
    with pytest.raises(ValueError, match="need n_sink < small <= budget < big"):
        split_budgets(ranking, 64, 64, 32, 4)
    with pytest.raises(ValueError, match="need n_sink < small <= budget < big"):
        split_budgets(ranking, 64, 1024, None, 4, heads=10)  # nothing left for the other heads


def test_score_components_against_numpy():
    rng = np.random.default_rng(3)
    k, v = rng.standard_normal((3, 20, HD)), rng.standard_normal((3, 20, 8))
    f = rng.standard_normal((3, HD)).astype(np.float32)
    c = components(k.astype(np.float32), v.astype(np.float32), f, -1)
    np.testing.assert_allclose(c["value"], np.log(np.linalg.norm(v, axis=-1)), rtol=1e-5)
    np.testing.assert_allclose(c["filter"], -(k @ f[:, :, None])[..., 0], rtol=1e-4, atol=1e-4)
    for h in range(3):
        for t in range(20):
            a = k[h, :t + 1].mean(0)
            cos = k[h, t] @ a / np.linalg.norm(k[h, t]) / np.linalg.norm(a)
            assert c["novelty"][h, t] == pytest.approx(-cos, abs=1e-5)
    s = np.array(kv_score({"value": 1.0, "novelty": 2.0})(0, mx.array(k[None].astype(np.float32)),
                                                          mx.array(v[None].astype(np.float32))))[0]
    t = 11  # a mix standardizes each component by its moments over tokens 0..t
    z = [(x[:, t] - x[:, :t + 1].mean(1)) / x[:, :t + 1].std(1) for x in (c["value"], c["novelty"])]
    np.testing.assert_allclose(s[:, t], z[0] + 2 * z[1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="weights"):
        kv_score({"keys": 1.0})
    with pytest.raises(ValueError, match="needs filters"):
        kv_score({"filter": 1.0})


def test_a_value_score_sees_the_layer_s_values():
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(4).integers(0, 101, 40).tolist()
    cfg = KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=12, qfilters_n_sink=2, qfilters_recent=4)
    layer0 = model.model.layers[0]
    x = layer0.input_layernorm(model.model.embed_tokens(mx.array(tokens[:-1])[None]))
    v0 = layer0.self_attn.v_proj(x).reshape(1, len(tokens) - 1, 3, HD).transpose(0, 2, 1, 3)
    want = np.log(np.linalg.norm(np.array(v0[0]), axis=-1))
    seen = {}

    def score(layer, keys, values):
        seen[layer] = np.array(values[0])
        return kv_score({"value": 1.0})(layer, keys, values)

    got = simulated_nll(model, tokens, MaskedArm(cfg, score=score, with_values=True), 4)
    np.testing.assert_allclose(np.log(np.linalg.norm(seen[0], axis=-1)), want, rtol=1e-4, atol=1e-4)
    same = simulated_nll(model, tokens, kv_score_arm(cfg, {"value": 1.0}), 4)
    np.testing.assert_allclose(got, same, atol=1e-6)


def test_needle_attention_and_far_mass_against_numpy():
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(5).integers(0, 101, 30).tolist()
    p = NeedlePrompt(tokens, 27, "x", [28, 29], 10)  # answer key tokens 28, 29; needle at 10, 11
    got = needle_attention(model, p)
    (layers,) = keys_and_queries(model, [tokens[:-1]])
    for layer, (keys, queries, _) in enumerate(layers):
        want = np.zeros(3)
        for qh in range(9):
            for t in (27, 28):
                w = keys[qh // 3, :t + 1].astype(np.float64) @ queries[qh, t] / np.sqrt(HD)
                w = np.exp(w - w.max())
                want[qh // 3] += (w[10] + w[11]) / w.sum() / 3 / 2
        np.testing.assert_allclose(got[layer], want, rtol=1e-4, atol=1e-6, err_msg=f"layer {layer}")
    (received,) = attention_received(model, tokens, [5])
    fm = far_mass(model, tokens, 5, 2)
    np.testing.assert_allclose(fm, np.stack([r[:, 2:].sum(1) / 3 / 30 for r in received]), rtol=1e-5)
