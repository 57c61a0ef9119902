"""Documented rules checked exactly against the rule written out in numpy (behaviour the
mutation check needs pinned: ``tools/mutation.py``, bench/results/mutation.md)."""

import mlx.core as mx
import numpy as np
import pytest
from oracle import np_victim

from qfilters_mlx.backends import reference as ref


def test_decode_select_stores_the_new_token_and_frees_the_documented_victim():
    rng = np.random.default_rng(3)
    B, H, S, n_sink, recent = 2, 3, 9, 2, 2
    for trial in range(12):
        position = 20 + trial
        # distinct past positions per row, in slot order shuffled; ties in scores
        positions = np.stack([np.stack([rng.permutation(np.arange(position))[:S]
                                        for _ in range(H)]) for _ in range(B)]).astype(np.int64)
        positions[..., 0] = np.arange(n_sink)[rng.integers(0, n_sink)]  # a sink in slot 0
        scores = rng.integers(-2, 2, size=(B, H, S)).astype(np.float32)
        free = rng.integers(0, S, size=(B, H)).astype(np.int32)
        new = rng.integers(-2, 2, size=(B, H, 1)).astype(np.float32)
        new[0, 0, 0] = [np.nan, np.inf, -np.inf][trial % 3]
        s, p, v = ref.decode_select(mx.array(scores), mx.array(positions), mx.array(new),
                                    mx.array(free), position, n_sink, recent)
        exp_s, exp_p = scores.copy(), positions.copy()
        for b in range(B):
            for h in range(H):
                x = new[b, h, 0]
                exp_s[b, h, free[b, h]] = x if np.isfinite(x) else -np.inf
                exp_p[b, h, free[b, h]] = position
        np.testing.assert_array_equal(np.array(s), exp_s)
        np.testing.assert_array_equal(np.array(p), exp_p)
        assert np.array(s).dtype == np.float32 and np.array(p).dtype == np.int64
        np.testing.assert_array_equal(np.array(v), np_victim(exp_s, exp_p, position, n_sink, recent))


def test_observe_queries_rejects_each_bad_input_before_any_state_changes():
    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    cfg = KVCacheConfig(method="qfilters", qfilters_budget=4, qfilters_n_sink=1, qfilters_recent=1,
                        qfilters_calib_tokens=8, qfilters_filter_source="queries",
                        qfilters_backend="reference")
    fresh = QFiltersKVCache(cfg)
    with pytest.raises(ValueError, match=r"^queries must be an mx.array \[B, H_q, L, D\] observed after an update$"):
        fresh.observe_queries(mx.ones((1, 4, 3, 16)))  # no update yet
    c = QFiltersKVCache(cfg)
    c.queries_observed = True  # as inside `observe_queries(model, caches)`
    k = mx.ones((1, 2, 3, 16))
    c.update_and_fetch(k, k)  # B=1, H_kv=2, D=16, offset 3
    bad_type = [np.ones((1, 4, 3, 16), np.float32), mx.ones((4, 3, 16))]
    for q in bad_type:
        with pytest.raises(ValueError, match=r"^queries must be an mx.array \[B, H_q, L, D\] observed after an update$"):
            c.observe_queries(q)
    for shape in [(2, 4, 3, 16), (1, 3, 3, 16), (1, 4, 3, 8), (1, 4, 4, 16)]:
        with pytest.raises(ValueError, match=r"^queries \(%d, %d, %d, %d\) do not fit the cache "
                                             r"\(B=1, H_kv=2, D=16, offset=3\)$" % shape):
            c.observe_queries(mx.ones(shape))
    assert c._queries is None and c.filter is None and c.offset == 3 and c.size() == 3
    c.observe_queries(mx.ones((1, 4, 3, 16)))  # fits: kept (3 of the 8 calibration queries)
    assert c._queries.shape == (1, 4, 3, 16) and c.filter is None


def query_cache(budget=64, calib=8, **kw):
    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    cfg = KVCacheConfig(method="qfilters", qfilters_budget=budget, qfilters_n_sink=1, qfilters_recent=2,
                        qfilters_calib_tokens=calib, qfilters_filter_source="queries",
                        qfilters_backend="reference", **kw)
    c = QFiltersKVCache(cfg)
    c.queries_observed = True  # as inside `observe_queries(model, caches)`
    return c


def np_query_filter(q, n_kv):
    """The paper's estimator written out: per query head the top right-singular vector of
    its (uncentred) rows, oriented to a positive mean projection, averaged per GQA group
    and renormalised. q: [B, H_q, T, D]."""
    B, Hq, T, D = q.shape
    per = []
    for h in range(Hq):
        x = q[:, h].reshape(-1, D).astype(np.float64)
        v = np.linalg.svd(x)[2][0]
        per.append(v if (x @ v).mean() > 0 else -v)
    f = np.array(per).reshape(n_kv, Hq // n_kv, D).mean(axis=1)
    return f / np.linalg.norm(f, axis=-1, keepdims=True)


def test_query_calibration_keeps_exactly_the_first_calib_queries_whatever_the_calls():
    """README: the filter comes from the first calib_tokens queries; state carries them."""
    rng = np.random.default_rng(5)
    B, Hq, H, D, calib = 1, 4, 2, 8, 8
    for lengths in [(3, 10), (7, 1), (2, 2, 2, 2), (8,), (5, 3, 4)]:
        c = query_cache(calib=calib)
        T = sum(lengths)
        k = rng.standard_normal((B, H, T, D)).astype(np.float32)
        q = (rng.standard_normal((B, Hq, T, D)) + 0.5 * rng.standard_normal((1, Hq, 1, D))).astype(np.float32)
        start = 0
        for L in lengths:
            c.update_and_fetch(mx.array(k[:, :, start:start + L]), mx.array(k[:, :, start:start + L]))
            c.observe_queries(mx.array(q[:, :, start:start + L]))
            start += L
        assert c.filter is not None, lengths  # calibrated in the call that reached calib tokens
        queries = np.array(c.state[5])
        np.testing.assert_array_equal(queries, q[:, :, :calib])
        np.testing.assert_allclose(np.array(c.filter), np_query_filter(q[:, :, :calib], H), atol=2e-5)
        np.testing.assert_allclose(np.array(c.scores[:, :, :T]),
                                   np.einsum("bhtd,hd->bht", k, np.array(c.filter)), atol=1e-5)


def test_estimate_filter_from_queries_equals_numpy_and_checks_its_arguments():
    rng = np.random.default_rng(6)
    for B, Hq, H, T in [(1, 4, 2, 1), (2, 6, 3, 5), (1, 4, 1, 9), (1, 4, 4, 7)]:
        q = (rng.standard_normal((B, Hq, T, 8)) + rng.standard_normal((1, Hq, 1, 8))).astype(np.float32)
        f = np.array(ref.estimate_filter_from_queries(mx.array(q), H))
        assert f.shape == (H, 8) and f.dtype == np.float32
        np.testing.assert_allclose(f, np_query_filter(q, H), atol=2e-5)
    cases = [
        (lambda: ref.estimate_filter_from_queries(mx.zeros((2, 3, 4)), 1), ValueError,
         r"^queries must have 4 dimensions, got shape \(2, 3, 4\)$"),
        (lambda: ref.estimate_filter_from_queries(np.zeros((1, 2, 3, 4)), 1), TypeError,
         r"^queries must be an mx.array, got ndarray$"),
        (lambda: ref.estimate_filter_from_queries(mx.zeros((1, 4, 0, 8)), 2), ValueError,
         r"^queries must hold at least one token \(B \* T > 0\)$"),
        (lambda: ref.estimate_filter_from_queries(mx.zeros((1, 4, 3, 8)), 0), ValueError,
         r"^n_kv_heads \(0\) must divide the query head count \(4\)$"),
        (lambda: ref.estimate_filter_from_queries(mx.zeros((1, 4, 3, 8)), 3), ValueError,
         r"^n_kv_heads \(3\) must divide the query head count \(4\)$"),
        (lambda: ref.estimate_filter_from_keys(mx.zeros((0, 4, 3, 8))), ValueError,
         r"^keys must hold at least one token \(B \* T > 0\)$"),
        (lambda: ref.estimate_filter_from_keys(mx.zeros((1, 4, 0, 8))), ValueError,
         r"^keys must hold at least one token \(B \* T > 0\)$"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()


def test_to_quantized_defaults_are_mlx_lm_defaults():
    """The defaults of mlx-lm's own KVCache.to_quantized (group_size 64, bits 4)."""
    import inspect

    from mlx_lm.models.cache import KVCache

    defaults = inspect.signature(KVCache.to_quantized).parameters
    c = query_cache(budget=8, calib=4)
    k = mx.array(np.random.default_rng(7).standard_normal((1, 2, 6, 64)).astype(np.float32))
    c.update_and_fetch(k, k)
    c.observe_queries(mx.ones((1, 4, 6, 64)))
    qc = c.to_quantized()
    assert (qc.group_size, qc.bits) == (defaults["group_size"].default, defaults["bits"].default)


def test_random_scores_are_the_documented_hash_in_unit_interval():
    """README's random arm: (hash >> 8) / 2**24, uniform in [0, 1) (test_properties' numpy hash)."""
    from qfilters_mlx.cache.kv_cache import random_scores
    from test_properties import np_random_scores

    for H, T, seed, layer in [(2, 50, 0, 0), (3, 40, 7, 5), (1, 300, 123456, 31)]:
        pos = mx.broadcast_to(mx.arange(T, dtype=mx.int64)[None, None], (2, H, T))
        got = np.array(random_scores(pos, seed, layer))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.broadcast_to(np_random_scores(H, T, seed, layer), (2, H, T)))
        assert got.min() >= 0 and got.max() < 1 and got.max() > 0.9  # the whole unit interval


def test_projection_scores_default_sign_is_plus_one_and_filters_name_in_errors():
    rng = np.random.default_rng(8)
    k = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    f = rng.standard_normal((3, 4)).astype(np.float32)
    exp = np.einsum("bhtd,hd->bht", k.astype(np.float64), f.astype(np.float64))
    np.testing.assert_allclose(np.array(ref.projection_scores(mx.array(k), mx.array(f))), exp, rtol=1e-5, atol=1e-6)
    for call, exc, msg in [
        (lambda: ref.estimate_filter_from_keys(mx.zeros((2, 3, 4))), ValueError,
         r"^keys must have 4 dimensions, got shape \(2, 3, 4\)$"),
        (lambda: ref.estimate_filter_from_keys(np.zeros((1, 2, 3, 4))), TypeError,
         r"^keys must be an mx.array, got ndarray$"),
    ]:
        with pytest.raises(exc, match=msg):
            call()


def test_key_filter_equals_numpy_for_one_head_and_one_token():
    """Edge shapes of the orientation (a single head, a single key row): numpy SVD, mean
    projection positive."""
    rng = np.random.default_rng(9)
    for B, H, T in [(1, 1, 6), (1, 3, 1), (2, 1, 1)]:
        keys = (rng.standard_normal((B, H, T, 8)) + 0.5).astype(np.float32)
        f = np.array(ref.estimate_filter_from_keys(mx.array(keys)))
        assert f.shape == (H, 8)
        for h in range(H):
            x = keys[:, h].reshape(-1, 8).astype(np.float64)
            v = np.linalg.svd(x)[2][0]
            np.testing.assert_allclose(f[h], v if (x @ v).mean() > 0 else -v, atol=2e-5)


def test_filter_orientation_on_an_exactly_zero_mean_uses_the_largest_component():
    """Module docstring: if the keys' mean projection is exactly zero, the filter is
    oriented so that its largest-magnitude component is positive. Rows {a, -a} have a
    mean projection of exactly 0 whatever the SVD's sign."""
    rng = np.random.default_rng(10)
    for _ in range(8):
        a = rng.standard_normal((3, 6)).astype(np.float32)  # one row per head
        keys = np.stack([a, -a], axis=1)[None]  # [1, 3, 2, 6]
        f = np.array(ref.estimate_filter_from_keys(mx.array(keys)))
        u = a / np.linalg.norm(a, axis=-1, keepdims=True)
        peak = np.take_along_axis(u, np.abs(u).argmax(axis=-1)[:, None], axis=-1)
        np.testing.assert_allclose(f, u * np.sign(peak), atol=1e-5)


def test_trim_into_the_calibrating_call_replays_its_queries():
    """A rewind that ends inside the call whose queries froze the filter re-applies that
    call's head with its queries: the cache equals one that never saw the trimmed tokens."""
    rng = np.random.default_rng(11)
    k = mx.array(rng.standard_normal((1, 2, 10, 8)).astype(np.float32))
    q = mx.array((rng.standard_normal((1, 4, 10, 8)) + 0.7).astype(np.float32))

    def run(lengths):
        c = query_cache(budget=6, calib=8, qfilters_max_rewind=4)
        start = 0
        for L in lengths:
            c.update_and_fetch(k[:, :, start:start + L], k[:, :, start:start + L])
            c.observe_queries(q[:, :, start:start + L])
            start += L
        return c

    c = run([6, 4])  # the second call crosses calib_tokens: calibrates and evicts
    assert c.trim(1) == 1
    want = run([6, 3])
    assert c.filter is not None and want.filter is not None
    np.testing.assert_array_equal(np.array(c.filter), np.array(want.filter))
    np.testing.assert_array_equal(np.array(c.kept_positions()), np.array(want.kept_positions()))
    assert c.offset == want.offset == 9 and c.size() == want.size() == 6


def test_each_head_is_oriented_by_its_own_keys_even_with_one_row():
    """Orientation is per head: a single key row per head, opposite on two heads."""
    rng = np.random.default_rng(12)
    for _ in range(4):
        a = (rng.standard_normal(8) + 0.2).astype(np.float32)
        keys = np.stack([a, -a, 2 * a])[None, :, None, :]  # [1, 3, 1, 8]
        f = np.array(ref.estimate_filter_from_keys(mx.array(keys)))
        u = a / np.linalg.norm(a)
        np.testing.assert_allclose(f, np.stack([u, -u, u]), atol=1e-5)
