"""Slot-mode decode steps: cpp primitives equal the reference; kept sets equal select_keep."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from helpers.oracle import np_keep_rows
from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.backends import reference as ref

_ext = pytest.importorskip("qfilters_mlx._ext")


def as_bits(a):
    a = np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)
    return a.view(np.uint16) if a.dtype == np.float16 else a


@pytest.mark.parametrize("dtype,B,H,S,D", list(itertools.product(
    [mx.float32, mx.float16, mx.bfloat16], [1, 2], [1, 3], [2, 33], [8, 80])))
def test_write_slot_equals_reference(dtype, B, H, S, D):
    rng = np.random.default_rng(S * D)
    buf = mx.array(rng.standard_normal((B, H, S, D)).astype(np.float32)).astype(dtype)
    rows_t = mx.array(rng.standard_normal((B, 1, H, D)).astype(np.float32)).astype(dtype)
    rows = rows_t.transpose(0, 2, 1, 3)  # non-contiguous, like RoPE output
    free = mx.array(rng.integers(0, S, (B, H)).astype(np.int32))
    got = _ext.write_slot(buf, rows, free)
    want = ref.write_slot(buf, rows, free)
    assert got.dtype == dtype and got.shape == buf.shape
    np.testing.assert_array_equal(as_bits(got), as_bits(want))
    with pytest.raises(ValueError, match=r"\[qfilters.write_slot\]"):
        _ext.write_slot(buf, rows[:, :, :, :1], free)


@pytest.mark.parametrize("S,n_sink,recent,ties", [
    c for c in itertools.product([3, 17, 130], [0, 1, 2], [0, 1], [False, True]) if c[1] + c[2] < c[0]
])
def test_decode_select_equals_reference(S, n_sink, recent, ties):
    rng = np.random.default_rng(S + 7 * n_sink + 3 * recent)
    B, H = 2, 3
    sc = rng.integers(-2, 3, (B, H, S)) if ties else rng.standard_normal((B, H, S))
    sc = sc.astype(np.float32)
    sc[0, 0, :2] = [-0.0, np.inf]
    position = 500
    pos = np.stack([np.stack([rng.permutation(position)[:S] for _ in range(H)]) for _ in range(B)])
    pos[:, :, 0] = 0  # a sink position
    new = rng.standard_normal((B, H, 1)).astype(np.float32)
    new[1, 2, 0] = np.nan
    free = rng.integers(0, S, (B, H)).astype(np.int32)
    args = (mx.array(sc), mx.array(pos.astype(np.int64)), mx.array(new), mx.array(free),
            position, n_sink, recent)
    got = _ext.decode_select(*args)
    want = ref.decode_select(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.array(g), np.array(w))


@pytest.mark.parametrize("method", ["qfilters", "l2norm", "random", "streaming_llm"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_cpp_and_reference_caches_decode_identically(method, dtype):
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((2, 3, 300, 16)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((2, 3, 300, 16)).astype(np.float32)).astype(dtype)
    caches = {}
    for backend in ("reference", "cpp"):
        c = QFiltersKVCache(KVCacheConfig(method=method, qfilters_budget=24, qfilters_n_sink=3,
                                          qfilters_recent=5, qfilters_calib_tokens=16,
                                          qfilters_filter_source="keys", qfilters_sign=1),
                            backend=backend)
        c.update_and_fetch(k[:, :, :40], v[:, :, :40])
        outs = []
        for t in range(40, 300):
            ok, ov = c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
            outs.append((as_bits(ok), as_bits(ov)))
        caches[backend] = (c, outs)
    (a, oa), (b, ob) = caches["reference"], caches["cpp"]
    for (ka, va), (kb, vb) in zip(oa, ob):  # every step returns the same slots
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)
    np.testing.assert_array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))


def test_slot_mode_keeps_the_select_keep_set_and_returns_budget_plus_one():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((1, 2, 200, 8)).astype(np.float32)
    k = mx.array(keys)
    c = QFiltersKVCache(KVCacheConfig(qfilters_budget=20, qfilters_n_sink=2, qfilters_recent=3,
                                      qfilters_calib_tokens=10, qfilters_filter_source="keys",
                                      qfilters_sign=1), backend="cpp")
    c.update_and_fetch(k[:, :, :30], k[:, :, :30])
    for t in range(30, 200):
        out_k, _ = c.update_and_fetch(k[:, :, t:t + 1], k[:, :, t:t + 1])
        assert out_k.shape[2] == 21 and c.size() == 20 and c.offset == t + 1
        # the returned slots hold the kept tokens plus the new one, in some order
        got = {tuple(r) for r in np.array(out_k[0, 0])}
        assert tuple(keys[0, 0, t]) in got
    scores = np.einsum("bhtd,hd->bht", keys.astype(np.float64), np.array(c.filter, np.float64))
    np.testing.assert_array_equal(np.array(c.kept_positions()), np_keep_rows(scores, 20, 2, 3))
    # back to temporal order for a multi-token call
    out_k, _ = c.update_and_fetch(k[:, :, :4], k[:, :, :4])
    assert out_k.shape[2] == 24
    np.testing.assert_array_equal(np.array(out_k[:, :, 20:]), keys[:, :, :4])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("sign", [1, -1])
def test_decode_select_keys_equals_scoring_then_select(dtype, sign):
    """The fused op equals projection_scores + decode_select: bit for bit in the cpp
    backend (same scoring loop), and the reference composition up to float32 rounding
    of the new score (victims compared on tie-free data)."""
    rng = np.random.default_rng(11 + sign)
    B, H, S, D, position = 2, 3, 40, 80, 900
    sc = mx.array(rng.standard_normal((B, H, S)).astype(np.float32))
    pos = mx.array(np.stack([np.stack([rng.permutation(position)[:S] for _ in range(H)])
                             for _ in range(B)]).astype(np.int64))
    keys_t = mx.array(rng.standard_normal((B, 1, H, D)).astype(np.float32)).astype(dtype)
    keys = keys_t.transpose(0, 2, 1, 3)  # strided, like RoPE output
    filters = mx.array(rng.standard_normal((H, D)).astype(np.float32))
    free = mx.array(rng.integers(0, S, (B, H)).astype(np.int32))
    got = _ext.decode_select_keys(sc, pos, keys, filters, free, position, sign, 2, 5)
    two_ops = _ext.decode_select(sc, pos, _ext.projection_scores(keys, filters, sign), free,
                                 position, 2, 5)
    for g, w in zip(got, two_ops):
        np.testing.assert_array_equal(np.array(g), np.array(w))
    want = ref.decode_select(sc, pos, ref.projection_scores(keys, filters, sign), free,
                             position, 2, 5)
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    np.testing.assert_array_equal(np.array(got[2]), np.array(want[2]))
    # the new token's score sits in its slot
    new = np.einsum("bhd,hd->bh", np.array(keys[:, :, 0].astype(mx.float32), np.float64),
                    np.array(filters, np.float64)) * sign
    slot = np.array(free)
    stored = np.take_along_axis(np.array(got[0]), slot[:, :, None], 2)[:, :, 0]
    np.testing.assert_allclose(stored, new, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"\[qfilters.decode_select_keys\].*sign"):
        _ext.decode_select_keys(sc, pos, keys, filters, free, position, 0, 2, 5)
    with pytest.raises(ValueError, match=r"\[qfilters.decode_select_keys\]"):
        _ext.decode_select_keys(sc, pos, keys, filters[:2], free, position, sign, 2, 5)
    with pytest.raises(ValueError, match=r"\[qfilters.decode_select_keys\]"):
        _ext.decode_select_keys(sc, pos, keys, filters, free, position, sign, 30, 10)


def test_backends_compose_decode_select_keys_from_their_own_ops():
    from qfilters_mlx.backends.dispatch import get_backend

    rng = np.random.default_rng(5)
    sc = mx.array(rng.standard_normal((1, 2, 10)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(10, dtype=mx.int64), (1, 2, 10))
    keys = mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32))
    f = mx.array(rng.standard_normal((2, 8)).astype(np.float32))
    free = mx.array([[3, 7]], dtype=mx.int32)
    be = get_backend("reference")
    got = be.decode_select_keys(sc, pos, keys, f, free, 10, -1, 1, 2)
    want = ref.decode_select(sc, pos, ref.projection_scores(keys, f, -1), free, 10, 1, 2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.array(g), np.array(w))
