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

SKIP = {"_journal", "backend", "queries_observed", "_queries_pending", "keys", "values", "scores",
        "positions", "_victim_rows"}
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
                        qfilters_backend=backend,
                        qfilters_filter_source="keys" if filters == "keys" else "queries")
    c = QFiltersKVCache(cfg, layer_idx=3, filters=given)
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
