"""Evaluation harness on a tiny random llama: batched arms equal arms run alone,
padding masks, full-cache NLL against a plain forward pass, score quality
against independent numpy/scipy computations, retrieval prompt layout."""

from __future__ import annotations

import math
from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache
from scipy.stats import spearmanr

from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.evaluation.arms import Arm, default_arms, expand, retrieval_arms
from qfilters_mlx.evaluation.multi_arm import MultiArmCache
from qfilters_mlx.evaluation.perplexity import (
    batched_streaming_nll,
    full_cache_nll,
    perplexity,
    streaming_nll,
)
from qfilters_mlx.evaluation.retrieval import batched_greedy
from qfilters_mlx.evaluation.score_quality import received_attention, score_quality


def tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64, vocab=97):
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=128, num_attention_heads=heads, rms_norm_eps=1e-5,
                           vocab_size=vocab, num_key_value_heads=kv_heads, head_dim=head_dim,
                           rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


TOKENS = [(13 * i + 5) % 97 for i in range(96)]


def caches_for(model, config):
    return [QFiltersKVCache(config, layer_idx=i) for i in range(len(model.layers))]


def test_arm_list_is_data_and_expands_valid_configs():
    arms = default_arms()
    names = [a.name for a in arms]
    assert len(names) == len(set(names)) == 13
    cells = expand(arms, [8, 64])
    # budget 8: n_sink 4 + recent 4 (= 8/2) >= 8 is invalid and skipped; 8/4 = 2 is fine.
    assert {(a.name, b) for a, b, _ in cells if b == 8} == {
        (a.name, 8) for a in arms if a.recent != Fraction(1, 2)}
    assert sum(b == 64 for _, b, _ in cells) == 13
    c = next(c for a, b, c in cells if a.name == "qfilters-keys-1@r1/4" and b == 64)
    assert (c.method, c.qfilters_sign, c.qfilters_recent, c.qfilters_budget) == ("qfilters", -1, 16, 64)
    r = retrieval_arms(arms)
    assert [a.name for a in r] == ["qfilters-keys+1@r1/2", "qfilters-keys-1@r1/2", "l2norm@r1/2",
                                   "random@r1/2", "streaming_llm"]
    # a new arm plugs in with its own cache factory
    made = []
    extra = Arm("custom", "qfilters",
                cache_factory=lambda cfg, i, **build: made.append((i, build)) or QFiltersKVCache(cfg, i, **build))
    assert extra.make_cache(extra.config(32), 3, backend="reference").backend.name == "reference"
    assert made == [(3, {"backend": "reference"})]


def test_mask_hides_padding_and_is_causal():
    cfg = lambda b: KVCacheConfig(method="streaming_llm", head_dim=4, qfilters_budget=b)  # noqa: E731
    a, b = QFiltersKVCache(cfg(6)), QFiltersKVCache(cfg(9))
    multi = MultiArmCache([a, b])
    k = mx.ones((2, 1, 12, 4))
    multi.update_and_fetch(k, k)
    assert multi.sizes() == [6, 9]
    N = 3
    mask = np.array(multi.make_mask(N))
    assert mask.shape == (2, 1, N, 9 + N)
    want = np.zeros((2, N, 12), bool)
    for row, size in enumerate([6, 9]):
        for q in range(N):
            for j in range(12):
                want[row, q, j] = (j >= 9 - size) and (j <= 9 + q)
    np.testing.assert_array_equal(mask[:, 0], want)
    keys, _ = multi.update_and_fetch(mx.ones((2, 1, N, 4)) * 2, mx.ones((2, 1, N, 4)))
    assert keys.shape == (2, 1, 12, 4)
    np.testing.assert_array_equal(np.array(keys[0, 0, :3, 0]), 0)  # left padding of the shorter row
    np.testing.assert_array_equal(np.array(keys[:, 0, -N:, 0]), 2)  # new tokens last in every row


def test_equal_sizes_use_the_cache_mask():
    cfg = KVCacheConfig(method="streaming_llm", head_dim=4, qfilters_budget=8)
    multi = MultiArmCache([QFiltersKVCache(cfg), QFiltersKVCache(cfg)])
    multi.update_and_fetch(mx.ones((2, 1, 5, 4)), mx.ones((2, 1, 5, 4)))
    assert multi.make_mask(1) is None and multi.make_mask(4) == "causal"


@pytest.mark.parametrize("budgets", [(24, 24, 24, 24, 24), (16, 24, 40, 20, 33)])
def test_batched_nll_equals_each_arm_alone(model, budgets):
    arms = [("qfilters", 1, 0), ("qfilters", -1, 4), ("l2norm", 1, 2), ("random", 1, 3),
            ("streaming_llm", 1, 0)]
    configs = [KVCacheConfig(method=m, head_dim=16, qfilters_budget=b, qfilters_n_sink=2,
                             qfilters_recent=r, qfilters_calib_tokens=12, qfilters_sign=s, qfilters_seed=7, qfilters_filter_source="keys")
               for (m, s, r), b in zip(arms, budgets)]
    rows = [caches_for(model, c) for c in configs]
    batched = batched_streaming_nll(model, TOKENS, rows, prefix=12)
    assert len(batched) == len(configs) and all(len(r) == len(TOKENS) - 12 for r in batched)
    for c, got, row in zip(configs, batched, rows):
        alone = streaming_nll(model, TOKENS, caches_for(model, c), prefix=12)
        np.testing.assert_allclose(got, alone, atol=1e-4, rtol=1e-4)
        assert all(cache.size() == c.qfilters_budget for cache in row)
    # eviction happened and changed the predictions (the test is not vacuous)
    full = full_cache_nll(model, TOKENS, 12)
    assert max(abs(x - y) for x, y in zip(batched[0], full)) > 1e-3


def test_full_cache_nll_equals_one_forward_pass(model):
    toks = mx.array(TOKENS)
    logits = model(toks[None, :-1])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = -np.take_along_axis(np.array(logp), np.array(TOKENS[1:])[:, None], axis=1)[:, 0]
    got = full_cache_nll(model, TOKENS, prefix=10, chunk=17)
    np.testing.assert_allclose(got, want[9:], rtol=1e-4, atol=1e-5)
    stream = streaming_nll(model, TOKENS, [KVCache() for _ in model.layers], prefix=10)
    np.testing.assert_allclose(stream, want[9:], rtol=1e-4, atol=1e-4)
    assert perplexity(got) == pytest.approx(math.exp(np.mean(want[9:])), rel=1e-5)


def test_batched_greedy_rows_equal_alone(model):
    prompt = TOKENS[:50]
    configs = [KVCacheConfig(method=m, head_dim=16, qfilters_budget=b, qfilters_n_sink=2,
                             qfilters_recent=4, qfilters_calib_tokens=8, qfilters_filter_source="keys")
               for m, b in [("l2norm", 16), ("streaming_llm", 24), ("qfilters", 20)]]
    got = batched_greedy(model, prompt, [caches_for(model, c) for c in configs], 6, chunk=8)
    for c, g in zip(configs, got):
        assert g == batched_greedy(model, prompt, [caches_for(model, c)], 6, chunk=8)[0]
    full = batched_greedy(model, prompt, [[KVCache() for _ in model.layers]], 6, chunk=50)[0]
    generated = []
    toks = list(prompt)
    for _ in range(6):  # independent reference: no cache, whole sequence each step
        nxt = int(mx.argmax(model(mx.array(toks)[None])[0, -1]))
        generated.append(nxt)
        toks.append(nxt)
    assert full == generated


def test_received_attention_matches_explicit_softmax():
    rng = np.random.default_rng(0)
    Hq, Hkv, T, D = 4, 2, 20, 8
    q, k = rng.normal(size=(Hq, T, D)), rng.normal(size=(Hkv, T, D))
    got = received_attention(q, k, cached=12, window=5)
    want = np.zeros((Hkv, 12))
    for h in range(Hq):
        for t in range(12, 17):
            logits = np.array([q[h, t] @ k[h // 2, j] / math.sqrt(D) for j in range(t + 1)])
            w = np.exp(logits - logits.max())
            w /= w.sum()
            want[h // 2] += w[:12] / (5 * 2)
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_score_quality_against_scipy_on_planted_geometry():
    rng = np.random.default_rng(1)
    Hkv, g, T, D = 2, 2, 64, 8
    axis = np.zeros(D)
    axis[0] = 1.0
    # Keys with a varying projection on the axis; queries aligned with it: tokens with a
    # large projection receive more attention, so the +1 key-SVD score correlates positively.
    keys = rng.normal(size=(Hkv, T, D)) * 0.3
    keys[:, :, 0] += 2.0 + rng.uniform(-1, 1, size=(Hkv, T))
    queries = rng.normal(size=(Hkv * g, T, D)) * 0.1 + 3.0 * axis
    out = score_quality(mx.array(queries[None], dtype=mx.float32), mx.array(keys[None], dtype=mx.float32),
                        layer=0, cached=48, window=8, calib_tokens=32, n_sink=2)
    target = received_attention(queries.astype(np.float32), keys.astype(np.float32), 48, 8)
    for h in range(Hkv):
        proj = keys[h, 2:48] @ axis  # the filter is the top singular direction, ~ the axis
        want = spearmanr(proj, target[h, 2:]).statistic
        assert out["qfilters-keys+1"][h] == pytest.approx(want, abs=0.05)
        assert out["qfilters-keys+1"][h] > 0.8
        assert out["qfilters-keys-1"][h] == pytest.approx(-out["qfilters-keys+1"][h], abs=1e-12)
        want_l2 = spearmanr(-np.linalg.norm(keys[h, 2:48].astype(np.float32), axis=1), target[h, 2:]).statistic
        assert out["l2norm"][h] == pytest.approx(want_l2, abs=1e-6)
        want_rec = spearmanr(np.arange(2, 48), target[h, 2:]).statistic
        assert out["recency (streaming_llm)"][h] == pytest.approx(want_rec, abs=1e-12)


def test_retrieval_prompt_places_the_needle():
    from qfilters_mlx.evaluation.retrieval import NEEDLE, QUESTION, retrieval_prompt

    class Tok:  # whitespace tokenizer with a trivial chat template
        vocab: dict = {}

        def encode(self, text, add_special_tokens=False):
            return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return "<user> " + messages[0]["content"] + " <assistant>"

    text = "\n\n".join(f"para{i} " + "w " * 9 for i in range(100))  # 10 words per paragraph
    tok = Tok()
    inv = lambda ids: [k for i in ids for k, v in tok.vocab.items() if v == i]  # noqa: E731
    for depth, before in [(0.0, 0), (0.5, 10), (1.0, 20)]:
        words = inv(retrieval_prompt(tok, text, 220, depth, "12345"))
        needle_at = words.index("12345.")
        paras_before = [w for w in words[:needle_at] if w.startswith("para")]
        assert len(paras_before) == before
        assert sum(w.startswith("para") for w in words) == 20
        assert " ".join(words[-8:-1]) == "Question: " + QUESTION
    assert NEEDLE.format(key="1").startswith("The secret pass key is 1")


def test_settings_compare_equal_after_a_json_round_trip():
    import json

    from qfilters_mlx.evaluation.run import EvalSettings

    s = EvalSettings.full()
    assert json.loads(json.dumps(s.to_json())) == s.to_json()


def test_query_arms_batched_equal_alone(model):
    """MultiArmCache forwards each row's queries to its cache (online query filter, auto sign)."""
    from qfilters_mlx.evaluation.arms import query_arms

    rng = np.random.default_rng(3)
    filters = mx.array(rng.standard_normal((len(model.layers), 2, 16)).astype(np.float32))
    arms = query_arms(filters)
    assert [a.family for a in arms] == ["qfilters-queries", "qfilters-keys-auto", "qfilters-calibrated"]
    configs = [a.config(16, n_sink=2, calib_tokens=12, head_dim=16) for a in arms]
    rows = [[a.make_cache(c, i) for i in range(len(model.layers))] for a, c in zip(arms, configs)]
    batched = batched_streaming_nll(model, TOKENS, rows, prefix=12)
    for a, c, got, row in zip(arms, configs, batched, rows):
        single = [a.make_cache(c, i) for i in range(len(model.layers))]
        alone = batched_streaming_nll(model, TOKENS, [single], prefix=12)[0]
        np.testing.assert_allclose(got, alone, atol=1e-4, rtol=1e-4)
        assert all(cache.filter is not None and cache.size() == 16 for cache in row)
    np.testing.assert_array_equal(np.array(rows[2][1].filter), np.array(filters[1]))
