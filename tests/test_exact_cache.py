"""QFiltersKVCache's documented behaviour pinned exactly: constructor checks, the default
layer, the query-observation contract, buffer growth and ``nbytes``, exact rewinds against
an uninterrupted run, path independence with the C++ backend, and the compress-once
``prompt_end`` trigger (behaviour the mutation check of ``cache/kv_cache.py`` needs pinned:
``tools/mutation.py``, bench/results/mutation.md).

References: the numpy model of the cache (``tests/cache_model.py``), the random arm's hash
in numpy (``tests/test_properties.py``), a cache that never saw the rewound tokens, and the
buffer rule of ``QFiltersKVCache._append`` written out (``cap_rows``).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from cache_model import CacheModel, model_keep, model_scores
from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from test_properties import np_random_scores

H, D = 2, 8
STEP = 256  # QFiltersKVCache.step: buffers grow in blocks of 256 rows (as mlx-lm's KVCache)


def int_data(T, seed=0, H=H, D=D):
    """Small-integer keys/values (exact float32 sums: numpy and MLX scores agree bit for bit)
    and a filter of small integers: ``(k, v [1, H, T, D], f [H, D])`` float32 numpy."""
    rng = np.random.default_rng(seed)
    k = rng.integers(-4, 5, size=(1, H, T, D)).astype(np.float32)
    v = rng.integers(-4, 5, size=(1, H, T, D)).astype(np.float32)
    f = rng.integers(-2, 3, size=(H, D)).astype(np.float32)
    return k, v, f


def fixed_cache(f, budget=12, n_sink=2, recent=2, depth=0, backend="reference", **kw):
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=budget, qfilters_n_sink=n_sink,
                        qfilters_recent=recent, qfilters_max_rewind=depth, qfilters_backend=backend, **kw)
    return QFiltersKVCache(cfg, filters=mx.array(f))


def observed_query_cache(seed, T, Tq, **kw):
    """A query-calibrating cache (reference backend, config ``kw``) as inside an
    ``observe_queries`` block, with Gaussian keys ``[1, H, T, D]`` and GQA queries
    ``[1, 2 H, Tq, D]`` (float32 MLX): ``(cache, keys, queries)``."""
    cfg = KVCacheConfig(method="qfilters", qfilters_filter_source="queries",
                        qfilters_backend="reference", **kw)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, H, T, D)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 2 * H, Tq, D)).astype(np.float32))
    c = QFiltersKVCache(cfg)
    c.queries_observed = True  # as inside observe_queries
    return c, k, q


def feed(cache, k, v, chunks, start=0):
    for L in chunks:
        cache.update_and_fetch(mx.array(k[:, :, start:start + L]), mx.array(v[:, :, start:start + L]))
        start += L
    return start


def observable(c):
    """state arrays (temporal order) and meta, offset, size, bytes: what a caller sees."""
    st = c.state
    arrays = [None if a is None else np.array(a) for a in st[:6]]
    return arrays, st[6], c.offset, c.size(), c.nbytes, c.journal_nbytes


def assert_same(a, b):
    assert_same_view(observable(a), observable(b))


def assert_same_view(va, vb):
    """Two :func:`observable` snapshots are equal (arrays bit for bit, dtypes included)."""
    (xa, ma, *sa), (xb, mb, *sb) = va, vb
    for x, y in zip(xa, xb):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y)
    assert ma == mb and sa == sb


def cap_rows(rows, budget=None):
    """Buffer rows after ``rows`` no longer fit: the smallest multiple of ``STEP`` holding them;
    for a cache evicting to ``budget``, at most ``max(rows, budget + 1)`` (budget + the chunk)."""
    step = STEP * math.ceil(rows / STEP)
    return step if budget is None else min(step, max(rows, budget + 1))


def bytes_at(cap, B=1, itemsize=4, filter_=True):
    """nbytes of a cache whose K, V, scores (float32) and positions (int64) buffers hold ``cap``
    rows, plus the float32 filter ``[H, D]`` (journal empty)."""
    return B * H * cap * (2 * D * itemsize + 4 + 8) + (H * D * 4 if filter_ else 0)


# --------------------------------------------------------------- constructor
def test_constructor_rejects_each_bad_filters_naming_the_argument():
    cfg = KVCacheConfig(method="qfilters", head_dim=D, qfilters_budget=8, qfilters_backend="reference")
    shape_err = r"^filters must be an mx.array \[H_kv, D\], got "
    with pytest.raises(ValueError, match=shape_err + r"\(2, 8\)$"):
        QFiltersKVCache(cfg, filters=np.ones((H, D), np.float32))  # numpy, right shape
    with pytest.raises(ValueError, match=shape_err + r"list$"):
        QFiltersKVCache(cfg, filters=[[1.0] * D] * H)
    with pytest.raises(ValueError, match=shape_err + r"\(1, 2, 8\)$"):
        QFiltersKVCache(cfg, filters=mx.ones((1, H, D)))  # an mx.array of the wrong rank
    with pytest.raises(TypeError, match=r"^filters must be floating point, got mlx.core.int32$"):
        QFiltersKVCache(cfg, filters=mx.ones((H, D), mx.int32))
    with pytest.raises(ValueError, match=r"^filters head_dim 4 != config.head_dim 8$"):
        QFiltersKVCache(cfg, filters=mx.ones((H, 4)))
    # The right shape is accepted (with and without head_dim), stored as float32, unscaled.
    f = np.arange(H * D, dtype=np.float32).reshape(H, D) / 8
    for config in (cfg, KVCacheConfig(method="qfilters", qfilters_budget=8, qfilters_backend="reference")):
        c = QFiltersKVCache(config, filters=mx.array(f).astype(mx.float16))
        assert c.filter.dtype == mx.float32 and c.filter_fixed and c.scoring_ready
        np.testing.assert_array_equal(np.array(c.filter), f)


def test_default_layer_is_layer_zero_for_the_random_arm():
    """Built without ``layer_idx`` a cache is layer 0: the random arm scores with the hash of
    (seed, layer 0, head, position) (README's random arm; numpy hash of test_properties)."""
    T, seed = 40, 9
    k, v, _ = int_data(T, seed=1)
    cfg = KVCacheConfig(method="random", qfilters_budget=10, qfilters_n_sink=1, qfilters_recent=2,
                        qfilters_seed=seed, qfilters_backend="reference")
    c = QFiltersKVCache(cfg)
    feed(c, k, v, [25, 15])
    assert c.layer_idx == 0
    expected = np_random_scores(H, T, seed, 0)
    pos = np.array(c.kept_positions())
    np.testing.assert_array_equal(np.array(c.scores[:, :, :c.size()]),
                                  np.take_along_axis(expected[None], pos, axis=2).astype(np.float32))
    kept = np.stack([model_keep(expected[h].astype(np.float32), 10, 1, 2) for h in range(H)])
    np.testing.assert_array_equal(pos[0], kept)


def test_a_trim_back_into_calibration_waits_for_the_next_calls_queries_only():
    """Once calibrated, observe_queries owes nothing; a trim back below ``calib_tokens`` drops
    the filter (README, rewinds), and the next update goes ahead (no queries are owed from
    before the trim) and re-estimates the filter exactly as a cache that never saw the
    trimmed tokens (both fed the same kept queries and the same new call)."""
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=16, qfilters_calib_tokens=8,
                        qfilters_filter_source="queries", qfilters_backend="reference")
    rng = np.random.default_rng(41)
    k = mx.array(rng.integers(-4, 5, size=(1, H, 16, D)).astype(np.float32))
    q = mx.array(rng.integers(-4, 5, size=(1, 2 * H, 16, D)).astype(np.float32))
    c, fresh = QFiltersKVCache(cfg), QFiltersKVCache(cfg)
    c.queries_observed = fresh.queries_observed = True  # as inside observe_queries
    for a, b in ((0, 10), (10, 11)):  # calibrates at 10 tokens, then a call owing nothing
        c.update_and_fetch(k[:, :, a:b], k[:, :, a:b])
        c.observe_queries(q[:, :, : b - a])
    assert c.filter is not None and not c.needs_queries
    assert c.trim(5) == 5 and c.filter is None and c.needs_queries
    fresh.update_and_fetch(k[:, :, :6], k[:, :, :6])
    fresh.observe_queries(q[:, :, :6])
    for x in (c, fresh):
        x.update_and_fetch(k[:, :, 11:14], k[:, :, 11:14])
        x.observe_queries(q[:, :, 11:14])
    assert c.filter is not None
    np.testing.assert_array_equal(np.array(c.filter), np.array(fresh.filter))
    np.testing.assert_array_equal(np.array(c.state[5]), np.array(fresh.state[5]))


def test_query_calibrated_cache_refuses_updates_outside_observe_queries():
    """README: a cache estimating its filter from queries must run inside observe_queries;
    a fresh one (never observed) raises before storing anything."""
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=8, qfilters_calib_tokens=4,
                        qfilters_filter_source="queries", qfilters_backend="reference")
    c = QFiltersKVCache(cfg)
    k = mx.ones((1, H, 3, D))
    with pytest.raises(ValueError, match=r"observe_queries\(model, caches\)"):
        c.update_and_fetch(k, k)
    assert c.empty() and c.offset == 0 and c.size() == 0


# ------------------------------------------------------------ buffers, bytes
def test_buffers_grow_in_step_blocks_and_nbytes_counts_them(tmp_path):
    """K/V/scores/positions are written after the live rows in place while they fit, else the
    buffers grow to the smallest multiple of 256 rows holding them (as mlx-lm's KVCache), at
    most ``max(rows, budget + 1)`` (``cap_rows``; budget 600 here); an eviction leaves exactly the kept rows; ``nbytes`` counts every buffer at capacity."""
    k, v, f = int_data(400, seed=2)
    c = fixed_cache(f, budget=600)
    feed(c, k, v, [3])
    assert c.nbytes == bytes_at(cap_rows(3, 600))
    feed(c, k, v, [300], start=3)
    assert c.nbytes == bytes_at(cap_rows(303, 600))
    # A reloaded cache holds exactly its rows; a trim keeps the buffers; rows that fit again
    # are written in place (capacity unchanged), one more row grows to 256.
    small = fixed_cache(f, budget=600)
    feed(small, k, v, [10])
    save_prompt_cache(str(tmp_path / "c.safetensors"), [small])
    r = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
    assert r.nbytes == bytes_at(10)
    assert r.trim(3) == 3
    feed(r, k, v, [3], start=7)
    assert r.nbytes == bytes_at(10) and r.offset == 10
    for x, y in zip(r.state, small.state):  # the rows, scores, positions of the uninterrupted cache
        assert (x is None and y is None) or (np.array(x).tolist() == np.array(y).tolist())
    feed(r, k, v, [1], start=10)
    assert r.nbytes == bytes_at(cap_rows(11, 600))


@pytest.mark.parametrize("chunks", [[45], [44] + [1] * 30, [10] * 9, [100, 1, 1], [3, 200, 1, 60, 1]])
def test_a_budgeted_cache_never_holds_more_than_the_budget_plus_the_chunk(chunks):
    """After every call the buffers hold at most ``max(budget + 1, rows before + L)`` rows
    (``budget + 1``: the budget and the decode step that first evicts; ``rows before + L``:
    the chunk being processed, evicted at the end of the call), for any chunking; a
    conversation shorter than the budget holds ``budget + 1`` rows, not a 256-row block."""
    budget = 64
    k, v, f = int_data(sum(chunks), seed=21)
    c = fixed_cache(f, budget=budget, n_sink=4, recent=8)
    start = 0
    for L in chunks:
        before = c.size()
        start = feed(c, k, v, [L], start)
        assert c.keys.shape[2] <= max(budget + 1, before + L)
        assert c.nbytes == bytes_at(c.keys.shape[2])
    if sum(chunks) <= budget:
        assert c.keys.shape[2] == budget + 1


def test_compress_once_growth_appends_into_step_blocks():
    """Compress-once: the compression keeps exactly K rows; later tokens are appended (no
    eviction without qfilters_growth) into buffers grown in 256-row blocks."""
    k, v, f = int_data(40, seed=3)
    cfg = KVCacheConfig(method="qfilters", qfilters_mode="compress_once", qfilters_compress_at="manual",
                        qfilters_budget=8, qfilters_n_sink=2, qfilters_recent=2, qfilters_backend="reference")
    c = QFiltersKVCache(cfg, filters=mx.array(f))
    feed(c, k, v, [20])
    assert c.compress() == 8 and c.nbytes == bytes_at(8)
    feed(c, k, v, [5, 1], start=20)
    assert c.size() == 14 and c.nbytes == bytes_at(cap_rows(14))
    s = model_scores("qfilters", k, f, 1)[0]
    kept = np.stack([np.concatenate([model_keep(s[h, :20], 8, 2, 2), np.arange(20, 26)]) for h in range(H)])
    np.testing.assert_array_equal(np.array(c.kept_positions())[0], kept)


# ---------------------------------------------------------------- rewinds
def test_rewind_of_the_first_eviction_restores_capacity_and_bytes():
    """README: a rewind leaves the cache as one that never saw the removed tokens, here down
    to its buffers' capacity and ``nbytes``; both then continue identically (numpy model)."""
    k, v, f = int_data(60, seed=4)
    a, b = fixed_cache(f, depth=6), fixed_cache(f, depth=6)
    feed(a, k, v, [10, 5])  # the second call evicts (15 > 12)
    assert a.evicted and a.size() == 12
    assert a.trim(5) == 5
    feed(b, k, v, [10])
    assert not a.evicted and a.keys.shape == b.keys.shape == (1, H, cap_rows(10, 12), D)
    assert_same(a, b)
    model = CacheModel("qfilters", 12, 2, 2, filters=f)
    model.update(k[:, :, :10], v[:, :, :10])
    start = 10
    for L in [4, 1, 1, 3, 1]:
        for c in (a, b):
            feed(c, k, v, [L], start=start)
        model.update(k[:, :, start:start + L], v[:, :, start:start + L])
        start += L
        assert_same(a, b)
        np.testing.assert_array_equal(np.array(a.state[3]), model.kept())  # (state keeps the layout)


def test_rewind_after_eviction_keeps_the_eviction_flag_and_the_journal_reach():
    """After a rewind the cache is still evicted: ``trim`` goes on through the journal, whose
    reach is what the rewind left (README: fewer right after a rewind); deeper raises."""
    k, v, f = int_data(40, seed=5)
    a, b = fixed_cache(f, depth=6), fixed_cache(f, depth=6)
    feed(a, k, v, [16, 3, 3])  # the journal covers the newest calls holding >= 6 tokens: 3 + 3
    assert a.rewindable_tokens == 6
    assert a.trim(3) == 3
    feed(b, k, v, [16, 3])
    assert a.evicted is True and a.is_trimmable()
    assert a.rewindable_tokens == 3  # the one record left (3 tokens)
    before = observable(a)
    with pytest.raises(ValueError, match=r"cannot rewind 4 tokens after an eviction.*qfilters_max_rewind=6"):
        a.trim(4)
    after = observable(a)
    assert after[1:] == before[1:]
    assert all(np.array_equal(x, y) for x, y in zip(after[0][:4], before[0][:4]))
    # the same kept rows, meta (eviction flag) and offset as the uninterrupted cache
    assert [np.array(x).tolist() for x in a.state[:4]] == [np.array(x).tolist() for x in b.state[:4]]
    assert a.state[6] == b.state[6]
    model = CacheModel("qfilters", 12, 2, 2, filters=f)
    for s, L in [(0, 16), (16, 3)]:
        model.update(k[:, :, s:s + L], v[:, :, s:s + L])
    np.testing.assert_array_equal(np.array(a.kept_positions()), model.kept())


def test_state_after_eviction_holds_no_queries_and_round_trips(tmp_path):
    """README/state: the first queries are kept only until the first eviction (``None`` after);
    the saved cache reloads and continues bit for bit."""
    k, v, f = int_data(40, seed=6)
    c = fixed_cache(f, budget=10, depth=4)
    feed(c, k, v, [14, 2])
    assert c.evicted and c.state[5] is None
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    r = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
    assert r.state[5] is None
    feed(r, k, v, [3, 1], start=16)
    feed(c, k, v, [3, 1], start=16)
    assert [np.array(x).tolist() for x in r.state[:4]] == [np.array(x).tolist() for x in c.state[:4]]


# ----------------------------------------------------------- backends, modes
def test_cpp_backend_scores_do_not_depend_on_chunking():
    """README: the kept set, K/V and scores are a pure function of the tokens fed, bit for bit,
    whatever the chunking: prefill calls and slot-mode decode steps score a key alike with the
    configured backend (cpp here, whose float32 sums differ from the reference's in the last
    bits, so a call scored by another backend would show)."""
    from qfilters_mlx.backends.dispatch import get_backend

    try:
        get_backend("cpp")
    except (ValueError, ImportError):
        pytest.skip("the C++ extension is not built")
    rng = np.random.default_rng(7)
    T = 48
    k = rng.standard_normal((2, H, T, 16)).astype(np.float32)
    v = rng.standard_normal((2, H, T, 16)).astype(np.float32)
    f = rng.standard_normal((H, 16)).astype(np.float32)
    f /= np.linalg.norm(f, axis=-1, keepdims=True)
    runs = []
    for chunks in ([T], [20] + [1] * 28, [13, 1, 1, 33], [30, 18]):
        c = fixed_cache(f, budget=12, n_sink=2, recent=3, backend="cpp")
        feed(c, k, v, chunks)
        runs.append([np.array(a) for a in c.state[:4]])
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert x.dtype == y.dtype and np.array_equal(x, y)


def test_prompt_end_trigger_compresses_before_the_first_single_token_call():
    """compression.py: with ``qfilters_compress_at="prompt_end"`` (the default) the first
    single-token call after a multi-token one compresses the stored tokens (not itself), then
    the token is appended; single-token calls before any chunk never compress."""
    k, v, f = int_data(30, seed=8)
    cfg = KVCacheConfig(method="qfilters", qfilters_mode="compress_once", qfilters_budget=8,
                        qfilters_n_sink=2, qfilters_recent=2, qfilters_backend="reference")
    c = QFiltersKVCache(cfg, filters=mx.array(f))
    feed(c, k, v, [1, 1])  # no chunk yet: kept as they come
    assert not c.compressed and c.size() == 2
    feed(c, k, v, [13], start=2)
    assert not c.compressed and c.size() == 15
    feed(c, k, v, [1, 1], start=15)
    assert c.compressed and c.size() == 10 and c.offset == 17
    s = model_scores("qfilters", k, f, 1)[0]
    kept = np.stack([np.concatenate([model_keep(s[h, :15], 8, 2, 2), [15, 16]]) for h in range(H)])
    np.testing.assert_array_equal(np.array(c.kept_positions())[0], kept)


def test_full_cache_never_evicts_its_window_mask_is_mlx_lms_and_an_evicted_state_is_refused():
    """method="full" stores every token (no eviction past the budget): it stays trimmable,
    its window mask is mlx-lm's ``create_causal_mask`` over all stored tokens, and a saved
    state whose meta claims an eviction is refused naming the method, before state changes."""
    from mlx_lm.models.base import create_causal_mask
    import json

    k, v, _ = int_data(40, seed=5)
    c = QFiltersKVCache(KVCacheConfig(method="full", qfilters_budget=8, qfilters_backend="reference"))
    feed(c, k, v, [20, 1, 1, 1])
    assert c.size() == c.offset == 23 and not c.evicted and c.is_trimmable()
    np.testing.assert_array_equal(np.array(c.state[0]), k[:, :, :23])
    for N, w in [(1, 5), (3, 4)]:
        np.testing.assert_array_equal(np.array(c.make_mask(N, window_size=w)),
                                      np.array(create_causal_mask(N, 23, window_size=w)))
    before = observable(c)
    meta = json.loads(c.state[6])
    meta["evicted"] = True
    with pytest.raises(ValueError, match=r"evicted=True for method='full'"):
        c.state = c.state[:6] + (json.dumps(meta),)
    after = observable(c)
    assert before[1:] == after[1:] and all(np.array_equal(x, y) for x, y in zip(before[0], after[0])
                                           if x is not None)
