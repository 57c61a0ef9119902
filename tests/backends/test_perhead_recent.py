"""Per-head recent windows in every backend: selection (select_compact) and the decode
step (decode_select, decode_select_keys) against the reference and the numpy rule
(``oracle.np_keep_rows`` with one window per head). The Metal kernel's per-head
params are covered in ``test_metal_emulated.py`` (emulated) and on a Mac here."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from helpers.kernel_inputs import score_array
from helpers.oracle import np_keep_rows
from qfilters_mlx.backends import reference as ref
from qfilters_mlx.backends.dispatch import get_backend

_ext = pytest.importorskip("qfilters_mlx._ext", reason="compiled extension not built")


def _backends():
    out = [get_backend("reference"), get_backend("cpp")]
    if mx.metal.is_available():
        from qfilters_mlx.backends.metal import metal_backend

        out.append(metal_backend("jit"))
    return out


def _windows(rng, H: int, most: int) -> list[int]:
    """H windows in [0, most], the extremes included when H >= 2."""
    w = rng.integers(0, most + 1, H).tolist()
    if H >= 2:
        w[0], w[1] = 0, most
    return w


@pytest.mark.parametrize("T,H,mode", list(itertools.product((9, 64, 300), (1, 3, 8),
                                                              ("random", "ties", "const"))))
def test_select_compact_per_head_equals_reference_and_numpy(T, H, mode):
    rng = np.random.default_rng(T * 31 + H)
    B = 2
    s = score_array(rng, (B, H, T), mode)
    keys = mx.array(rng.standard_normal((B, H, T, 16)).astype(np.float16))
    values = mx.array(rng.standard_normal((B, H, T, 8)).astype(np.float32))
    for budget in sorted({1, max(1, T // 4), T - 1, T + 2}):
        for n_sink in sorted({0, min(3, budget)}):
            recent = _windows(rng, H, budget - n_sink)
            want = np_keep_rows(s, budget, n_sink, recent)
            np.testing.assert_array_equal(np.array(ref.select_keep(mx.array(s), budget, n_sink, recent)),
                                          want)
            for be in _backends():
                for r in (recent, tuple(recent), np.array(recent)):
                    kept, k, v = be.select_compact(mx.array(s), keys, values, budget, n_sink, r)
                    ctx = f"{be.name} T={T} H={H} budget={budget} sink={n_sink} recent={recent}"
                    np.testing.assert_array_equal(np.array(kept), want, err_msg=ctx)
                    rk, rv = ref.compact(keys, values, mx.array(want))
                    np.testing.assert_array_equal(np.array(k), np.array(rk), err_msg=ctx)
                    np.testing.assert_array_equal(np.array(v), np.array(rv), err_msg=ctx)


def test_one_int_equals_the_same_window_per_head():
    rng = np.random.default_rng(1)
    s = mx.array(rng.standard_normal((1, 3, 50)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 3, 50, 4)).astype(np.float32))
    for be in _backends():
        a = be.select_compact(s, k, k, 20, 2, 7)[0]
        b = be.select_compact(s, k, k, 20, 2, [7, 7, 7])[0]
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("bad,err", [([1, 2], ValueError), ([1, 2, 19], ValueError),
                                     ([1, -1, 2], ValueError), ([1, 2.5, 3], TypeError)])
def test_per_head_windows_are_checked(bad, err):
    s = mx.zeros((1, 3, 30))
    k = mx.zeros((1, 3, 30, 4))
    for be in _backends():
        if be.name == "cpp" and err is TypeError:
            err = (TypeError, ValueError)  # nanobind rejects a float in a list of ints
        with pytest.raises(err):
            be.select_compact(s, k, k, 20, 2, bad)
    with pytest.raises(ValueError, match="head 2"):
        ref.select_keep(s, 20, 2, [1, 2, 19])
    with pytest.raises(ValueError, match=r"\[qfilters.decode_select\].*head 1"):
        _ext.decode_select(mx.zeros((1, 3, 9)), mx.zeros((1, 3, 9), mx.int64), mx.zeros((1, 3, 1)),
                           mx.zeros((1, 3), mx.int32), 20, 2, [0, 7, 1])


def _slot_run(be, scores_all: np.ndarray, budget: int, n_sink: int, recent, keys_all=None, f=None):
    """Feed T tokens one by one through the slot bookkeeping of ``be`` (first ``budget + 1``
    tokens placed directly, then ``decode_select`` / ``decode_select_keys``); return the kept
    positions per row, sorted, after each step's victim is freed."""
    B, H, T = scores_all.shape
    S = budget + 1
    sc = mx.array(scores_all[:, :, :S].copy())
    pos = mx.array(np.broadcast_to(np.arange(S, dtype=np.int64), (B, H, S)).copy())
    # First victim: what decode_select picks when slot S-1 was just written.
    sc, pos, free = be.decode_select(sc, pos, sc[:, :, S - 1:S], mx.full((B, H), S - 1, mx.int32),
                                     S - 1, n_sink, recent)
    for t in range(S, T):
        if keys_all is None:
            sc, pos, free = be.decode_select(sc, pos, mx.array(scores_all[:, :, t:t + 1]), free, t,
                                             n_sink, recent)
        else:
            sc, pos, free = be.decode_select_keys(sc, pos, keys_all[:, :, t:t + 1], f, free, t, 1,
                                                  n_sink, recent)
    p = np.array(pos)
    fr = np.array(free)
    out = np.stack([np.stack([np.sort(np.delete(p[b, h], fr[b, h])) for h in range(H)])
                    for b in range(B)])
    return out


@pytest.mark.parametrize("H,ties", [(3, False), (3, True), (5, True)])
def test_decode_select_per_head_keeps_the_numpy_set(H, ties):
    """After every token fed one at a time, the slots hold exactly what the numpy rule
    keeps over all tokens with each head's own window, in every backend."""
    rng = np.random.default_rng(H + 10 * ties)
    B, T, budget, n_sink = 2, 70, 12, 2
    s = score_array(rng, (B, H, T), "ties" if ties else "random")
    s = np.where(np.isfinite(s), s, -np.inf).astype(np.float32)  # slots store non-finite as -inf
    recent = _windows(rng, H, budget - n_sink)
    want = np_keep_rows(s, budget, n_sink, recent)
    for be in _backends():
        got = _slot_run(be, s, budget, n_sink, recent)
        np.testing.assert_array_equal(got, want, err_msg=f"{be.name} recent={recent}")


def test_decode_select_keys_per_head_equals_reference():
    rng = np.random.default_rng(3)
    B, H, T, D, budget, n_sink = 1, 3, 40, 8, 10, 1
    keys = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    f = mx.array(rng.standard_normal((H, D)).astype(np.float32))
    s = np.array(ref.projection_scores(keys, f, 1))
    recent = [0, 9, 4]
    want = np_keep_rows(s, budget, n_sink, recent)
    for be in _backends():
        got = _slot_run(be, s, budget, n_sink, recent, keys_all=keys, f=f)
        np.testing.assert_array_equal(got, want, err_msg=be.name)
