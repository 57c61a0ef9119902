"""The oracle score: the attention each key receives later in a full-cache pass, checked against
the same sums written out in numpy from the post-RoPE queries and keys (captured by another
path: ``keys_and_queries``), and the oracle arm's masks against the numpy keep rule."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.oracle import np_keep
from helpers.query_models import tiny_llama
from qfilters_mlx.config import KVCacheConfig
from qfilters_mlx.evaluation.perplexity import full_cache_nll
from qfilters_mlx.evaluation.oracle import attention_received, oracle_arm, oracle_arms
from qfilters_mlx.evaluation.simulate import MaskedArm, keep_masks, simulated_nll
from qfilters_mlx.filters.window_capture import keys_and_queries

HD = 16  # tiny_llama: hidden 144 / 9 query heads over 3 KV heads


def np_received(keys, queries, windows):
    """``[H_kv, T]``: for key ``j`` of KV head ``h``, the causal softmax weights of query heads
    ``3h, 3h+1, 3h+2`` summed over the queries ``t > j + windows[h]`` (float64, loops)."""
    H, T, D = keys.shape
    G = queries.shape[0] // H
    out = np.zeros((H, T))
    for qh in range(queries.shape[0]):
        h = qh // G
        k, q = keys[h].astype(np.float64), queries[qh].astype(np.float64)
        for t in range(T):
            logits = k[: t + 1] @ q[t] / np.sqrt(D)
            w = np.exp(logits - logits.max())
            w /= w.sum()
            for j in range(t + 1):
                if t > j + windows[h]:
                    out[h, j] += w[j]
    return out


@pytest.mark.parametrize("windows", [0, 3, (0, 5, 2), 40])
def test_received_attention_equals_the_numpy_sums(windows):
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(7).integers(0, 101, 37).tolist()
    per_head = (lambda layer, heads: list(windows)) if isinstance(windows, tuple) else windows
    (got,) = attention_received(model, tokens, [per_head])
    (layers,) = keys_and_queries(model, [tokens])
    assert len(got) == 2
    for layer, (keys, queries, _) in enumerate(layers):
        w = list(windows) if isinstance(windows, tuple) else [windows] * 3
        want = np_received(keys, queries, w)
        assert got[layer].shape == (3, 37) and got[layer].dtype == np.float32
        np.testing.assert_allclose(got[layer], want, atol=2e-5, rtol=1e-5, err_msg=f"layer {layer}")
    if windows == 40:  # no query comes after a key has left a 40-token window in 37 tokens
        assert all((g == 0).all() for g in got)


def test_the_oracle_arm_keeps_the_most_attended_keys_outside_the_window():
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(3).integers(0, 101, 60).tolist()
    cfg = KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=16, qfilters_recent=5,
                        qfilters_n_sink=2)
    arm = oracle_arm(model, tokens, cfg)
    (layers,) = keys_and_queries(model, [tokens[:-1]])
    for layer, (keys, queries, _) in enumerate(layers):
        want_scores = np_received(keys, queries, [5, 5, 5])
        scores = np.array(arm.scores(layer, mx.array(keys)[None]))[0]
        np.testing.assert_allclose(scores, want_scores, atol=2e-5, rtol=1e-5)
        m = keep_masks(scores, 16, 2, [5, 5, 5], 8)
        for h in range(3):
            for t in (8, 30, 58):  # what the cache kept after t - 1 by the numpy keep rule
                kept = np.append(np_keep(want_scores[h, :t], 16, 2, 5), t)
                np.testing.assert_array_equal(np.nonzero(m[h, t])[0], kept)
    nll = simulated_nll(model, tokens, arm, 8)
    full = full_cache_nll(model, tokens, 8)
    assert len(nll) == 52 and np.abs(np.array(nll) - np.array(full)).max() > 1e-3  # it evicted


def test_the_oracle_arm_refuses_other_tokens_and_what_it_does_not_cover():
    model = tiny_llama(seed=1)
    tokens = list(range(30))
    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    arm = oracle_arm(model, tokens, cfg)
    with pytest.raises(ValueError, match="^oracle_arm: scores for 29 keys of its own tokens, asked for 39$"):
        simulated_nll(model, list(range(40)), arm, 4)
    with pytest.raises(ValueError, match=r"^inputs: 1-D token ids, got shape \(0,\)$"):
        attention_received(model, [], [0])
    with pytest.raises(ValueError, match=r"layer 0 needs 3 windows >= 0, got \[1, 2\]"):
        attention_received(model, tokens, [3, lambda layer, heads: [1, 2]])
    with pytest.raises(ValueError, match="^attention_received: no window rule given$"):
        attention_received(model, tokens, [])
    with pytest.raises(ValueError, match="a window rule is an int or windows"):
        attention_received(model, tokens, [1.5])
    with pytest.raises(ValueError, match="simulated_nll covers the streaming mode only"):
        from qfilters_mlx.config import CompressOnce

        oracle_arm(model, tokens, KVCacheConfig(method="qfilters", head_dim=HD, mode=CompressOnce(0.5)))
    assert isinstance(arm, MaskedArm)


def test_several_rules_in_one_pass_equal_one_pass_each():
    model = tiny_llama(seed=2)
    tokens = np.random.default_rng(5).integers(0, 101, 41).tolist()
    rules = [0, 7, lambda layer, heads: [layer, 2, 9]]
    together = attention_received(model, tokens, rules)
    for rule, got in zip(rules, together):
        (alone,) = attention_received(model, tokens, [rule])
        for a, b in zip(got, alone):
            np.testing.assert_array_equal(a, b)
    cfgs = [KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=b, qfilters_recent=b // 2,
                          qfilters_n_sink=2)
            for b in (8, 16)]
    arms = oracle_arms(model, tokens, cfgs)
    keys = mx.zeros((1, 3, 40, HD))
    for cfg, arm, rule in zip(cfgs, arms, (4, 8)):
        (want,) = attention_received(model, tokens[:-1], [rule])
        np.testing.assert_array_equal(np.array(arm.scores(1, keys))[0], want[1])
        assert arm.config is cfg
