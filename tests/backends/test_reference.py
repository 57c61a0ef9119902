"""The pure-MLX reference against independent numpy computations."""

import itertools
import re
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from helpers.backends_here import BACKENDS
from helpers.oracle import np_hash_scores, np_keep_rows, np_victim, np_write_slot
from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.backends import reference as ref
from qfilters_mlx.backends.dispatch import get_backend
from qfilters_mlx.cache.kv_cache import insertion_scores


def planted_keys(rng, B, H, T, D, strength=6.0):
    """Keys with a dominant axis u_h per head (all on the same side), plus noise."""
    u = rng.standard_normal((H, D))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    coef = strength + rng.standard_normal((B, H, T, 1))
    keys = coef * u[None, :, None, :] + 0.5 * rng.standard_normal((B, H, T, D))
    return keys.astype(np.float32), u


def test_filter_recovers_planted_direction():
    rng = np.random.default_rng(0)
    keys, u = planted_keys(rng, 2, 4, 128, 64)
    f = np.array(ref.estimate_filter_from_keys(mx.array(keys)))
    assert f.shape == (4, 64) and f.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(f, axis=-1), 1.0, atol=1e-5)
    cos = np.sum(f * u, axis=-1)
    assert np.all(cos > 0.99), cos  # oriented with the keys' mean (+u here)


@pytest.mark.parametrize("T", [40, 5, 4096])  # B*T > D (QR first), B*T < D, and a long sample
def test_filter_equals_numpy_svd_up_to_documented_orientation(T):
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2, 3, T, 16)).astype(np.float32) + 0.3
    f = np.array(ref.estimate_filter_from_keys(mx.array(keys)))
    for h in range(3):
        x = keys[:, h].reshape(-1, 16).astype(np.float64)
        v = np.linalg.svd(x, full_matrices=False)[2][0]
        v = v if (x @ v).mean() > 0 else -v
        np.testing.assert_allclose(f[h], v, atol=1e-4)


def test_filter_orientation_flips_with_keys():
    rng = np.random.default_rng(2)
    keys, u = planted_keys(rng, 1, 2, 64, 32)
    f_pos = np.array(ref.estimate_filter_from_keys(mx.array(keys)))
    f_neg = np.array(ref.estimate_filter_from_keys(mx.array(-keys)))
    # the direction is the same axis; orientation follows the keys' mean projection
    np.testing.assert_allclose(f_pos, -f_neg, atol=1e-4)
    assert np.all((keys[0] @ f_pos[..., None]).mean(axis=(1, 2)) > 0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("sign", [1, -1])
def test_projection_scores_match_float64(dtype, sign):
    rng = np.random.default_rng(3)
    keys = mx.array(rng.standard_normal((2, 3, 33, 80)).astype(np.float32)).astype(dtype)
    f = rng.standard_normal((3, 80)).astype(np.float32)
    s = ref.projection_scores(keys, mx.array(f), sign)
    assert s.shape == (2, 3, 33) and s.dtype == mx.float32
    k64 = np.array(keys.astype(mx.float32)).astype(np.float64)
    expected = sign * np.einsum("bhtd,hd->bht", k64, f.astype(np.float64))
    np.testing.assert_allclose(np.array(s), expected, rtol=1e-5, atol=1e-4)


def test_projection_scores_float16_beyond_range_stay_finite():
    keys = mx.full((1, 2, 4, 64), 200.0, dtype=mx.float16)  # dot = 200*200*64 >> 65504
    f = mx.full((2, 64), 200.0 / 8)  # not a unit vector on purpose: 200 * 25 * 64 = 320000
    s = np.array(ref.projection_scores(keys, f, 1))
    assert np.all(np.isfinite(s))
    np.testing.assert_allclose(s, 200.0 * 25.0 * 64, rtol=1e-6)


def test_projection_scores_reject_bad_shapes():
    with pytest.raises(ValueError, match="filters"):
        ref.projection_scores(mx.zeros((1, 2, 3, 8)), mx.zeros((3, 8)), 1)
    with pytest.raises(ValueError, match="sign"):
        ref.projection_scores(mx.zeros((1, 2, 3, 8)), mx.zeros((2, 8)), 0)
    with pytest.raises(ValueError, match="keys"):
        ref.projection_scores(mx.zeros((2, 3, 8)), mx.zeros((2, 8)), 1)


def test_l2norm_scores():
    rng = np.random.default_rng(4)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(np.array(ref.l2norm_scores(mx.array(k))),
                               -np.linalg.norm(k, axis=-1), rtol=1e-6)


SELECT_CASES = [
    (T, budget, sr)
    for T, budget, sr in itertools.product(
        [1, 2, 31, 32, 33, 129], [1, 4, 32, 200], [(0, 0), (1, 0), (0, 3), (2, 2)]
    )
    if sum(sr) <= budget
]


@pytest.mark.parametrize("T,budget,sr", SELECT_CASES)
def test_select_keep_matches_numpy_ranking(T, budget, sr):
    n_sink, recent = sr
    rng = np.random.default_rng(T * 1000 + budget)
    # few distinct values: many ties; include NaN and signed zeros
    s = rng.integers(-3, 4, size=(2, 3, T)).astype(np.float32)
    s[0, 1, ::5] = np.nan
    s[1, 2, ::3] = -0.0
    kept = ref.select_keep(mx.array(s), budget, n_sink, recent)
    assert kept.dtype == mx.int32 and kept.shape == (2, 3, min(budget, T))
    np.testing.assert_array_equal(np.array(kept), np_keep_rows(s, budget, n_sink, recent))


def test_select_keep_validates():
    s = mx.zeros((1, 1, 10))
    with pytest.raises(ValueError, match="budget"):
        ref.select_keep(s, 0)
    with pytest.raises(ValueError, match="n_sink"):
        ref.select_keep(s, 4, -1, 0)
    with pytest.raises(ValueError, match="exceed"):
        ref.select_keep(s, 4, 3, 2)
    with pytest.raises(TypeError, match="budget"):
        ref.select_keep(s, 4.0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_compact_is_bit_exact(dtype):
    rng = np.random.default_rng(5)
    k = mx.array(rng.standard_normal((2, 3, 20, 8)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((2, 3, 20, 6)).astype(np.float32)).astype(dtype)
    kept = np.sort(np.stack([np.stack([rng.choice(20, 7, replace=False) for _ in range(3)])
                             for _ in range(2)]), axis=-1).astype(np.int32)
    ck, cv = ref.compact(k, v, mx.array(kept))
    assert ck.dtype == dtype and ck.shape == (2, 3, 7, 8) and cv.shape == (2, 3, 7, 6)
    kn = np.array(k.view(mx.uint16) if dtype != mx.float32 else k.view(mx.uint32))
    ckn = np.array(ck.view(mx.uint16) if dtype != mx.float32 else ck.view(mx.uint32))
    np.testing.assert_array_equal(ckn, np.take_along_axis(kn, kept[..., None], axis=2))


def test_filter_ignores_nonfinite_rows():
    rng = np.random.default_rng(6)
    keys, u = planted_keys(rng, 1, 2, 64, 16)
    dirty = keys.copy()
    dirty[0, 0, 5] = np.nan
    dirty[0, 1, 9, 2] = np.inf
    clean = keys.copy()
    clean[0, 0, 5] = 0.0
    clean[0, 1, 9] = 0.0
    f = np.array(ref.estimate_filter_from_keys(mx.array(dirty)))
    assert np.all(np.isfinite(f))
    np.testing.assert_allclose(f, np.array(ref.estimate_filter_from_keys(mx.array(clean))), atol=1e-6)


def test_errors_name_the_argument_and_the_expected_shape():
    """docs/mlx-lm.md ("Bad input"): a bad input raises before anything runs, naming the
    argument (the mutation check needs a test that reads the argument and axis each message
    names)."""
    k, f = mx.zeros((1, 2, 3, 4)), mx.zeros((2, 4))
    cases = [
        (lambda: ref.projection_scores(k[0], f), ValueError, r"^keys must have 4 dimensions, got shape \(2, 3, 4\)$"),
        (lambda: ref.projection_scores(k, f[0]), ValueError, r"^filters must have 2 dimensions, got shape \(4,\)$"),
        (lambda: ref.projection_scores(np.zeros((1, 2, 3, 4)), f), TypeError, r"^keys must be an mx.array, got ndarray$"),
        (lambda: ref.projection_scores(k, np.zeros((2, 4))), TypeError, r"^filters must be an mx.array, got ndarray$"),
        (lambda: ref.projection_scores(k, mx.zeros((3, 4))), ValueError,
         r"^filters must have shape \[H, D\] = \(2, 4\), got \(3, 4\)$"),
        (lambda: ref.projection_scores(k, mx.zeros((2, 5))), ValueError,
         r"^filters must have shape \[H, D\] = \(2, 4\), got \(2, 5\)$"),
        (lambda: ref.projection_scores(k, f, 0), ValueError, r"^sign must be \+1 or -1, got 0$"),
        (lambda: ref.select_keep(mx.zeros((4,)), 2), ValueError, r"^scores must have 3 dimensions, got shape \(4,\)$"),
        (lambda: ref.select_keep(mx.zeros((1, 1, 8)), 2.0), TypeError, r"^budget must be an int, got float$"),
        (lambda: ref.select_keep(mx.zeros((1, 1, 8)), 4, True), TypeError, r"^n_sink must be an int, got bool$"),
        (lambda: ref.select_keep(mx.zeros((1, 1, 8)), 4, 1, None), TypeError, r"^recent must be an int, got NoneType$"),
        (lambda: ref.select_keep(mx.zeros((1, 1, 8)), 0), ValueError, r"^budget must be >= 1, got 0$"),
        (lambda: ref.select_keep(mx.zeros((1, 1, 8)), 4, -1, 0), ValueError,
         r"^n_sink and recent must be >= 0, got -1, 0$"),
        (lambda: ref.select_keep(mx.zeros((1, 1, 8)), 4, 0, -2), ValueError,
         r"^n_sink and recent must be >= 0, got 0, -2$"),
        (lambda: ref.select_keep(mx.zeros((1, 1, 8)), 4, 2, 3), ValueError,
         r"^n_sink \+ recent \(5\) must not exceed budget \(4\)$"),
        (lambda: ref.compact(k, k, mx.zeros((1, 2), mx.int32)), ValueError,
         r"^kept must have 3 dimensions, got shape \(1, 2\)$"),
        (lambda: ref.compact(k[0], k, mx.zeros((1, 2, 1), mx.int32)), ValueError,
         r"^keys must have 4 dimensions, got shape \(2, 3, 4\)$"),
        (lambda: ref.compact(k, k[0], mx.zeros((1, 2, 1), mx.int32)), ValueError,
         r"^values must have 4 dimensions, got shape \(2, 3, 4\)$"),
        (lambda: ref.l2norm_scores(k[0]), ValueError, r"^keys must have 4 dimensions, got shape \(2, 3, 4\)$"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    # the boundary values are accepted
    assert ref.select_keep(mx.zeros((1, 1, 8)), 4, 2, 2).shape == (1, 1, 4)
    assert ref.select_keep(mx.zeros((1, 1, 8)), 1, 0, 0).tolist() == [[[0]]]


# ------------------------------------------------------------------------------------------------
# The reference backend's decode step and query orientation, and ``to_quantized``'s
# arguments, pinned against independent references (behaviour the mutation check of
# ``backends/reference.py`` and ``cache/kv_cache.py`` needs pinned: ``tools/mutation.py``,
# bench/results/mutation.md).
#
# References: the victim rule written out in numpy (``oracle.np_victim``, one head at a
# time for per-head windows), the sign of the mean query projection computed in numpy on
# small integers (exact sums), and mlx-lm's own ``KVCache.to_quantized``.
# ------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------- decode_select
def _step_inputs(rng, B, H, S, n_sink, base, position):
    """Slots of past tokens (sinks + shuffled positions from ``base``), many tied scores."""
    past = np.concatenate([np.arange(n_sink), base + rng.permutation(position - base)[: S - n_sink]])
    positions = np.stack([np.stack([rng.permutation(past) for _ in range(H)]) for _ in range(B)])
    scores = rng.integers(-2, 2, size=(B, H, S)).astype(np.float32)
    free = rng.integers(0, S, size=(B, H)).astype(np.int32)
    new = rng.integers(-2, 2, size=(B, H, 1)).astype(np.float32)
    return scores, positions.astype(np.int64), free, new


@pytest.mark.parametrize("base", [100, 2**31 - 5, 2**32 + 7, 3 * 2**32])
def test_decode_select_per_head_windows_free_the_documented_victim_at_any_position(base):
    """Per-head windows (list, tuple, numpy and MLX arrays) at absolute positions below and
    beyond int32 (positions are int64): the new token lands in the free slot and the victim
    is, per head, the numpy rule with that head's own window (0 and S - 1 - n_sink included)."""
    rng = np.random.default_rng(base % 997)
    B, H, S, n_sink = 2, 3, 8, 2
    windows = [0, S - 1 - n_sink, 3]
    kinds = (list, tuple, np.array, mx.array)
    for trial in range(8):
        position = base + 30 + trial
        scores, positions, free, new = _step_inputs(rng, B, H, S, n_sink, base, position)
        recent = kinds[trial % len(kinds)](windows)
        s, p, v = ref.decode_select(mx.array(scores), mx.array(positions), mx.array(new),
                                    mx.array(free), position, n_sink, recent)
        exp_s, exp_p = np_write_slot(scores, positions, new, free, position)
        want = np.concatenate([np_victim(exp_s[:, h:h + 1], exp_p[:, h:h + 1], position, n_sink,
                                         windows[h]) for h in range(H)], axis=1)
        np.testing.assert_array_equal(np.array(s), exp_s)
        np.testing.assert_array_equal(np.array(p), exp_p)
        assert p.dtype == mx.int64 and v.dtype == mx.int32
        np.testing.assert_array_equal(np.array(v), want, err_msg=f"position={position}")


@pytest.mark.parametrize("recent, where", [(7, ""), ([1, 7, 0], " (head 1)"), ([7], "")])
def test_decode_select_refuses_windows_that_leave_no_slot_to_free(recent, where):
    """Docstring: ``n_sink + recent[h] < S`` (``S = budget + 1`` slots, one is freed per
    step). At ``n_sink + recent == S`` the error names S (not the budget) and the head; one
    less is accepted. The C++ backend refuses the same inputs."""
    from qfilters_mlx.backends.dispatch import get_backend

    H = 1 if isinstance(recent, int) else len(recent)
    S, n_sink = 9, 2
    scores = mx.zeros((1, H, S))
    positions = mx.broadcast_to(mx.arange(S, dtype=mx.int64), (1, H, S))
    args = (scores, positions, mx.zeros((1, H, 1)), mx.full((1, H), S - 1, mx.int32), S - 1, n_sink)
    msg = "^" + re.escape(f"n_sink + recent (9) must be smaller than S (9){where}") + "$"
    with pytest.raises(ValueError, match=msg):
        ref.decode_select(*args, recent)
    try:
        be = get_backend("cpp")
    except Exception:  # the extension is not built here
        be = None
    if be is not None:
        with pytest.raises(ValueError, match=r"n_sink \+ recent < S \(9\)"):
            be.decode_select(*args, recent)
    smaller = recent - 1 if isinstance(recent, int) else [min(r, 6) for r in recent]
    _, _, v = ref.decode_select(*args, smaller)
    windows = [smaller] * H if isinstance(smaller, int) else smaller
    p = np.array(positions)
    for h in range(H):  # all scores 0: the latest evictable position goes first
        assert int(np.array(v)[0, h]) == max(j for j in range(S) if n_sink <= p[0, h, j] < S - windows[h])


def test_decode_select_refuses_a_negative_sink_count_or_window():
    args = (mx.zeros((1, 2, 9)), mx.broadcast_to(mx.arange(9, dtype=mx.int64), (1, 2, 9)),
            mx.zeros((1, 2, 1)), mx.zeros((1, 2), mx.int32), 20)
    for n_sink, recent in ((-1, 2), (2, -1), (2, [1, -1])):
        with pytest.raises(ValueError, match="n_sink and recent must be >= 0"):
            ref.decode_select(*args, n_sink, recent)


# ------------------------------------------------------------- query_orientation
def np_orientation(filters, queries):
    """+1/-1 per KV head: the sign of the mean of <q, f_h> over the batch rows, the query
    heads of head h's GQA group (consecutive: mlx-lm's [B, H_kv, n_rep, L, D]) and the
    tokens; +1 when the mean is exactly 0."""
    B, Hq, T, D = queries.shape
    H = filters.shape[0]
    q = np.asarray(queries, np.float64).reshape(B, H, Hq // H, T, D)
    mean = np.einsum("bhgtd,hd->h", q, np.asarray(filters, np.float64)) / (B * (Hq // H) * T)
    return np.where(mean < 0, -1.0, 1.0)


def test_query_orientation_is_the_sign_of_the_pooled_mean_projection():
    """Exactly +1/-1 per KV head, shape [H_kv]: means in (0, 1), negative, exactly zero
    (+1), and signs that differ between batch rows / group heads (pooled, not per row)."""
    B, Hq, H, T, D = 2, 6, 3, 2, 4
    f = np.eye(D, dtype=np.float32)[:H]  # head h projects onto component h
    q = np.zeros((B, Hq, T, D), np.float32)
    q[0, 0:2, :, 0] = 1.0       # head 0: batch row 0 positive ...
    q[1, 0:2, :, 0] = -0.75     # ... row 1 negative: pooled mean 0.125, in (0, 1)
    q[:, 2, :, 1] = 2.0         # head 1: group head 2 positive ...
    q[:, 3, :, 1] = -5.0        # ... group head 3 negative: pooled mean -1.5
    q[0, 4:6, :, 2] = 3.0       # head 2: rows cancel exactly, mean 0 -> +1
    q[1, 4:6, :, 2] = -3.0
    q[:, :, :, 3] = 7.0         # orthogonal to every filter: changes nothing
    want = np_orientation(f, q)
    assert want.tolist() == [1.0, -1.0, 1.0]  # the cases above, as built
    for dtype in (mx.float32, mx.float16):
        got = ref.query_orientation(mx.array(f), mx.array(q).astype(dtype))
        assert got.shape == (H,)
        np.testing.assert_array_equal(np.array(got), want)


@pytest.mark.parametrize("B,Hq,H", [(1, 4, 2), (3, 8, 2), (2, 6, 6), (2, 4, 1)])
def test_query_orientation_equals_numpy_on_small_integers(B, Hq, H):
    """Small-integer queries and filters: the projections and their sums are exact in
    float32, so the sign (zero mean included, frequent here) is the numpy one exactly."""
    rng = np.random.default_rng(B * 100 + Hq * 10 + H)
    for _ in range(20):
        T, D = int(rng.integers(1, 4)), 4
        q = rng.integers(-1, 2, size=(B, Hq, T, D)).astype(np.float32)
        f = rng.integers(-1, 2, size=(H, D)).astype(np.float32)
        got = np.array(ref.query_orientation(mx.array(f), mx.array(q)))
        assert got.shape == (H,)
        np.testing.assert_array_equal(got, np_orientation(f, q))


# ---------------------------------------------------------------- to_quantized
@pytest.mark.parametrize("group_size, bits", [(32, 8), (128, 2)])
def test_to_quantized_stores_what_mlx_lm_quantizes_with_the_requested_format(group_size, bits):
    """``to_quantized(group_size, bits)`` (mlx-lm's ``maybe_quantize_kv_cache`` passes both)
    gives a cache with those ``group_size`` / ``bits`` whose rows equal, bit for bit, what
    mlx-lm's own ``KVCache.to_quantized(group_size, bits)`` stores for the same tokens
    (no eviction yet: every token kept, in order), before and after one more token."""
    rng = np.random.default_rng(bits)
    H, D, T = 2, 128, 10
    k = rng.standard_normal((1, H, T + 1, D)).astype(np.float16)
    v = rng.standard_normal((1, H, T + 1, D)).astype(np.float16)
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=32, qfilters_n_sink=2, qfilters_recent=4)
    ours = QFiltersKVCache(cfg, filters=mx.array(rng.standard_normal((H, D)).astype(np.float32)),
                           backend="reference")
    theirs = KVCache()
    for c in (ours, theirs):
        c.update_and_fetch(mx.array(k[:, :, :T]), mx.array(v[:, :, :T]))
    ours, theirs = ours.to_quantized(group_size=group_size, bits=bits), \
        theirs.to_quantized(group_size=group_size, bits=bits)
    assert (ours.group_size, ours.bits) == (theirs.group_size, theirs.bits) == (group_size, bits)
    a = ours.update_and_fetch(mx.array(k[:, :, T:]), mx.array(v[:, :, T:]))
    b = theirs.update_and_fetch(mx.array(k[:, :, T:]), mx.array(v[:, :, T:]))
    for x, y in zip((*a[0], *a[1]), (*b[0], *b[1])):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item()


# ------------------------------------------------------------------------------------------------
# Documented rules checked exactly against the rule written out in numpy (behaviour the
# mutation check needs pinned: ``tools/mutation.py``, bench/results/mutation.md).
# ------------------------------------------------------------------------------------------------


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
                        qfilters_calib_tokens=8, qfilters_filter_source="queries")
    fresh = QFiltersKVCache(cfg, backend="reference")
    with pytest.raises(ValueError, match=r"^queries must be an mx.array \[B, H_q, L, D\] observed after an update$"):
        fresh.observe_queries(mx.ones((1, 4, 3, 16)))  # no update yet
    c = QFiltersKVCache(cfg, backend="reference")
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


def query_cache(budget=64, calib=8, max_rewind=None, **kw):
    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    cfg = KVCacheConfig(method="qfilters", qfilters_budget=budget, qfilters_n_sink=1, qfilters_recent=2,
                        qfilters_calib_tokens=calib, qfilters_filter_source="queries", **kw)
    c = QFiltersKVCache(cfg, backend="reference", max_rewind=max_rewind)
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
    """docs/method.md: the filter comes from the first calib_tokens queries; state carries them."""
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
    """The random arm (docs/configuration.md): (hash >> 8) / 2**24, uniform in [0, 1) (test_properties' numpy hash)."""
    from qfilters_mlx.cache.kv_cache import random_scores
    from helpers.oracle import np_random_scores

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
        c = query_cache(budget=6, calib=8, max_rewind=4)
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


# ------------------------------------------------------------------------------------------------
# Selection and insertion-score rules checked exactly against the rule written out
# (numpy): the defaults of ``select_keep`` and ``insertion_scores``, the ranking of
# scores one float32 ulp apart, decode bookkeeping at absolute positions beyond the
# int32 range, and ``insertion_scores``' backend dispatch and ``finite`` switch
# (behaviour the mutation check needs pinned: ``tools/mutation.py``, bench/results/mutation.md).
# ------------------------------------------------------------------------------------------------


def test_select_keep_defaults_are_no_sink_and_no_recent_window():
    """Docstring: ``n_sink=0, recent=0`` by default, so only the scores decide."""
    rng = np.random.default_rng(0)
    B, H, T, budget = 2, 3, 12, 5
    s = rng.standard_normal((B, H, T)).astype(np.float32)
    s[..., 0] = -10.0  # a sink would keep these; with no sinks they are dropped
    s[..., -1] = -10.0  # likewise for a recent window of one
    kept = ref.select_keep(mx.array(s), budget)
    assert kept.dtype == mx.int32 and kept.shape == (B, H, budget)
    np.testing.assert_array_equal(np.array(kept), np_keep_rows(s, budget, 0, 0))
    assert not np.isin([0, T - 1], np.array(kept)).any()


def ulp_pool() -> np.ndarray:
    """float32 values in pairs one ulp apart (and -0.0 / +0.0 ties), plus NaN and +-inf."""
    f = np.float32
    base = np.array([0.0, 1.0, 3.5, -2.0, 1e-30, 6e37, -7e-41, np.finfo(np.float32).max / 2], f)
    up = np.nextafter(base, f(np.inf))
    extra = np.array([-0.0, np.finfo(np.float32).max, np.inf, -np.inf, np.nan,
                      np.nextafter(f(0), f(1)), np.finfo(np.float32).tiny], f)
    return np.concatenate([base, up, extra])


def test_select_keep_ranks_scores_one_ulp_apart_by_value():
    """Any two distinct float32 scores rank by value (the higher is kept), however close;
    only equal scores (-0.0 equals +0.0) fall to the tie-break, the earlier position.
    NaN ranks lowest."""
    pool = ulp_pool()
    rng = np.random.default_rng(1)
    for budget in (1, 3, 7, 12):
        s = np.stack([np.stack([rng.permutation(pool) for _ in range(4)]) for _ in range(3)])
        kept = ref.select_keep(mx.array(s), budget)
        np.testing.assert_array_equal(np.array(kept), np_keep_rows(s, budget, 0, 0), err_msg=str(budget))
        if budget >= 2:
            kept = ref.select_keep(mx.array(s), budget, 1, 1)
            np.testing.assert_array_equal(np.array(kept), np_keep_rows(s, budget, 1, 1), err_msg=str(budget))
    # the pair itself, the higher one later: only the value can decide
    for lo in pool[np.isfinite(pool) & (pool < np.finfo(np.float32).max)]:
        hi = np.nextafter(lo, np.float32(np.inf))
        s = np.array([[[lo, hi]]], np.float32)
        assert np.array(ref.select_keep(mx.array(s), 1)).tolist() == [[[1]]], lo
    s = np.array([[[0.0, -0.0, 0.0]]], np.float32)  # equal scores: earlier first
    assert np.array(ref.select_keep(mx.array(s), 1)).tolist() == [[[0]]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_sink", [0, 2])
@pytest.mark.parametrize("base", [2**31 - 5, 2**32 + 7, 3 * 2**32])
def test_decode_select_at_positions_beyond_int32(backend, n_sink, base):
    """Positions are int64 (docstring): a cache that has seen more than 2**31 tokens
    (all of them past 2**31 without sinks; spanning more than 2**32 with the sinks at
    0, 1) still frees the lowest score, the later position first among equal scores."""
    be = get_backend(backend)
    rng = np.random.default_rng(base % 1000)
    B, H, S, recent = 2, 2, 8, 2
    for trial in range(6):
        position = base + 40 + trial
        past = np.concatenate([np.arange(n_sink), base + rng.permutation(40)[: S - n_sink]])
        positions = np.stack([np.stack([rng.permutation(past) for _ in range(H)]) for _ in range(B)])
        positions = positions.astype(np.int64)
        scores = rng.integers(-2, 2, size=(B, H, S)).astype(np.float32)  # many ties
        free = rng.integers(0, S, size=(B, H)).astype(np.int32)
        new = rng.integers(-2, 2, size=(B, H, 1)).astype(np.float32)
        s, p, v = be.decode_select(mx.array(scores), mx.array(positions), mx.array(new),
                                   mx.array(free), position, n_sink, recent)
        exp_s, exp_p = np_write_slot(scores, positions, new, free, position)
        np.testing.assert_array_equal(np.array(s), exp_s)
        assert p.dtype == mx.int64 and v.dtype == mx.int32
        np.testing.assert_array_equal(np.array(p), exp_p)
        np.testing.assert_array_equal(np.array(v), np_victim(exp_s, exp_p, position, n_sink, recent))


def test_insertion_scores_defaults_are_sign_plus_one_seed_zero_layer_zero():
    rng = np.random.default_rng(2)
    B, H, L, D = 1, 3, 10, 8
    k = rng.standard_normal((B, H, L, D)).astype(np.float32)
    f = rng.standard_normal((H, D)).astype(np.float32)
    got = insertion_scores("qfilters", mx.array(k), None, filters=mx.array(f))
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.einsum("bhld,hd->bhl", k.astype(np.float64), f),
                               rtol=1e-5, atol=1e-5)
    pos = np.broadcast_to(np.arange(100, 100 + L), (B, H, L)).astype(np.int64)
    got = insertion_scores("random", mx.array(k), mx.array(pos))
    np.testing.assert_array_equal(np.array(got), np_hash_scores(pos, 0, 0))
    assert not np.array_equal(np.array(got), np_hash_scores(pos, 1, 0))  # seed and layer count
    assert not np.array_equal(np.array(got), np_hash_scores(pos, 0, 1))


def test_insertion_scores_use_the_given_backends_projection():
    """Docstring: ``backend.projection_scores`` when a backend is given, else the reference."""
    rng = np.random.default_rng(3)
    k = mx.array(rng.standard_normal((1, 2, 5, 4)).astype(np.float32))
    f = mx.array(rng.standard_normal((2, 4)).astype(np.float32))
    calls = []

    def projection(keys, filters, sign):
        calls.append((keys, filters, sign))
        return ref.projection_scores(keys, filters, sign) + 1000.0  # tells its output apart

    be = SimpleNamespace(projection_scores=projection)
    got = insertion_scores("qfilters", k, None, filters=f, sign=-1, backend=be)
    assert len(calls) == 1 and calls[0][0] is k and calls[0][1] is f and calls[0][2] == -1
    np.testing.assert_array_equal(np.array(got), np.array(-(k @ f[:, :, None]).squeeze(-1)) + 1000.0)
    got = insertion_scores("qfilters", k, None, filters=f, sign=-1)  # no backend: the reference
    assert len(calls) == 1
    np.testing.assert_array_equal(np.array(got), np.array(ref.projection_scores(k, f, -1)))


@pytest.mark.parametrize("method", ["qfilters", "l2norm"])
def test_insertion_scores_finite_switch(method):
    """Non-finite scores become -inf by default; ``finite=False`` returns them as computed
    (the slot cache's decode_select maps them itself)."""
    k = np.ones((1, 1, 4, 2), np.float32)
    k[0, 0, 1, 0] = np.nan
    k[0, 0, 2, 0] = np.inf
    k[0, 0, 3, 0] = -np.inf
    f = np.array([[1.0, 0.0]], np.float32)
    if method == "qfilters":
        raw = (k.astype(np.float64) @ f[0])[..., :]  # [1, 1, 4]: 1, nan, inf, -inf
    else:
        raw = -np.sqrt((k.astype(np.float64) ** 2).sum(-1))  # -1.41, nan, -inf, -inf
    kw = dict(filters=mx.array(f)) if method == "qfilters" else {}
    on = np.array(insertion_scores(method, mx.array(k), None, **kw))
    off = np.array(insertion_scores(method, mx.array(k), None, finite=False, **kw))
    np.testing.assert_allclose(on, np.where(np.isfinite(raw), raw, -np.inf), rtol=1e-6)
    np.testing.assert_allclose(off, raw, rtol=1e-6)  # NaN and +inf kept as they are
    assert np.isnan(off[0, 0, 1]) and on.dtype == off.dtype == np.float32


@pytest.mark.parametrize("method", ["streaming_llm", "full"])
def test_insertion_scores_without_a_score_are_float32_zeros(method):
    k = mx.ones((2, 3, 5, 4), dtype=mx.float16)
    got = insertion_scores(method, k, None)
    assert got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), np.zeros((2, 3, 5), np.float32))


@pytest.mark.parametrize("n", [5, 16, 40])
def test_the_filter_estimator_factors_on_the_cpu_stream_and_decomposes_at_most_d_by_d(n, monkeypatch):
    """The estimator's QR and SVD run on the CPU stream (MLX has them only there: on a GPU device
    the default stream refuses them), and for more rows than the width the SVD sees the
    ``[G, D, D]`` factor R, never the ``[G, N, D]`` sample (MLX's SVD builds ``[N, N]``)."""
    from qfilters_mlx.backends import reference

    calls = []
    for name in ("qr", "svd"):
        real = getattr(mx.linalg, name)

        def spy(a, *args, _real=real, _name=name, **kw):
            calls.append((_name, tuple(a.shape), kw.get("stream")))
            return _real(a, *args, **kw)

        monkeypatch.setattr(mx.linalg, name, spy)
    x = mx.array(np.random.default_rng(n).standard_normal((2, n, 16)).astype(np.float32))
    u = reference._top_singular_oriented(x)
    want = [("qr", (2, n, 16), mx.cpu), ("svd", (2, 16, 16), mx.cpu)] if n > 16 else [("svd", (2, n, 16), mx.cpu)]
    assert calls == want
    v = np.linalg.svd(np.array(x, dtype=np.float64))[2][:, 0]  # numpy's top right singular vector
    np.testing.assert_allclose(np.abs((np.array(u) * v).sum(-1)), 1.0, atol=1e-5)
