"""The reference backend's decode step and query orientation, and ``to_quantized``'s
arguments, pinned against independent references (behaviour the mutation check of
``backends/reference.py`` and ``cache/kv_cache.py`` needs pinned: ``tools/mutation.py``,
bench/results/mutation.md).

References: the victim rule written out in numpy (``oracle.np_victim``, one head at a
time for per-head windows), the sign of the mean query projection computed in numpy on
small integers (exact sums), and mlx-lm's own ``KVCache.to_quantized``.
"""

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from oracle import np_victim, np_write_slot
from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.backends import reference as ref


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
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=32, qfilters_n_sink=2, qfilters_recent=4,
                        qfilters_backend="reference")
    ours = QFiltersKVCache(cfg, filters=mx.array(rng.standard_normal((H, D)).astype(np.float32)))
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
