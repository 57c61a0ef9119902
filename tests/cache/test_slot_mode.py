"""Slot mode (single-token decode after an eviction), its window masks and its rewinds,
pinned exactly (behaviour the mutation check of ``cache/kv_cache.py``
needs pinned: ``tools/mutation.py``, bench/results/mutation.md).

* docs/method.md (Caveats): ``window_size`` masks are supported before eviction and for
  ``streaming_llm``; after a per-head eviction they raise ``ValueError`` naming
  ``window_size``. The mask after a StreamingLLM eviction is mlx-lm's sliding-window rule
  (``create_causal_mask``: key ``k`` visible from query ``q`` iff ``q - w < k <= q``)
  written out in numpy over the absolute positions the numpy model keeps
  (``tests/helpers/cache_model.py``), for one KV head (multi-query models) and several.
* A rewind leaves the cache as one that never saw the removed tokens (journal docstring):
  rewinding, decoding other tokens and rewinding deeper than the first rewind must restore
  the rows the earlier steps evicted (compared with an uninterrupted cache and the numpy
  model), and a rewind into the cache's first call (which evicted) leaves the buffers of a
  fresh cache fed the same tokens (capacity and ``nbytes``).
"""

import mlx.core as mx
import numpy as np
import pytest

from helpers.cache_model import CacheModel
from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from test_cache import assert_same, bytes_at, cap_rows, fixed_cache, int_data
from test_cache import feed_cache as feed

D = 8


def np_window_mask(key_positions, offset, N, window):
    """mlx-lm's sliding-window causal rule over absolute positions: ``[N, S + N]`` bool."""
    k = np.concatenate([np.asarray(key_positions), offset + np.arange(N)])[None, :]
    q = offset + np.arange(N)[:, None]
    return (k <= q) & (k > q - window)


# ------------------------------------------------------------------ window masks
@pytest.mark.parametrize("H", [1, 2])
def test_window_mask_after_streaming_eviction_uses_the_kept_absolute_positions(H):
    budget, n_sink = 6, 2
    k, v, _ = int_data(20, seed=11, H=H)
    cfg = KVCacheConfig(method="streaming_llm", qfilters_budget=budget, qfilters_n_sink=n_sink)
    cache = QFiltersKVCache(cfg, backend="reference")
    model = CacheModel("streaming_llm", budget, n_sink, budget - n_sink)
    start = 0
    for L in [9, 1, 1, 1]:  # a prefill that evicts, then decode steps in slot mode
        feed(cache, k, v, [L], start=start)
        model.update(k[:, :, start:start + L], v[:, :, start:start + L])
        start += L
    assert cache.evicted and cache.offset == start == 12
    kept = model.kept()  # every head keeps the same positions under StreamingLLM
    for N, w in [(3, 4), (1, 5), (2, 8)]:
        got = np.array(cache.make_mask(N, window_size=w))
        want = np_window_mask(kept[0, 0], cache.offset, N, w)
        assert got.dtype == np.bool_ and np.array_equal(got, want), (N, w)
        np.testing.assert_array_equal(np.array(cache.kept_positions()), kept)


@pytest.mark.parametrize("method", ["qfilters", "l2norm", "random"])
def test_window_mask_after_per_head_eviction_raises_naming_window_size(method):
    k, v, f = int_data(12, seed=3)
    cfg = KVCacheConfig(method=method, qfilters_budget=6, qfilters_n_sink=1, qfilters_recent=2)
    cache = QFiltersKVCache(cfg, filters=mx.array(f) if method == "qfilters" else None,
                            backend="reference")
    feed(cache, k, v, [9, 1])
    assert cache.evicted
    before = (cache.offset, np.array(cache.kept_positions()))
    with pytest.raises(ValueError, match=rf"^window_size masks are not supported after per-head "
                                         rf"eviction \(method='{method}'\)"):
        cache.make_mask(2, window_size=4)
    assert cache.offset == before[0]
    np.testing.assert_array_equal(np.array(cache.kept_positions()), before[1])
    # without a window the mask is still the plain causal one
    assert cache.make_mask(2) == "causal" and cache.make_mask(1) is None


# ---------------------------------------------------------------------- rewinds
@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_rewind_across_a_redone_decode_step_restores_the_rows_it_evicted(backend):
    """trim(1), a different token, then trim(2): the second rewind undoes the first step too,
    so the slot that step freed must hold its old row again (the row the first trim put
    back): the cache equals one fed only up to before that step, and continues like it."""
    k, v, f = int_data(40, seed=7)
    other_k, other_v, _ = int_data(40, seed=8)
    a = fixed_cache(f, budget=8, n_sink=1, recent=1, depth=4, backend=backend)
    b = fixed_cache(f, budget=8, n_sink=1, recent=1, depth=4, backend=backend)
    start = feed(a, k, v, [12, 1, 1, 1])  # evicts, then three slot-mode steps
    assert a.trim(1) == 1
    # a token other than the removed one goes into the slot the rewind reopened
    a.update_and_fetch(mx.array(other_k[:, :, 20:21]), mx.array(other_v[:, :, 20:21]))
    assert a.trim(2) == 2  # undoes the new step and the second of the three
    feed(b, k, v, [12, 1])
    assert_same(a, b)
    model = CacheModel("qfilters", 8, 1, 1, filters=f)
    model.update(k[:, :, :13], v[:, :, :13])
    start = 13
    for L in [1, 1, 2, 1]:
        for c in (a, b):
            feed(c, k, v, [L], start=start)
        model.update(k[:, :, start:start + L], v[:, :, start:start + L])
        start += L
        assert_same(a, b)
        kept = model.kept()
        st = a.state  # (temporal view; the slot layout stays as it is)
        np.testing.assert_array_equal(np.array(st[3]), kept)
        for got, want in zip(st[:3], model.rows(kept)):
            np.testing.assert_array_equal(np.array(got), want)


def test_rewind_into_the_first_call_leaves_the_buffers_of_a_fresh_cache():
    """The first call evicts (10 tokens, budget 6); rewinding all but its first token leaves
    the cache of one fed that token alone: buffers of ``budget + 1`` rows, same ``nbytes``."""
    k, v, f = int_data(20, seed=9)
    a = fixed_cache(f, budget=6, n_sink=1, recent=1, depth=9)
    b = fixed_cache(f, budget=6, n_sink=1, recent=1, depth=9)
    feed(a, k, v, [10])
    assert a.evicted and a.size() == 6
    assert a.trim(9) == 9
    feed(b, k, v, [1])
    assert not a.evicted and a.size() == 1
    assert a.keys.shape == b.keys.shape == (1, 2, cap_rows(1, 6), D)
    assert a.nbytes == b.nbytes == bytes_at(cap_rows(1, 6))
    assert_same(a, b)
    start = 1
    for L in [2, 1]:  # both continue identically
        for c in (a, b):
            feed(c, k, v, [L], start=start)
        start += L
        assert a.keys.shape == b.keys.shape
        assert_same(a, b)
