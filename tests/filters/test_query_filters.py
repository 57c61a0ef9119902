"""The paper's estimator: query-derived filters, auto sign, filter files."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.query_models import tiny_llama
from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache, observe_queries
from qfilters_mlx.backends import reference as ref
from qfilters_mlx.filters import calibration as cal


def planted(rng, Hq=9, T=256, D=32, B=1):
    """Queries with mean +5u plus noise; keys spread along u (mean projection negative)."""
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    q = 5.0 * u + rng.standard_normal((B, Hq, T, D))
    k = (-1.0 + 2.0 * rng.standard_normal((B, Hq // 3, T, 1))) * u + 0.3 * rng.standard_normal((B, Hq // 3, T, D))
    return q.astype(np.float32), k.astype(np.float32), u


@pytest.mark.parametrize("negate_svd", [False, True])
def test_query_filter_recovers_axis_with_positive_query_projection(monkeypatch, negate_svd):
    rng = np.random.default_rng(0)
    q, _, u = planted(rng)
    if negate_svd:
        svd = mx.linalg.svd

        def negated(a, *args, **kw):
            U, S, Vt = svd(a, *args, **kw)
            return -U, S, -Vt

        monkeypatch.setattr(mx.linalg, "svd", negated)
    f = np.array(ref.estimate_filter_from_queries(mx.array(q), 3))
    assert f.shape == (3, 32)
    assert np.all(f @ u > 0.99)
    assert np.all(np.einsum("bhtd,hd->bht", q.reshape(1, 3, 3 * 256, 32), f).mean(-1) > 0)


def test_gqa_averaging_9_query_heads_over_3_kv_heads():
    rng = np.random.default_rng(1)
    q = (rng.standard_normal((2, 9, 40, 16)) + rng.standard_normal((1, 9, 1, 16))).astype(np.float32)
    f = np.array(ref.estimate_filter_from_queries(mx.array(q), 3))
    per_head = []
    for h in range(9):
        x = q[:, h].reshape(-1, 16).astype(np.float64)
        v = np.linalg.svd(x)[2][0]
        per_head.append(v if (x @ v).mean() > 0 else -v)
    want = np.stack(per_head).reshape(3, 3, 16).mean(1)
    want /= np.linalg.norm(want, axis=-1, keepdims=True)
    np.testing.assert_allclose(f, want, atol=1e-4)
    with pytest.raises(ValueError, match="divide"):
        ref.estimate_filter_from_queries(mx.array(q), 4)


def test_filters_file_round_trip_and_mismatch(tmp_path):
    model = tiny_llama()
    filters = cal.calibrate_filters(model, [list(range(60)), list(range(30, 90))], samples=50)
    assert filters.shape == (2, 3, 16)
    np.testing.assert_allclose(np.linalg.norm(np.array(filters), axis=-1), 1.0, atol=1e-5)
    path = str(tmp_path / "f.safetensors")
    cal.save_filters(path, filters, model, calibration_text="unit test", calibration_tokens=120)
    loaded, meta = cal.load_filters(path, model)
    np.testing.assert_array_equal(np.array(loaded), np.array(filters))
    assert meta["n_kv_heads"] == "3" and meta["sign_convention"] == "score = +(k . f)"
    assert meta["calibration_tokens"] == "120"
    # identity mismatch names the differing fields (was: only two opaque hashes)
    with pytest.raises(ValueError, match="calibrated for another model.*differing fields: n_parameters"):
        cal.load_filters(path, tiny_llama(layers=3))
    with pytest.raises(ValueError, match="differing fields: weights: ") as err:
        cal.load_filters(path, tiny_llama(seed=9))  # same shapes, other weights
    assert "parameters:" not in str(err.value)
    with pytest.raises(ValueError, match="shape"):
        cal.save_filters(path, filters[:1], model)
    with pytest.raises(ValueError, match="shape"):
        KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_filters=np.zeros((2, 3, 8)), qfilters_recent=0))


def test_identity_ignores_how_mlx_lm_parses_args_and_legacy_files_warn(tmp_path):
    """The identity comes from the parameters, not vars(model.args); 0.1 files
    (no model_fields) load with a warning when their shapes fit, and are refused otherwise."""
    model = tiny_llama()
    before = cal.identity_fields(model)
    model.args.some_new_field_of_a_newer_mlx_lm = 1  # what a different mlx-lm install changes
    assert cal.identity_fields(model) == before
    f = cal.calibrate_filters(model, [list(range(30))], samples=20)
    legacy = str(tmp_path / "legacy.safetensors")
    mx.save_safetensors(legacy, {"filters": f}, {"format": cal.FORMAT, "model_id": "88e0000000000000",
                                                  "sign_convention": cal.SIGN_CONVENTION})
    with pytest.warns(UserWarning, match="identity is not verified"):
        loaded, _ = cal.load_filters(legacy, model)
    np.testing.assert_array_equal(np.array(loaded), np.array(f))
    with pytest.raises(ValueError, match="shape"):
        cal.load_filters(legacy, tiny_llama(layers=3))


def test_calibrated_filter_matches_captured_queries():
    """Offline calibration equals the estimator applied to independently recomputed queries."""
    model = tiny_llama(seed=3, layers=1)
    toks = mx.array([list(range(5, 45))])
    f = cal.calibrate_filters(model, [toks[0].tolist()], samples=10_000)
    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(toks))
    q = attn.rope(attn.q_proj(h).reshape(1, 40, 9, 16).transpose(0, 2, 1, 3))
    np.testing.assert_allclose(np.array(f[0]), np.array(ref.estimate_filter_from_queries(q, 3)), atol=1e-5)


def test_paper_filters_converter(tmp_path):
    model = tiny_llama()
    rng = np.random.default_rng(2)
    paper = rng.standard_normal((2, 3, 16)).astype(np.float32)
    src = str(tmp_path / "paper.safetensors")
    mx.save_safetensors(src, {"q_filters": mx.array(paper)})
    dst = str(tmp_path / "ours.safetensors")
    cal.convert_paper_filters(src, dst, model)
    ours, meta = cal.load_filters(dst, model)
    k = rng.standard_normal((5, 16)).astype(np.float32)
    # the paper scores -(k . f_paper); ours scores +(k . f_ours): identical rankings
    np.testing.assert_allclose(k @ np.array(ours)[1, 2], -(k @ paper[1, 2]), rtol=1e-6)
    assert "score = -(k . f)" in meta["converted_from"]
    np.save(tmp_path / "paper.npy", paper)
    np.testing.assert_array_equal(np.array(cal.convert_paper_filters(str(tmp_path / "paper.npy"), dst, model)), -paper)


def test_given_filters_evict_at_once_and_ignore_calib():
    model = tiny_llama()
    f = np.random.default_rng(4).standard_normal((2, 3, 16)).astype(np.float32)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_filters=f, qfilters_budget=8,
                                                           qfilters_n_sink=1, qfilters_calib_tokens=1000, qfilters_recent=0))
    model(mx.array([list(range(20))]), cache=caches)
    assert all(c.size() == 8 for c in caches)
    np.testing.assert_array_equal(np.array(caches[1].filter), f[1])


def run_online(model, config, chunks, tokens):
    caches = KVCacheBuilder.for_model(model, config)
    with observe_queries(model, caches):
        start = 0
        for L in chunks:
            model(mx.array([tokens[start:start + L]]), cache=caches)
            start += L
    return caches


@pytest.mark.parametrize("source,sign", [("queries", 1), ("keys", "auto")])
def test_online_query_based_filters_are_path_independent(source, sign):
    model = tiny_llama(seed=5)
    tokens = [(13 * i) % 101 for i in range(70)]
    cfg = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4,
                        qfilters_calib_tokens=23, qfilters_filter_source=source, qfilters_sign=sign)
    runs = [run_online(model, cfg, ch, tokens) for ch in ([70], [1] * 70, [10, 20, 5, 35])]
    for caches in runs[1:]:
        # Filters come from the first 23 tokens, seen identically by every layer before
        # any eviction. Layer 0's keys do not depend on earlier evictions, so its kept set
        # must match too; deeper layers' keys legitimately depend on what layer 0 kept.
        for a, b in zip(runs[0], caches):
            np.testing.assert_allclose(np.array(a.filter), np.array(b.filter), atol=1e-5)
        np.testing.assert_array_equal(np.array(runs[0][0].kept_positions()),
                                      np.array(caches[0].kept_positions()))
    # the online query filter equals the estimator on the first 23 queries of layer 0
    if source == "queries":
        attn = model.model.layers[0].self_attn
        toks = mx.array([tokens[:23]])
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(toks))
        q = attn.rope(attn.q_proj(h).reshape(1, 23, 9, 16).transpose(0, 2, 1, 3))
        np.testing.assert_allclose(np.array(runs[0][0].filter),
                                   np.array(ref.estimate_filter_from_queries(q, 3)), atol=1e-5)


def test_auto_sign_without_observer_raises_before_state_changes():
    c = QFiltersKVCache(KVCacheConfig(qfilters_sign="auto", qfilters_budget=8, qfilters_n_sink=1, qfilters_recent=0, qfilters_filter_source="keys"))
    k = mx.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="observe_queries"):
        c.update_and_fetch(k, k)
    assert c.offset == 0 and c.empty()
    with pytest.raises(ValueError, match="qfilters_sign"):
        KVCacheConfig(qfilters_filter_source="queries", qfilters_sign=-1, qfilters_recent=0)


def test_auto_sign_points_the_key_filter_at_the_queries():
    """Keys' mean projection is negative, queries' positive: the key-SVD filter is oriented
    against the queries, and 'auto' flips it (per KV head) so that queries project positively."""
    rng = np.random.default_rng(6)
    q, k, u = planted(rng, Hq=6, T=64, D=16)
    cfg = KVCacheConfig(qfilters_sign="auto", qfilters_budget=16, qfilters_n_sink=1,
                        qfilters_calib_tokens=64, qfilters_recent=0, qfilters_filter_source="keys")
    c = QFiltersKVCache(cfg)
    c.queries_observed = True
    c.update_and_fetch(mx.array(k), mx.array(k))
    assert c.filter is None  # waits for the queries of the same call
    c.observe_queries(mx.array(q))
    f = np.array(c.filter)
    key_only = np.array(ref.estimate_filter_from_keys(mx.array(k)))
    assert np.all(key_only @ u < -0.9)
    assert np.all(f @ u > 0.9)
    assert c.size() == 16


def _observed(cfg):
    c = QFiltersKVCache(cfg)
    c.queries_observed = True
    return c


def test_query_source_trim_and_reload_before_calibration_keep_the_first_queries(tmp_path):
    """The filter comes from the queries of tokens 0..calib-1 whatever trims and prompt-cache
    reloads happen before the first eviction."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    rng = np.random.default_rng(7)
    q = mx.array(rng.standard_normal((1, 6, 30, 8)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 30, 8)).astype(np.float32))
    cfg = KVCacheConfig(qfilters_filter_source="queries", qfilters_budget=16, qfilters_n_sink=1,
                        qfilters_calib_tokens=10, qfilters_recent=0)
    want = np.array(ref.estimate_filter_from_queries(q[:, :, :10], 2))

    def step(c, a, b):
        c.update_and_fetch(k[:, :, a:b], k[:, :, a:b])
        c.observe_queries(q[:, :, a:b])

    # trim back into the calibration tokens after the filter was estimated (no eviction yet)
    c = _observed(cfg)
    step(c, 0, 12)
    assert c.filter is not None and c.trim(5) == 5 and c.filter is None
    step(c, 7, 14)
    np.testing.assert_allclose(np.array(c.filter), want, atol=1e-6)
    # save after 6 tokens, reload, continue: same filter and kept set as without the reload
    a = _observed(cfg)
    step(a, 0, 6)
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, [a])
    (b,) = load_prompt_cache(path)
    b.queries_observed = True
    for c in (a, b):
        step(c, 6, 30)
    np.testing.assert_allclose(np.array(b.filter), want, atol=1e-6)
    np.testing.assert_array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))
    # once calibrated, a reloaded cache needs no observer
    save_prompt_cache(path, [a])
    (d,) = load_prompt_cache(path)
    d.update_and_fetch(k[:, :, :1], k[:, :, :1])
    with pytest.raises(ValueError, match="queries"):
        _observed(cfg).observe_queries(q[0])
