"""Selection and insertion-score rules checked exactly against the rule written out
(numpy): the defaults of ``select_keep`` and ``insertion_scores``, the ranking of
scores one float32 ulp apart, decode bookkeeping at absolute positions beyond the
int32 range, and ``insertion_scores``' backend dispatch and ``finite`` switch
(behaviour the mutation check needs pinned: ``tools/mutation.py``, bench/results/mutation.md)."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from backends_here import BACKENDS
from oracle import np_hash_scores, np_keep_rows, np_victim, np_write_slot

from qfilters_mlx.backends import reference as ref
from qfilters_mlx.backends.dispatch import get_backend
from qfilters_mlx.cache.kv_cache import insertion_scores


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
