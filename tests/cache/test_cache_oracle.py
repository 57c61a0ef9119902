"""Differential test: random call sequences through ``QFiltersKVCache`` and the
independent numpy model of ``tests/helpers/cache_model.py``, compared after every call.

Sequences mix multi-token prefill chunks of random sizes, single-token decode
steps (slot mode after an eviction), ``trim`` (before an eviction: a plain trim;
after it: an exact rewind within ``max_rewind``, else a ValueError
that changes nothing), mlx-lm prompt-cache save/load, ``copy.deepcopy`` (the
original is then fed a token that must not reach the copy) and
``kept_positions()`` at random points, including mid-decode after evictions.
Keys are small integers and filters multiples of 1/2, so every float32 score is
exact whatever the summation order (bit-exact comparison of scores), ties are
frequent (tie-break: the earlier position wins) and some keys hold +inf, -inf
or NaN (non-finite scores rank as -inf). Every value row carries its absolute
position in two columns (``t // 64``, ``t % 64``: exact in every dtype), so rows
returned in slot order can be identified without trusting the cache.

After every call: offset, size, evicted, the kept positions (``state``'s
temporal view, and ``kept_positions()`` when drawn), the kept keys, values and
scores bit for bit, and the keys/values the call returned (temporal order for
multi-token calls; as a set of rows for slot-mode decode steps).

Runs on every backend available here (reference, cpp; metal on a Mac).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from helpers.backends_here import BACKENDS, examples
from helpers.cache_model import CacheModel
from qfilters_mlx import KVCacheConfig, QFiltersKVCache


DTYPES = {"float32": (mx.float32, np.float32), "float16": (mx.float16, np.float16),
          "bfloat16": (mx.bfloat16, np.float32)}


def host(a: mx.array) -> np.ndarray:
    """numpy copy (bfloat16 widened to float32: exact)."""
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def same_bits(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.dtype == want.dtype and got.dtype.kind == "f":
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), f"{what}: NaN pattern differs"
        w = want.copy()
        g = got.copy()
        g[nan] = 0
        w[nan] = 0
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"{what}: bits differ"
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


@st.composite
def setups(draw):
    method = draw(st.sampled_from(["qfilters", "qfilters", "l2norm", "streaming_llm"]))
    budget = draw(st.integers(3, 14))
    n_sink = draw(st.integers(0, budget - 2))
    recent = draw(st.integers(0, budget - 2 - n_sink))
    return dict(
        method=method, budget=budget, n_sink=n_sink, recent=recent,
        sign=draw(st.sampled_from([1, -1])), dtype=draw(st.sampled_from(sorted(DTYPES))),
        B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), D=draw(st.sampled_from([2, 4, 8])),
        max_rewind=draw(st.sampled_from([0, 0, 3, 8])), seed=draw(st.integers(0, 2**31)),
    )


class Driver:
    """One cache, its model, and the checks after every call."""

    def __init__(self, s, backend, tmp_path):
        self.s, self.tmp = s, tmp_path
        self.rng = np.random.default_rng(s["seed"])
        self.mx_dtype, self.np_dtype = DTYPES[s["dtype"]]
        H, D = s["H"], s["D"]
        filt = self.rng.integers(-4, 5, size=(H, D)).astype(np.float32) / 2
        cfg = KVCacheConfig(method=s["method"], qfilters_budget=s["budget"], qfilters_n_sink=s["n_sink"],
                            qfilters_recent=s["recent"], qfilters_sign=s["sign"],
                            qfilters_filter_source="keys", qfilters_calib_tokens=1)
        self.cache = QFiltersKVCache(cfg, filters=mx.array(filt) if s["method"] == "qfilters" else None,
                                     backend=backend, max_rewind=s["max_rewind"])
        self.model = CacheModel(s["method"], s["budget"], s["n_sink"], cfg.protected_recent,
                                filters=filt, sign=cfg.score_sign)
        self.fresh = 0  # tokens fed since the cache was built, loaded or rewound
        self.saves = 0

    # ----------------------------------------------------------------- inputs
    def tokens(self, L: int, nonfinite: bool):
        B, H, D = self.s["B"], self.s["H"], self.s["D"]
        k = self.rng.integers(-3, 4, size=(B, H, L, D)).astype(np.float32)
        if nonfinite:
            n = self.rng.integers(1, max(2, B * H * L // 2))
            idx = tuple(self.rng.integers(0, m, size=n) for m in (B, H, L, D))
            k[idx] = self.rng.choice([np.inf, -np.inf, np.nan], size=n)
        v = self.rng.integers(-8, 9, size=(B, H, L, D)).astype(np.float32)
        t = self.model.offset + np.arange(L)
        v[..., 0] = (t // 64)[None, None, :]
        if D > 1:
            v[..., 1] = (t % 64)[None, None, :]
        return k.astype(self.np_dtype), v.astype(self.np_dtype)

    # ----------------------------------------------------------------- actions
    def update(self, L: int, nonfinite: bool):
        k, v = self.tokens(L, nonfinite)
        slot_step = L == 1 and self.cache.evicted
        out_k, out_v = self.cache.update_and_fetch(mx.array(k).astype(self.mx_dtype),
                                                   mx.array(v).astype(self.mx_dtype))
        want_pos = self.model.update(k, v)
        self.fresh += L
        got_k, got_v = host(out_k), host(out_v)
        if slot_step:
            event("slot-mode decode step")
        if nonfinite:
            event("non-finite keys")
        if slot_step:  # slot order: identify rows by the position tag of their values
            tag = (got_v[..., 0] * 64 + (got_v[..., 1] if self.s["D"] > 1 else 0)).astype(np.int64)
            order = np.argsort(tag, axis=2, kind="stable")
            got_k = np.take_along_axis(got_k, order[..., None], axis=2)
            got_v = np.take_along_axis(got_v, order[..., None], axis=2)
            want_pos = np.sort(want_pos, axis=2)
        wk, wv, _ = self.model.rows(want_pos)
        same_bits(got_k, wk.astype(got_k.dtype), "returned keys")
        same_bits(got_v, wv.astype(got_v.dtype), "returned values")
        self.check()

    def trim(self, n: int):
        c = self.cache
        if not c.evicted:
            got = c.trim(n)
            assert got == self.model.trim(n)
            self.fresh = max(self.fresh - got, 0)
        elif n > c.rewindable_tokens:
            before = c.state
            with pytest.raises(ValueError, match="max_rewind"):
                c.trim(n)
            self.check(state=before)
        else:
            assert c.trim(n) == n == self.model.trim(n)
            self.fresh = 0
        self.check()

    def save_load(self):
        path = str(self.tmp / f"c{self.saves}.safetensors")
        self.saves += 1
        save_prompt_cache(path, [self.cache])
        (self.cache,) = load_prompt_cache(path)
        self.fresh = 0
        self.check()

    def deep_copy(self):
        dup = copy.deepcopy(self.cache)
        # the original moves on: nothing of it may reach the copy
        k, v = self.tokens(1, False)
        self.cache.update_and_fetch(mx.array(k).astype(self.mx_dtype), mx.array(v).astype(self.mx_dtype))
        self.cache = dup
        self.check()

    def kept_positions(self):
        same_bits(np.array(self.cache.kept_positions()), self.model.kept(), "kept_positions()")
        self.check()

    # ----------------------------------------------------------------- checks
    def check(self, state=None):
        c, m = self.cache, self.model
        assert c.offset == m.offset
        assert c.evicted == m.evicted
        if m.offset == 0:
            assert c.size() == 0
            return
        want = m.kept()
        assert c.size() == want.shape[2]
        if c.evicted and c.max_rewind:
            assert c.rewindable_tokens >= min(c.max_rewind, self.fresh)
        keys, values, scores, positions = (state or c.state)[:4]
        same_bits(np.array(positions), want, "kept positions")
        wk, wv, ws = m.rows(want)
        k, v = host(keys), host(values)
        same_bits(k, wk.astype(k.dtype), "kept keys")
        same_bits(v, wv.astype(v.dtype), "kept values")
        same_bits(np.array(scores), ws, "kept scores")


ACTIONS = st.one_of(
    st.tuples(st.just("prefill"), st.integers(2, 20), st.booleans()),
    st.tuples(st.just("decode"), st.just(1), st.booleans()),
    st.tuples(st.just("decode"), st.just(1), st.just(False)),
    st.tuples(st.just("decode"), st.just(1), st.just(False)),
    st.tuples(st.just("decode"), st.just(1), st.just(False)),
    st.tuples(st.just("trim"), st.integers(0, 9), st.just(False)),
    st.tuples(st.just("save"), st.just(0), st.just(False)),
    st.tuples(st.just("copy"), st.just(0), st.just(False)),
    st.tuples(st.just("kept"), st.just(0), st.just(False)),
)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=setups(), actions=st.lists(ACTIONS, min_size=6, max_size=60))
def test_cache_matches_model(backend, s, actions, tmp_path):
    d = Driver(s, backend, tmp_path)
    for name, n, nonfinite in actions:
        if name == "prefill":
            d.update(n, nonfinite)
        elif name == "decode":
            d.update(1, nonfinite)
        elif name == "trim":
            event(f"trim {'evicted' if d.cache.evicted else 'before eviction'}")
            d.trim(n)
        elif name == "save" and d.model.offset:
            event(f"save {'in slot mode' if d.cache._free is not None else 'evicted' if d.cache.evicted else 'before eviction'}")
            d.save_load()
        elif name == "copy" and d.model.offset:
            event(f"copy {'in slot mode' if d.cache._free is not None else 'evicted' if d.cache.evicted else 'before eviction'}")
            d.deep_copy()
        elif name == "kept" and d.model.offset:
            d.kept_positions()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["qfilters", "l2norm"])
def test_non_finite_and_tied_keys_in_prefill_and_decode(backend, method, tmp_path):
    """Deterministic case of the rules above: +inf / -inf / NaN keys
    score -inf and are dropped first (unless sink or recent), in prefill and in slot-mode
    decode; equal scores keep the earlier position. Checked against the model, not
    only backend against backend."""
    s = dict(method=method, budget=4, n_sink=1, recent=1, sign=1, dtype="float32", B=1, H=1, D=2,
             max_rewind=0, seed=0)
    d = Driver(s, backend, tmp_path)
    d.cache.filter = mx.array([[1.0, 0.0]]) if method == "qfilters" else None
    d.model.filters = np.array([[1.0, 0.0]], np.float32)
    k = np.array([[2, 0], [np.inf, 0], [1, 0], [np.nan, 0], [1, 0], [5, 0], [-np.inf, 0], [1, 0],
                  [1, 1], [3, 0]], np.float32)[None, None]
    if method == "l2norm":
        k = -k  # same magnitudes: ties stay ties, the largest key has the largest norm

    def feed(rows):
        v = np.zeros(rows.shape, np.float32)
        t = d.model.offset + np.arange(rows.shape[2])
        v[..., 0], v[..., 1] = t // 64, t % 64
        got_k, _ = d.cache.update_and_fetch(mx.array(rows), mx.array(v))
        d.model.update(rows, v)
        d.check()
        return np.array(got_k)

    # scores (qfilters): 2, -inf, 1, -inf, 1, 5, -inf, 1; l2norm: -2, -inf, -1, -inf, -1, -5, -inf, -1
    feed(k[:, :, :8])  # prefill: evicts 8 -> 4 (sink 0, recent 7, two by score)
    want = {"qfilters": [0, 2, 5, 7], "l2norm": [0, 2, 4, 7]}[method]  # 2 beats 4 on a tie
    assert d.model.kept()[0, 0].tolist() == want  # (the cache == the model: checked by feed)
    for row in ([[np.nan, 0]], [[np.inf, 0]], [[1, 0]], [[1, 0]]):  # slot-mode steps 8..11
        feed(np.array(row, np.float32)[None, None] * (-1 if method == "l2norm" else 1))
    want = {"qfilters": [0, 2, 5, 11], "l2norm": [0, 2, 4, 11]}[method]
    assert d.model.kept()[0, 0].tolist() == want
