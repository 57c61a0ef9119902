"""Watching one model's queries never changes another thread's or another model's
forward pass, even of the same class.

Thread A feeds a model inside ``observe_queries`` (query-derived filter); thread B
runs another model of the same class, unwatched, at the same time. B's logits must
equal B run alone, and A's caches must end exactly as A run alone (same filter,
same kept keys), in every one of ``RUNS`` repetitions.
"""

import threading

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, make_prompt_cache

from helpers.observe_models import build
from qfilters_mlx import KVCacheConfig, QFiltersKVCache, observe_queries

RUNS, BUDGET, CALIB = 200, 8, 8
CFG = KVCacheConfig(qfilters_budget=BUDGET, qfilters_n_sink=1, qfilters_recent=2, qfilters_calib_tokens=CALIB,
                    qfilters_filter_source="queries", qfilters_sign=1)
PROMPT = mx.array([[(5 * i + 1) % 64 for i in range(10)]])
STEPS = 3  # single-token steps after the prompt


def watched_run(model):
    """A's work: prompt then ``STEPS`` decode steps inside observe_queries; the caches' keys."""
    caches = [QFiltersKVCache(CFG, i) for i in range(len(model.layers))]
    with observe_queries(model, caches):
        model(PROMPT, cache=caches)
        for t in range(STEPS):
            model(mx.array([[t + 3]]), cache=caches)
    mx.eval([c.state for c in caches])
    return [np.array(c.state[0]) for c in caches], [np.array(c.filter) for c in caches]


def plain_run(model, caches=None):
    """B's work: the same tokens through mlx-lm's own caches, no hooks; the logits of every call."""
    caches = make_prompt_cache(model) if caches is None else caches
    out = [model(PROMPT, cache=caches)]
    for t in range(STEPS):
        out.append(model(mx.array([[t + 3]]), cache=caches))
    mx.eval(out)
    return [np.array(o) for o in out]


def test_observing_one_model_leaves_another_threads_model_alone():
    model_a, _ = build("llama")
    model_b, _ = build("llama")
    model_b.update(tree_map(lambda p: p * 1.5, model_b.parameters()))  # another model, same class
    mx.eval(model_b.parameters())
    want_a, want_b = watched_run(model_a), plain_run(model_b)
    failures = []
    for run in range(RUNS):
        got, errors = {}, []
        start = threading.Barrier(2)

        def work(name, fn, model):
            try:
                start.wait()
                got[name] = fn(model)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{name}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=("a", watched_run, model_a)),
                   threading.Thread(target=work, args=("b", plain_run, model_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            failures.append((run, errors))
            continue
        for w, g in zip(want_b, got["b"]):
            np.testing.assert_array_equal(g, w)
        for w, g in zip(want_a[0] + want_a[1], got["a"][0] + got["a"][1]):
            np.testing.assert_array_equal(g, w)
    assert not failures, f"{len(failures)} of {RUNS} runs failed; first: {failures[0]}"


class _Gated:
    """Once armed, the first update meets the other thread at a gate: ``before``
    (wait for it before updating), ``after`` (signal it once updated) and ``hold``
    (wait for it after updating)."""

    def update_and_fetch(self, keys, values):
        gate, self.gate = getattr(self, "gate", None), None
        if gate and gate.get("before"):
            assert gate["before"].wait(30)
        out = super().update_and_fetch(keys, values)
        if gate and gate.get("after"):
            gate["after"].set()
        if gate and gate.get("hold"):
            assert gate["hold"].wait(30)
        return out


class _GatedQFilters(_Gated, QFiltersKVCache):
    pass


class _GatedKVCache(_Gated, KVCache):
    pass


def test_the_watched_model_updates_while_another_model_is_mid_forward():
    """The interleaving that broke class-wide hooks, forced with gates: B (unwatched,
    same class) is inside its forward when A's cache advances; B's forward ends
    before A's attention call. B must not notice; A must end as alone."""
    model_a, _ = build("llama")
    model_b, _ = build("llama")
    want_a, want_b = watched_run(model_a), plain_run(model_b)
    b_mid, a_updated, b_done = threading.Event(), threading.Event(), threading.Event()
    caches = [_GatedQFilters(CFG, i) for i in range(len(model_a.layers))]
    caches[0].gate = {"before": b_mid, "after": a_updated, "hold": b_done}
    b_caches = [_GatedKVCache() for _ in model_b.layers]
    b_caches[0].gate = {"after": b_mid, "hold": a_updated}
    errors, got_a = [], []

    def a():
        try:
            with observe_queries(model_a, caches):
                model_a(PROMPT, cache=caches)
                for t in range(STEPS):
                    model_a(mx.array([[t + 3]]), cache=caches)
            got_a.extend([np.array(c.state[0]) for c in caches] + [np.array(c.filter) for c in caches])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=a)
    t.start()
    try:
        got_b = plain_run(model_b, b_caches)
    finally:
        b_done.set()
        t.join(30)
    assert not errors, errors
    for w, g in zip(want_b, got_b):
        np.testing.assert_array_equal(g, w)
    for w, g in zip(want_a[0] + want_a[1], got_a, strict=True):
        np.testing.assert_array_equal(g, w)
