"""The pure-MLX reference against independent numpy computations."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from oracle import np_keep_rows
from qfilters_mlx.backends import reference as ref


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
    """README: a bad input raises before anything runs, naming the argument (the mutation check
    needs a test that reads the argument and axis each message names)."""
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
