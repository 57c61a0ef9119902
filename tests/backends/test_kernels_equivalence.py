"""The compiled kernels (``qfilters_mlx._ext``) against the pure-MLX reference.

Independent code paths: ``reference`` is pure MLX, ``_ext`` is C++. Scores are
also checked against a float64 numpy oracle. Kept positions must be identical,
compacted keys/values bit-identical, scores within a per-dtype tolerance.
Skipped when the extension is not built (``pip install .`` builds it).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from helpers.kernel_inputs import TIE_BREAK_CASES, TIE_BREAK_SCORES, score_array
from qfilters_mlx.backends import reference

_ext = pytest.importorskip("qfilters_mlx._ext", reason="compiled extension not built")

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BATCHES = (1, 2)
HEADS = (1, 3, 8)
LENGTHS = (1, 31, 32, 33, 127, 128, 129, 1025, 4097)
HEAD_DIMS = (64, 80, 128)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DTYPE_IDS = ("float32", "float16", "bfloat16")

# Largest error of a score, relative to sum_d |k_d * u_d|, against the float64
# oracle. fp16/bf16 keys are converted to float32 exactly, so every dtype only
# carries float32 accumulation error; the table keeps them separate anyway.
SCORE_RTOL = {mx.float32: 2e-6, mx.float16: 2e-6, mx.bfloat16: 2e-6}

def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([20250311, *key])


def _bits(x: mx.array) -> np.ndarray:
    """Raw bits of an array (so NaN payloads and -0.0 compare exactly)."""
    as_uint = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.dtype.size]
    return np.array(mx.contiguous(x).view(as_uint))


def _layout(x: np.ndarray, kind: str, dtype: mx.Dtype) -> mx.array:
    """``x`` ([B, H, T, D]) as an mx array with the given memory layout."""
    if kind == "contiguous":
        return mx.array(x).astype(dtype)
    if kind == "swapaxes":  # stored [B, T, H, D], viewed as [B, H, T, D]
        return mx.array(np.ascontiguousarray(x.swapaxes(1, 2))).astype(dtype).swapaxes(1, 2)
    if kind == "strided_t":  # every other row of a twice-longer buffer
        B, H, T, D = x.shape
        big = np.zeros((B, H, 2 * T, D), x.dtype)
        big[:, :, ::2] = x
        return mx.array(big).astype(dtype)[:, :, ::2]
    if kind == "strided_d":  # last axis strided
        B, H, T, D = x.shape
        big = np.zeros((B, H, T, 2 * D), x.dtype)
        big[..., 1::2] = x
        return mx.array(big).astype(dtype)[..., 1::2]
    raise ValueError(kind)


LAYOUTS = ("contiguous", "swapaxes", "strided_t", "strided_d")


def _exact_scores(keys: mx.array, filters: mx.array, sign: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 oracle and the L1 magnitude sum_d |k_d u_d| for the tolerance."""
    k = np.array(keys.astype(mx.float32), dtype=np.float64)
    f = np.array(filters, dtype=np.float64)
    prod = k * f[None, :, None, :]
    return sign * prod.sum(-1), np.abs(prod).sum(-1)


# --------------------------------------------------------------------------
# Projection scores
# --------------------------------------------------------------------------


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_projection_scores_match_reference(dtype, D, T):
    for i, (B, H) in enumerate(itertools.product(BATCHES, HEADS)):
        rng = _rng(1, T, D, B, H, DTYPES.index(dtype))
        layout = LAYOUTS[(i + T) % len(LAYOUTS)]
        sign = (1, -1)[i % 2]
        keys = _layout(rng.standard_normal((B, H, T, D)).astype(np.float32), layout, dtype)
        filters = mx.array(rng.standard_normal((H, D)).astype(np.float32))
        got = _ext.projection_scores(keys, filters, sign)
        ref = reference.projection_scores(keys, filters, sign)
        assert got.shape == (B, H, T) and got.dtype == mx.float32
        exact, l1 = _exact_scores(keys, filters, sign)
        scale = np.maximum(l1, np.finfo(np.float32).tiny)
        err = np.abs(np.array(got, dtype=np.float64) - exact) / scale
        err_ref = np.abs(np.array(ref, dtype=np.float64) - exact) / scale
        ctx = f"B={B} H={H} layout={layout} sign={sign}"
        assert err.max() <= SCORE_RTOL[dtype], ctx
        # flash-attention rule: at most twice the reference's own error (+ tol).
        assert err.max() <= 2 * err_ref.max() + SCORE_RTOL[dtype], ctx


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_projection_scores_negative_strides_and_bad_filter_layout(dtype):
    rng = _rng(2, DTYPES.index(dtype))
    x = mx.array(rng.standard_normal((2, 3, 65, 80)).astype(np.float32)).astype(dtype)
    keys = x[:, ::-1, ::-1]  # negative strides on H and T
    filters = mx.array(rng.standard_normal((80, 3)).astype(np.float32)).T  # transposed view
    got = _ext.projection_scores(keys, filters, -1)
    exact, l1 = _exact_scores(keys, filters, -1)
    assert np.all(np.abs(np.array(got, np.float64) - exact) <= SCORE_RTOL[dtype] * l1 + 1e-30)


def test_float16_keys_beyond_float16_range_stay_finite():
    D = 128
    keys = mx.full((1, 2, 5, D), 1000.0, dtype=mx.float16)  # dot = 128000 > 65504
    filters = mx.ones((2, D), dtype=mx.float32)
    got = _ext.projection_scores(keys, filters, 1)
    assert got.dtype == mx.float32
    assert np.all(np.isfinite(np.array(got)))
    np.testing.assert_array_equal(np.array(got), np.full((1, 2, 5), 128000.0, np.float32))
    np.testing.assert_array_equal(np.array(got), np.array(reference.projection_scores(keys, filters, 1)))
    # Extremes of float16: 65504 * 128 still far inside float32.
    big = mx.full((1, 1, 3, D), 65504.0, dtype=mx.float16)
    out = np.array(_ext.projection_scores(big, mx.ones((1, D)), -1))
    np.testing.assert_array_equal(out, np.full((1, 1, 3), -65504.0 * D, np.float32))


def test_projection_scores_special_float16_values():
    # Subnormals, signed zeros, inf: the kernel's own float16 decoding.
    vals = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, 1.0], np.float16)
    keys = mx.array(vals.reshape(1, 1, 1, 8))
    for d in range(8):
        f = np.zeros((1, 8), np.float32)
        f[0, d] = 1.0
        got = np.array(_ext.projection_scores(keys, mx.array(f), 1))[0, 0, 0]
        assert got == np.float32(vals[d]), d
    inf_keys = mx.array(np.array([np.inf, 1.0], np.float16).reshape(1, 1, 1, 2))
    assert np.isinf(np.array(_ext.projection_scores(inf_keys, mx.ones((1, 2)), 1))).all()


# --------------------------------------------------------------------------
# Selection + compaction
# --------------------------------------------------------------------------


def _scores(rng, shape, mode):
    return mx.array(score_array(rng, shape, mode))


def _budgets(T: int) -> list[int]:
    below = sorted({1, max(1, T // 4), max(1, T - 1)})
    return [b for b in below if b < T] + [T, T + 5]


def _sink_recent(budget: int) -> list[tuple[int, int]]:
    cands = [(0, 0), (min(4, budget), 0), (0, min(16, budget)), (budget // 3, budget // 3), (0, budget)]
    return sorted({c for c in cands if c[0] + c[1] <= budget})


def _check_select_compact(scores, keys, values, budget, n_sink, recent, ctx=""):
    kept, k_out, v_out = _ext.select_compact(scores, keys, values, budget, n_sink, recent)
    B, H, T = scores.shape
    K = min(budget, T)
    assert kept.shape == (B, H, K) and kept.dtype == mx.int32, ctx
    assert k_out.shape == (B, H, K, keys.shape[3]) and k_out.dtype == keys.dtype, ctx
    assert v_out.shape == (B, H, K, values.shape[3]) and v_out.dtype == values.dtype, ctx
    ref_kept = reference.select_keep(scores, budget, n_sink, recent)
    np.testing.assert_array_equal(np.array(kept), np.array(ref_kept), err_msg=ctx)
    ref_k, ref_v = reference.compact(keys, values, ref_kept)
    np.testing.assert_array_equal(_bits(k_out), _bits(ref_k), err_msg=ctx)
    np.testing.assert_array_equal(_bits(v_out), _bits(ref_v), err_msg=ctx)


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_select_compact_matches_reference(dtype, T):
    """Full product of B, H, budget (below / equal / above T), n_sink and recent
    (including 0), score modes with many ties, NaN and -0.0, and layouts."""
    modes = ("random", "ties", "const")
    for i, (B, H) in enumerate(itertools.product(BATCHES, HEADS)):
        rng = _rng(3, T, B, H, DTYPES.index(dtype))
        Dk, Dv = HEAD_DIMS[i % 3], HEAD_DIMS[(i + 1) % 3]
        if T > 1025:  # keep the largest cases affordable: small D
            Dk, Dv = 64, 80
        layout_k = LAYOUTS[i % len(LAYOUTS)]
        layout_v = LAYOUTS[(i + 1) % len(LAYOUTS)]
        keys = _layout(rng.standard_normal((B, H, T, Dk)).astype(np.float32), layout_k, dtype)
        vals_np = rng.standard_normal((B, H, T, Dv)).astype(np.float32)
        vals_np[rng.random(vals_np.shape) < 0.01] = np.nan
        values = _layout(vals_np, layout_v, dtype)
        for j, budget in enumerate(_budgets(T)):
            for n_sink, recent in _sink_recent(budget):
                mode = modes[(i + j + n_sink + recent) % 3]
                scores = _scores(rng, (B, H, T), mode)
                if (i + j) % 2:
                    scores = mx.array(np.array(scores).swapaxes(0, 1).copy()).swapaxes(0, 1)
                ctx = f"B={B} H={H} budget={budget} sink={n_sink} recent={recent} mode={mode}"
                _check_select_compact(scores, keys, values, budget, n_sink, recent, ctx)


def test_select_compact_tie_break_and_special_values():
    # Equal scores: the earlier position wins. NaN ranks with -inf, -0.0 == +0.0.
    scores = mx.array(TIE_BREAK_SCORES.reshape(1, 1, 8))
    keys = mx.array(np.arange(8, dtype=np.float32).reshape(1, 1, 8, 1))
    for (budget, n_sink, recent), want in TIE_BREAK_CASES.items():
        kept, k_out, _ = _ext.select_compact(scores, keys, keys, budget, n_sink, recent)
        assert np.array(kept)[0, 0].tolist() == want, (budget, n_sink, recent)
        assert np.array(reference.select_keep(scores, budget, n_sink, recent))[0, 0].tolist() == want
        assert np.array(k_out)[0, 0, :, 0].tolist() == want


def test_select_compact_empty_and_lazy_graph():
    e = mx.zeros((2, 3, 0), mx.float32)
    kept, k, v = _ext.select_compact(e, mx.zeros((2, 3, 0, 4)), mx.zeros((2, 3, 0, 5)), 4)
    assert kept.shape == (2, 3, 0) and k.shape == (2, 3, 0, 4) and v.shape == (2, 3, 0, 5)
    mx.eval(kept, k, v)
    # Ops compose lazily with ordinary MLX ops and with each other.
    rng = _rng(4)
    keys = mx.array(rng.standard_normal((1, 2, 50, 64)).astype(np.float32)) * 2
    filters = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    kept, k, v = _ext.select_compact(_ext.projection_scores(keys, filters, 1), keys, keys + 1, 10, 2, 3)
    ref = reference.select_keep(reference.projection_scores(keys, filters, 1), 10, 2, 3)
    np.testing.assert_array_equal(np.array(kept), np.array(ref))
    np.testing.assert_array_equal(np.array(v), np.array(k) + 1)


@settings(max_examples=150, deadline=None)
@given(
    T=st.integers(1, 70),
    data=st.data(),
    values=st.lists(
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, float("nan"), float("inf"), -float("inf")]),
        min_size=70,
        max_size=70,
    ),
)
def test_select_keep_property(T, data, values):
    budget = data.draw(st.integers(1, T + 3), label="budget")
    n_sink = data.draw(st.integers(0, budget), label="n_sink")
    recent = data.draw(st.integers(0, budget - n_sink), label="recent")
    scores = mx.array(np.array(values[:T], np.float32).reshape(1, 1, T))
    keys = mx.array(np.arange(T, dtype=np.float16).reshape(1, 1, T, 1))
    _check_select_compact(scores, keys, keys, budget, n_sink, recent)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

_K = mx.zeros((1, 2, 8, 4))
_F = mx.zeros((2, 4))
_S = mx.zeros((1, 2, 8))


@pytest.mark.parametrize(
    "args",
    [
        (mx.zeros((2, 8, 4)), _F, 1),
        (_K, mx.zeros((2, 4, 1)), 1),
        (_K, mx.zeros((3, 4)), 1),
        (_K, mx.zeros((2, 5)), 1),
        (_K, _F, 0),
        (_K, _F, 2),
        (_K.astype(mx.int32), _F, 1),
        (_K, _F.astype(mx.int32), 1),
    ],
)
def test_projection_scores_rejects_bad_inputs(args):
    with pytest.raises(ValueError, match=r"^\[qfilters\.projection_scores\] "):
        _ext.projection_scores(*args)


@pytest.mark.parametrize(
    "args",
    [
        (mx.zeros((2, 8)), _K, _K, 4, 0, 0),
        (_S, mx.zeros((1, 2, 8)), _K, 4, 0, 0),
        (_S, _K, mx.zeros((1, 2, 7, 4)), 4, 0, 0),
        (_S, mx.zeros((1, 3, 8, 4)), _K, 4, 0, 0),
        (_S.astype(mx.int32), _K, _K, 4, 0, 0),
        (_S, _K, _K, 0, 0, 0),
        (_S, _K, _K, 4, -1, 0),
        (_S, _K, _K, 4, 0, -1),
        (_S, _K, _K, 4, 3, 2),
    ],
)
def test_select_compact_rejects_bad_inputs(args):
    with pytest.raises(ValueError, match=r"^\[qfilters\.select_compact\] "):
        _ext.select_compact(*args)


def test_kernels_backend_dispatch_uses_extension():
    from qfilters_mlx.backends import dispatch as kernels

    be = kernels.get_backend("cpp")
    assert be.name == "cpp"
    rng = _rng(5)
    keys = mx.array(rng.standard_normal((1, 3, 40, 64)).astype(np.float16))
    s = be.projection_scores(keys, mx.array(rng.standard_normal((3, 64)).astype(np.float32)), -1)
    kept, k, v = be.select_compact(s, keys, keys, 16, 4, 4)
    assert kept.shape == (1, 3, 16) and k.dtype == mx.float16
