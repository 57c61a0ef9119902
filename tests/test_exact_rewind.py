"""Copies and rewinds pinned against an uninterrupted run (behaviour the mutation check of
``cache/persistence.py`` and ``cache/rewind.py`` needs pinned: ``tools/mutation.py``,
bench/results/mutation.md).

* pickling / ``copy.deepcopy`` restore the kernel backend by name (also ``"metal"``,
  here a stand-in for a Mac's Metal backend) and leave the copy unobserved, exactly
  like a fresh cache (``persistence.PersistenceMixin.__setstate__``);
* ``trim`` (README "Speculative decoding"): trimmable after an eviction for any
  ``qfilters_max_rewind > 0`` (also 1); a plain trim back to exactly
  ``calib_tokens`` keeps the filter (it was estimated from exactly those keys) and one
  below drops it; undoing the call that calibrated unscores the rows it leaves; a
  compress-once cache rewound after growing is the uninterrupted cache down to its
  buffers (``nbytes``).

References: a cache that never saw the rewound tokens (``tests/test_exact_cache.py``'s
``assert_same``: state, meta, offset, size, nbytes, journal bytes), a fresh cache, and
the rules of the README/docstrings written out.
"""

import copy
import pickle

import mlx.core as mx
import numpy as np
import pytest

from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.backends import metal as metal_module
from qfilters_mlx.backends import reference
from qfilters_mlx.backends.base import Backend
from test_exact_cache import assert_same, feed, fixed_cache, int_data, observable, observed_query_cache


def _has_cpp() -> bool:
    try:
        from qfilters_mlx import _ext  # noqa: F401
    except ImportError:
        return False
    return True


def _copy(c, how):
    return copy.deepcopy(c) if how == "deepcopy" else pickle.loads(pickle.dumps(c))


# ------------------------------------------------------------------ copies
@pytest.fixture
def metal_stand_in(monkeypatch):
    """A Mac's ``metal`` backend stood in for by the reference ops (this machine may have no
    Metal GPU); returns the list of backends it built."""
    built = []

    def select_compact(scores, keys, values, budget, n_sink, recent):
        kept = reference.select_keep(scores, budget, n_sink, recent)
        return (kept, *reference.compact(keys, values, kept))

    def metal_backend(path="auto"):
        built.append(Backend("metal", reference.projection_scores, select_compact))
        return built[-1]

    monkeypatch.setattr(metal_module, "metal_backend", metal_backend)
    return built


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("backend", ["reference", "cpp", "metal"])
def test_a_copy_resolves_the_same_backend_and_continues_like_the_original(backend, how, metal_stand_in):
    """The backend (compiled functions, not picklable) is stored by name and resolved again:
    a copy of a cache on backend X runs on X (``metal`` included) and continues bit for bit."""
    if backend == "cpp" and not _has_cpp():
        pytest.skip("qfilters_mlx._ext is not built")
    k, v, f = int_data(40, seed=11)
    c = fixed_cache(f, backend=backend)
    feed(c, k, v, [14, 1, 1])  # evicted, in slot mode
    twin = _copy(c, how)
    assert twin.backend.name == c.backend.name == backend
    if backend == "metal":
        assert len(metal_stand_in) == 2 and twin.backend is metal_stand_in[1]  # resolved anew
    assert_same(twin, c)
    start = 16
    for L in (1, 3, 1):
        for x in (c, twin):
            feed(x, k, v, [L], start=start)
        start += L
        assert_same(twin, c)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_is_unobserved_like_a_fresh_cache(how):
    """A copy is not the cache an observe_queries block registered: its ``queries_observed`` is
    the fresh cache's ``False``, its first update outside a block raises naming
    observe_queries (nothing stored), and inside a new block it grows like the original."""
    c, k, q = observed_query_cache(3, 4, 4, qfilters_budget=12, qfilters_n_sink=2, qfilters_recent=2,
                                   qfilters_calib_tokens=8)
    c.update_and_fetch(k, k)
    c.observe_queries(q)
    twin = _copy(c, how)
    fresh = QFiltersKVCache(c.config).queries_observed
    assert fresh is False and twin.queries_observed is fresh and c.queries_observed is True
    with pytest.raises(ValueError, match=r"observe_queries\(model, caches\)"):
        twin.update_and_fetch(k, k)
    assert twin.offset == 4 and twin.size() == 4
    twin.queries_observed = True  # a new observe_queries block
    for x in (c, twin):
        x.update_and_fetch(k, k)
        x.observe_queries(q)
    assert_same(twin, c)


# ------------------------------------------------------------------ rewinds
def assert_same_but_journal(a, b):
    """``assert_same`` less the journal, which a rewind uses up (README: fewer rewindable
    tokens right after a rewind): state, meta, offset, size and the buffers' bytes."""
    (xa, ma, oa, sa, na, ja), (xb, mb, ob, sb, nb, jb) = observable(a), observable(b)
    for x, y in zip(xa, xb):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y)
    assert (ma, oa, sa, na - ja) == (mb, ob, sb, nb - jb)


def test_depth_one_is_trimmable_after_an_eviction_and_rewinds_exactly():
    """README: with ``qfilters_max_rewind=N > 0`` an evicted cache is trimmable and ``trim(n)``
    is exact for ``n <= N``: N = 1 rewinds a decode step and the last token of a call."""
    k, v, f = int_data(40, seed=12)
    for chunks in ([16, 1, 1], [16, 3]):
        a, b = fixed_cache(f, depth=1), fixed_cache(f, depth=1)
        feed(a, k, v, chunks)
        assert a.evicted and a.is_trimmable() and a.rewindable_tokens == 1
        assert a.trim(1) == 1
        feed(b, k, v, chunks[:-1] + [chunks[-1] - 1] if chunks[-1] > 1 else chunks[:-1])
        assert_same_but_journal(a, b)
        feed(a, k, v, [1, 2], start=sum(chunks) - 1)
        feed(b, k, v, [1, 2], start=sum(chunks) - 1)
        assert_same(a, b)


def calibrating_cache(calib, budget, depth=0):
    """A Q-Filters cache estimating its filter from its first ``calib`` keys."""
    return QFiltersKVCache(KVCacheConfig(
        method="qfilters", qfilters_budget=budget, qfilters_n_sink=2, qfilters_recent=2,
        qfilters_calib_tokens=calib, qfilters_filter_source="keys", qfilters_max_rewind=depth,
        qfilters_backend="reference"))


def test_plain_trim_keeps_the_filter_down_to_exactly_calib_tokens():
    """Before any eviction the filter is estimated once ``calib_tokens`` keys are present
    (``offset >= calib_tokens``): trimming back to exactly ``calib_tokens`` keeps it (and the
    scores), one token further drops it (rows unscored, as before calibration)."""
    k, v, _ = int_data(20, seed=13)
    a = calibrating_cache(8, 64)
    feed(a, k, v, [12])
    assert a.filter is not None and a.trim(0) == 0
    for keep in (8, 7):
        a.trim(a.offset - keep)
        b = calibrating_cache(8, 64)
        feed(b, k, v, [keep])
        assert (b.filter is not None) == (keep >= 8)
        assert_same(a, b)


def test_rewinding_the_calibrating_call_unscores_the_rows_it_leaves():
    """After an eviction, rewinding (all or part of) the call that estimated the filter leaves
    the cache as one fed only what remains: before calibration its rows are unscored (zeros)."""
    k, v, _ = int_data(30, seed=14)
    for back, left in ((10, [6]), (4, [6, 6]), (12, [4])):
        a = calibrating_cache(10, 8, depth=12)
        feed(a, k, v, [4, 2, 10] if back == 12 else [6, 10])
        assert a.evicted and a.filter is not None
        assert a.trim(back) == back
        b = calibrating_cache(10, 8, depth=12)
        feed(b, k, v, left)
        assert (a.filter is None) == (sum(left) < 10)
        assert_same(a, b)


@pytest.mark.parametrize("chunks", [[3, 5], [1] * 7], ids=["call", "decode_step"])
def test_compress_once_growth_rewound_is_the_uninterrupted_cache_down_to_its_buffers(chunks):
    """Compress-once with ``qfilters_growth``: after the compression new tokens are appended into
    buffers grown in 256-row blocks; the call (or decode step) that passes ``K + growth`` evicts.
    Rewinding it restores the rows and the buffers' size (``nbytes``) of a cache that never saw
    it, and both continue identically."""
    k, v, f = int_data(40, seed=15)

    def cache():
        c = QFiltersKVCache(KVCacheConfig(
            method="qfilters", qfilters_mode="compress_once", qfilters_compress_at="manual",
            qfilters_budget=8, qfilters_n_sink=2, qfilters_recent=2, qfilters_growth=6,
            qfilters_max_rewind=8, qfilters_backend="reference"), filters=mx.array(f))
        feed(c, k, v, [20])
        assert c.compress() == 8
        return c

    a, b = cache(), cache()
    feed(a, k, v, chunks, start=20)
    assert a.size() == 14 and a.offset == 20 + sum(chunks)  # 8 + 6: the growth limit held
    a.trim(chunks[-1])
    feed(b, k, v, chunks[:-1], start=20)
    assert_same(a, b)
    for x in (a, b):
        feed(x, k, v, [2, 1], start=20 + sum(chunks[:-1]))
    assert_same(a, b)
