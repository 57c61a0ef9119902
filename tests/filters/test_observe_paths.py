"""Query observation never fails silently.

Every attention path the hooks know (mlx-lm's scaled_dot_product_attention name,
mx.fast.scaled_dot_product_attention, inline attention through mx.fast.rope)
delivers the post-RoPE queries, checked against queries recomputed from each
attention module; a path that cannot be observed raises naming the layer, at
observe_queries entry or at the latest at the end of the forward pass; patches
are undone on every exit; blocks in two threads run side by side.
"""

import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, make_prompt_cache

from helpers.observe_models import HandWritten, attention_of, build, recording_inputs
from qfilters_mlx import KVCacheConfig, QFiltersKVCache, observe_queries
from qfilters_mlx.backends import reference as ref
from qfilters_mlx.filters import calibration as cal
from qfilters_mlx.filters.capture import QueriesNotCaptured, capture_attention

BUDGET, CALIB, T = 16, 32, 68
ARCHS = ["llama", "qwen3", "olmo2", "gemma2", "olmo", "plamo2", "handwritten"]


def cfg(source, sign):
    return KVCacheConfig(qfilters_budget=BUDGET, qfilters_n_sink=2, qfilters_calib_tokens=CALIB,
                         qfilters_filter_source=source, qfilters_sign=sign)


def our_caches(model, config):
    """The model's own caches with every plain KVCache replaced by ours."""
    return [QFiltersKVCache(config, i) if type(c) is KVCache else c
            for i, c in enumerate(make_prompt_cache(model))]


def tokens(n=T):
    return mx.array([[(7 * i + 3) % 64 for i in range(n)]])


def run(model, config, step=T):
    """Feed ``T`` tokens in calls of ``step`` inside observe_queries; returns the caches,
    each layer's attention input ``[1, T, hidden]`` and the cache sizes inside the block."""
    caches = our_caches(model, config)
    with recording_inputs(model) as seen:
        with observe_queries(model, caches):
            for s in range(0, T, step):
                model(tokens()[:, s:s + step], cache=caches)
            sizes = [c.size() if isinstance(c, QFiltersKVCache) else None for c in caches]
    n = -(-T // step)  # the probe's calls came first
    return caches, {i: mx.concatenate(x[-n:], axis=1) for i, x in seen.items() if x}, sizes


def patch_points(model=None):
    """Everything the hooks may patch, by identity."""
    snap = {n: vars(m).get("scaled_dot_product_attention") for n, m in list(sys.modules.items())
            if n.startswith("mlx_lm.models.") and m is not None}
    snap["fast.sdpa"] = mx.fast.scaled_dot_product_attention
    snap["fast.rope"] = mx.fast.rope
    for cls in (KVCache, QFiltersKVCache):
        snap[cls.__name__] = vars(cls).get("update_and_fetch")
    if model is not None:
        snap["model"] = vars(type(model)).get("__call__")
    return snap


@pytest.mark.parametrize("arch", ARCHS)
def test_every_path_delivers_the_layers_queries(arch):
    model, queries_of = build(arch)
    # mlx-lm's olmo cannot prefill (it adds the "causal" mask string to its scores): decode only
    caches, seen, sizes = run(model, cfg("queries", 1), step=1 if arch == "olmo" else T)
    budgeted = [i for i, c in enumerate(caches) if isinstance(c, QFiltersKVCache)]
    assert budgeted
    for i in budgeted:
        assert sizes[i] == BUDGET, (arch, i, sizes)  # evicted by the end of the forward
        assert caches[i].offset == T
        x = seen[i]
        q = queries_of(attention_of(model, i), x)  # [1, H_q, T, D], recomputed independently
        want = ref.estimate_filter_from_queries(q[:, :, :CALIB], caches[i].keys.shape[1])
        np.testing.assert_allclose(np.array(caches[i].filter), np.array(want), atol=2e-4)


@pytest.mark.parametrize("arch", ["gemma2", "plamo2", "handwritten", "llama"])
def test_auto_sign_orients_the_key_filter_by_the_observed_queries(arch):
    model, queries_of = build(arch)
    plain, _, _ = run(model, cfg("keys", 1))
    auto, seen, sizes = run(model, cfg("keys", "auto"))
    for i, c in enumerate(auto):
        if not isinstance(c, QFiltersKVCache):
            continue
        assert sizes[i] == BUDGET
        f = plain[i].filter  # the key-SVD filter (same first keys: one forward, evictions after)
        q = queries_of(attention_of(model, i), seen[i])[:, :, :CALIB]
        np.testing.assert_allclose(np.array(c.filter),
                                   np.array(f * ref.query_orientation(f, q)[:, None]), atol=2e-4)


@pytest.mark.parametrize("source,sign", [("queries", 1), ("keys", "auto")])
def test_unobservable_attention_raises_at_entry_naming_the_layer(source, sign):
    model = HandWritten(rope="manual")
    caches = our_caches(model, cfg(source, sign))
    before = patch_points(model)
    with pytest.raises(QueriesNotCaptured, match=r"layer 0 \(attention in .*_Attn.__call__\).*"
                                                 r"filter-source keys.*qfilters-mlx calibrate") as err:
        with observe_queries(model, caches):
            pytest.fail("entered")
    assert set(err.value.layers) == {0, 1}
    assert all(c.empty() and c.offset == 0 for c in caches)  # the probe used its own caches
    assert patch_points(model) == before
    # nothing waits for queries: no probe, no error
    model(tokens(4), cache=our_caches(model, cfg("keys", 1)))
    with observe_queries(model, our_caches(model, cfg("keys", 1))):
        pass


def test_path_missed_by_the_probe_raises_by_the_end_of_the_forward():
    """Short calls observable, long ones not: the error comes from the call that
    would complete calib_tokens, never a cache silently holding all tokens."""
    model = HandWritten(rope="switch")
    caches = our_caches(model, cfg("queries", 1))
    with pytest.raises(QueriesNotCaptured, match=r"layer 0 \(attention in .*_Attn") as err:
        with observe_queries(model, caches):
            model(tokens(), cache=caches)  # layer 0's miss is reported when layer 1 starts
    assert list(err.value.layers) == [0]
    assert caches[0].offset == T and caches[1].empty()  # layer 1 refused before changing state
    model = HandWritten(rope=["module", "switch"])
    caches = our_caches(model, cfg("queries", 1))
    with pytest.raises(QueriesNotCaptured, match="layer 1") as err:
        with observe_queries(model, caches):
            model(tokens(2), cache=caches)  # observable: delivered
            model(tokens(4)[:, 2:], cache=caches)
            assert caches[1].offset == 4 and caches[1].filter is None
            model(mx.array([[5, 6, 7]]), cache=caches)  # L = 3: the last layer's miss, at return
    assert list(err.value.layers) == [1]
    assert [c.offset for c in caches] == [7, 7]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_update_wrapped_on_the_instance_before_entry(arch):
    """A cache whose update_and_fetch was wrapped as an instance attribute (taken before
    the hooks exist) bypasses the update hook: SDPA models still deliver through the
    cache argument; inline attention cannot be paired and the cache refuses to go on."""
    model, _ = build(arch)
    caches = our_caches(model, cfg("queries", 1))
    calls = []
    for c in caches:
        inner = c.update_and_fetch
        c.update_and_fetch = lambda k, v, _f=inner: calls.append(k.shape[2]) or _f(k, v)
    with observe_queries(model, caches):
        if arch == "llama":
            for s in range(0, T, 17):
                model(tokens()[:, s:s + 17], cache=caches)
            assert [c.size() for c in caches] == [BUDGET, BUDGET] and len(calls) == 8
        else:
            with pytest.raises(QueriesNotCaptured, match="layer 0"):  # at the end of the forward
                model(tokens(), cache=caches)
            with pytest.raises(ValueError, match="layer 0: the queries of the previous update"):
                model(tokens()[:, :1], cache=caches)  # and the cache refuses to go on
            assert caches[0].offset == T


def test_cache_refuses_an_update_whose_previous_queries_never_came():
    c = QFiltersKVCache(cfg("queries", 1), layer_idx=5)
    c.queries_observed = True
    k = mx.ones((1, 2, 3, 16))
    c.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="layer 5: the queries of the previous update"):
        c.update_and_fetch(k, k)
    assert c.offset == 3 and c.size() == 3
    c.observe_queries(mx.ones((1, 4, 3, 16)))
    c.update_and_fetch(k, k)  # queries arrived: goes on
    assert c.offset == 6


def test_patches_restored_after_errors_and_nesting_refused():
    model, _ = build("llama")
    before = patch_points(model)
    caches = our_caches(model, cfg("queries", 1))
    with pytest.raises(RuntimeError, match="boom"):
        with observe_queries(model, caches):
            assert mx.fast.rope is not before["fast.rope"]
            assert vars(QFiltersKVCache)["update_and_fetch"] is not before["QFiltersKVCache"]
            raise RuntimeError("boom")
    assert patch_points(model) == before
    with pytest.raises(RuntimeError, match="nested"):
        with capture_attention(model, lambda *a: None, caches=[KVCache(), KVCache()]):
            with observe_queries(model, caches):
                pass
    assert patch_points(model) == before
    with pytest.raises(ValueError, match="cb"):  # an error from the callback inside the forward
        plain = [KVCache(), KVCache()]
        with capture_attention(model, lambda *a: (_ for _ in ()).throw(ValueError("cb")), caches=plain):
            model(tokens(3), cache=plain)
    assert patch_points(model) == before
    # a model that raises inside the forward
    with pytest.raises(Exception):
        with observe_queries(model, caches):
            model(mx.zeros((1, 2, 3)), cache=caches)
    assert patch_points(model) == before


def test_concurrent_blocks_on_two_models_each_see_only_their_own():
    """Two threads, each inside its own block on its own model (same class), both
    blocks open at once: each sees exactly the queries it sees alone."""
    models = [build("llama")[0], build("llama")[0]]
    models[1].update(tree_map(lambda p: -p, models[1].parameters()))

    def capture(model, both_inside=None):
        seen, caches = [], [KVCache(), KVCache()]
        with capture_attention(model, lambda l, q, k: seen.append((l, np.array(q))), caches=caches):
            if both_inside is not None:
                both_inside.wait(5)
            model(tokens(5), cache=caches)
        return seen

    alone = [capture(m) for m in models]
    barrier, got = threading.Barrier(2), [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, capture(models[i], barrier)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for want, seen in zip(alone, got):
        assert [layer for layer, _ in seen] == [layer for layer, _ in want] == [0, 1]
        for (_, w), (_, g) in zip(want, seen):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("arch", ["gemma2", "handwritten"])
def test_calibrate_inline_attention_matches_recomputed_queries(arch):
    model, queries_of = build(arch)
    with recording_inputs(model) as seen:
        f = cal.calibrate_filters(model, [tokens(40)[0].tolist()], samples=10_000)
    for i in range(len(model.layers)):
        # the last input: the builder's shape probes (model_info) run forwards before calibration
        q = queries_of(attention_of(model, i), seen[i][-1])
        np.testing.assert_allclose(np.array(f[i]), np.array(ref.estimate_filter_from_queries(q, 2)),
                                   atol=2e-4)


def test_calibrate_names_layers_without_queries():
    model = HandWritten(rope="manual", n_layers=3)
    with pytest.raises(QueriesNotCaptured, match=r"layer 0 .*layer 1 .*layer 2 .*filter-source keys"):
        cal.calibrate_filters(model, [list(range(10))])


@pytest.mark.parametrize("source,sign", [("queries", 1), ("keys", "auto")])
def test_gemma2_through_the_builder(source, sign):
    """gemma2 (attention computed inline) as a user writes it: the builder's caches, 68 tokens in one call."""
    from qfilters_mlx import KVCacheBuilder

    model, _ = build("gemma2")
    caches = KVCacheBuilder.for_model(model, cfg(source, sign))
    with observe_queries(model, caches):
        model(tokens(), cache=caches)
        assert [c.size() for c in caches] == [BUDGET] * len(caches)
    assert all(c.filter is not None and c.offset == T for c in caches)
