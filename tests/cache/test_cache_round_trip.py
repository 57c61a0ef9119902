"""Every way of saving or copying a cache keeps every attribute, at every stage:
before calibration with queries kept, after an eviction, and
mid-decode in slot mode (the normal case: a prompt cache saved after generation),
with a filter estimated from keys, from observed queries, or given from outside.
The reloaded cache then continues exactly like the uninterrupted one: the same
returned keys/values, in the same order, bit for bit, and the same attributes.

Attributes compared: every entry of the cache's ``__dict__`` (arrays bit for bit)
except the rewind journal (not saved, by design), the backend (compared by name),
the observation flags (a copy must be observed on its own, by design) and the
row buffers, whose live rows are compared through ``state`` (temporal order;
the free slot's content is never read).
"""

from __future__ import annotations

import copy
import json
import pickle

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from helpers.backends_here import BACKENDS
from qfilters_mlx import KVCacheConfig, QFiltersKVCache

SKIP = {"_journal", "backend", "queries_observed", "_queries_pending", "rows",  # (rows: by state)
        "_victim_rows"}
H_KV, H_Q, D = 2, 4, 8


def bits(a):
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def assert_same_value(x, y, what):
    if isinstance(x, mx.array) or isinstance(y, mx.array):
        assert isinstance(x, mx.array) and isinstance(y, mx.array), what
        assert x.dtype == y.dtype and x.shape == y.shape, what
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=what)
    else:
        assert x == y and type(x) is type(y), f"{what}: {x!r} != {y!r}"


def assert_same_cache(a, b):
    assert type(a) is type(b) is QFiltersKVCache
    assert set(a.__dict__) == set(b.__dict__)
    for name in sorted(set(a.__dict__) - SKIP):
        assert_same_value(a.__dict__[name], b.__dict__[name], name)
    assert a.backend.name == b.backend.name
    sa, sb = a.state, b.state
    for i, (x, y) in enumerate(zip(sa[:6], sb[:6])):
        if x is None:
            assert y is None, f"state[{i}]"
        else:
            assert_same_value(x, y, f"state[{i}]")
    assert json.loads(sa[6]) == json.loads(sb[6])
    for prop in ("needs_queries", "scoring_ready", "size", "is_trimmable"):
        va, vb = getattr(a, prop), getattr(b, prop)
        assert (va() if callable(va) else va) == (vb() if callable(vb) else vb), prop


def reloaded(c, how, tmp_path):
    if how == "file":
        path = str(tmp_path / "c.safetensors")
        save_prompt_cache(path, [c])
        return load_prompt_cache(path)[0]
    if how == "state":
        return QFiltersKVCache.from_state(c.state)
    if how == "deepcopy":
        return copy.deepcopy(c)
    return pickle.loads(pickle.dumps(c))


def feed(c, k, v, q, lo, hi, step):
    """Tokens lo..hi-1 in calls of ``step`` tokens (observing queries when the cache
    waits for them); the returned keys/values of every call, as numpy."""
    out = []
    for t in range(lo, hi, step):
        e = min(t + step, hi)
        c.queries_observed = c.needs_queries  # as inside `observe_queries(model, caches)`
        ks, vs = c.update_and_fetch(k[:, :, t:e], v[:, :, t:e])
        out.append((bits(ks), bits(vs)))
        if c.needs_queries:
            c.observe_queries(q[:, :, t:e])
    return out


STAGES = {  # (prefill tokens, decode steps) before saving
    "waiting for queries": (10, 0),
    "after eviction": (40, 0),
    "mid-decode": (30, 9),
}
FILTERS = ("keys", "queries", "fixed")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("how", ["file", "state", "deepcopy", "pickle"])
def test_round_trip_keeps_every_attribute_and_continues_bit_for_bit(backend, filters, stage, how, tmp_path):
    rng = np.random.default_rng(7)
    k = mx.array(rng.standard_normal((1, H_KV, 80, D)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((1, H_KV, 80, D)).astype(np.float32)).astype(mx.float16)
    q = mx.array(rng.standard_normal((1, H_Q, 80, D)).astype(np.float32))
    given = mx.array(rng.standard_normal((H_KV, D)).astype(np.float32)) if filters == "fixed" else None
    cfg = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=3, qfilters_calib_tokens=20,
                        qfilters_filter_source="keys" if filters == "keys" else "queries")
    c = QFiltersKVCache(cfg, layer_idx=3, filters=given, backend=backend)
    prefill, steps = STAGES[stage]
    feed(c, k, v, q, 0, prefill, 7)
    feed(c, k, v, q, prefill, prefill + steps, 1)
    t = prefill + steps
    if stage == "waiting for queries" and filters == "queries":
        assert c.needs_queries and c._queries.shape[2] == 10  # kept queries are part of the state
    if stage == "mid-decode":
        assert c._free is not None  # slot mode
    assert c.filter_fixed is (filters == "fixed")
    d = reloaded(c, how, tmp_path)
    assert_same_cache(c, d)
    # both continue identically: chunks, then decode steps
    for lo, hi, step in ((t, t + 12, 5), (t + 12, t + 22, 1)):
        out_c, out_d = feed(c, k, v, q, lo, hi, step), feed(d, k, v, q, lo, hi, step)
        for (kc, vc), (kd, vd) in zip(out_c, out_d, strict=True):
            np.testing.assert_array_equal(kc, kd)
            np.testing.assert_array_equal(vc, vd)
        assert_same_cache(c, d)
    assert c.filter is not None and c.evicted and c.offset == t + 22


@pytest.mark.parametrize("how", ["file", "state"])
def test_a_compress_once_cache_waiting_for_its_trigger_round_trips_it(how, tmp_path):
    """Saved after the prompt's chunk, before the single-token call that compresses it
    (``at="prompt_end"``), with ``keep_last_kv``: the loaded cache has both flags, compresses
    at the same call and continues bit for bit."""
    from qfilters_mlx.config import CompressOnce

    rng = np.random.default_rng(4)
    k, v = (mx.array(rng.standard_normal((1, H_KV, 40, D)).astype(np.float32)) for _ in range(2))
    f = mx.array(rng.standard_normal((H_KV, D)).astype(np.float32))
    cfg = KVCacheConfig(method="qfilters", head_dim=D, qfilters_budget=12, qfilters_n_sink=2,
                        qfilters_recent=0, mode=CompressOnce(ratio=0.5))
    c = QFiltersKVCache(cfg, filters=f, backend="reference")
    c.keep_last_kv = True
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    assert c._saw_chunk and not c.compressed
    r = reloaded(c, how, tmp_path)
    assert r._saw_chunk is True and r.keep_last_kv is True
    for x, y in zip(c.state[:4], r.state[:4]):
        np.testing.assert_array_equal(bits(x), bits(y))
    for t in range(30, 34):
        for a, b in zip(c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1]),
                        r.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])):
            np.testing.assert_array_equal(bits(a), bits(b))
    assert c.compressed and r.compressed and c.size() == r.size() == 19  # 15 kept + 4 grown
    assert c._compressed == r._compressed and c.offset == r.offset == 34
    for x, y in zip(c.state[:4], r.state[:4]):
        np.testing.assert_array_equal(bits(x), bits(y))
    for x, y in zip(c.keys_and_values(), r.keys_and_values()):
        np.testing.assert_array_equal(bits(x), bits(y))


def _state(**kw):
    """A valid saved state of a streaming cache mid-decode (slot layout), as a list."""
    rng = np.random.default_rng(5)
    k, v = (mx.array(rng.standard_normal((1, H_KV, 30, D)).astype(np.float32)) for _ in range(2))
    cfg = KVCacheConfig(method=kw.pop("method", "l2norm"), head_dim=D, qfilters_budget=12,
                        qfilters_recent=4)
    c = QFiltersKVCache(cfg, backend="reference")
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    for t in range(20, 23):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    return list(c.state)


def _meta(state, **changes):
    meta = json.loads(state[6])
    for key, value in changes.items():
        meta[key] = value
    return [*state[:6], json.dumps(meta)]


def test_malformed_states_are_refused_naming_the_cause():
    from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache

    empty = QFiltersKVCache(KVCacheConfig(method="l2norm", qfilters_budget=12)).state
    assert empty[:4] == (None,) * 4  # an empty cache saves no rows, and loads again
    assert QFiltersKVCache.from_state(empty).empty()
    s = _state()
    assert json.loads(s[6])["slots"] is not None  # saved mid-decode: a slot layout
    short = r"^state must be \(keys, values, scores, positions, filter, queries, meta\)$"
    long = r"^state must be \(keys, values, scores, positions, filter, queries, meta, fp_keys\) for a QuantizedQFiltersKVCache$"
    shapes = r"^state: keys/values/scores/positions shapes disagree with each other or with the offset$"
    k, v, sc, pos = s[:4]
    bad = {
        short: [s[:6], s + [None], tuple(s[:5])],
        r"^state: keys, values, scores and positions must all be set or all None$":
            [[None, *s[1:]], [*s[:3], None, *s[4:]]],
        shapes: [[k[0], *s[1:]], [k, v[:, :, :5], *s[2:]], [k, v, sc[:, :1], *s[3:]],
                 [*s[:3], pos[:, :, :5], *s[4:]], _meta(s, offset=5)],
        r"^state: meta 'slots' does not match the rows$":
            [_meta(s, slots={**json.loads(s[6])["slots"], "free": [[0]]}),
             _meta(s, slots={**json.loads(s[6])["slots"], "order": [[0, 1]]})],
        r"^state: meta says evicted=True for method='full', which never evicts$":
            [_meta(s, config={**json.loads(s[6])["config"], "method": "full"})],
    }
    for message, states in bad.items():
        for st in states:
            with pytest.raises(ValueError, match=message):
                QFiltersKVCache.from_state(st)
    with pytest.raises(ValueError, match=long):
        QuantizedQFiltersKVCache.from_state(s)
    q = QuantizedQFiltersKVCache(KVCacheConfig(method="l2norm", qfilters_budget=12), bits=8, group_size=32)
    q.update_and_fetch(mx.zeros((1, H_KV, 3, 64)), mx.zeros((1, H_KV, 3, 64)))
    with pytest.raises(ValueError, match=r"^state: kv_bits=8 was saved by another cache class than "
                                         r"QFiltersKVCache \(QuantizedQFiltersKVCache stores kv_bits caches\)$"):
        QFiltersKVCache.from_state(q.state[:7])


def test_a_saved_filters_path_is_kept_when_the_file_exists_and_dropped_when_it_moved(tmp_path):
    s = _state()
    path = tmp_path / "f.safetensors"
    path.write_bytes(b"")  # (only its existence is read)
    cfg = json.loads(s[6])["config"]
    kept = QFiltersKVCache.from_state(_meta(s, config={**cfg, "qfilters_filters": str(path)}))
    assert kept.config.qfilters_filters == str(path)
    assert json.loads(kept.state[6])["config"]["qfilters_filters"] == str(path)  # a path is saved
    f = mx.array(np.random.default_rng(6).standard_normal((1, H_KV, D)).astype(np.float32))
    arr = QFiltersKVCache(KVCacheConfig(head_dim=D, qfilters_budget=12, qfilters_filters=f), filters=f[0])
    arr.update_and_fetch(mx.zeros((1, H_KV, 3, D)), mx.zeros((1, H_KV, 3, D)))
    assert json.loads(arr.state[6])["config"]["qfilters_filters"] is None  # an array: saved as `filter`
    assert QFiltersKVCache.from_state(arr.state).config.qfilters_filters is None
    moved = QFiltersKVCache.from_state(_meta(s, config={**cfg, "qfilters_filters": str(tmp_path / "gone")}))
    assert moved.config.qfilters_filters is None
    np.testing.assert_array_equal(np.array(moved.state[0]), np.array(s[0]))
