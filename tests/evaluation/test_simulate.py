"""Streaming eviction simulated by attention masks in one forward pass: the masks follow the
keep rule written out in numpy at every step, and the NLLs equal the caches fed token by token."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from helpers.oracle import np_keep
from helpers.query_models import tiny_llama
from qfilters_mlx.cache.kv_cache import build_cache
from qfilters_mlx.config import CompressOnce, KVCacheConfig
from qfilters_mlx.evaluation.perplexity import full_cache_nll, streaming_nll
from qfilters_mlx.evaluation.simulate import MaskedArm, keep_masks, simulated_nll, simulated_pass

HD = 16  # tiny_llama: hidden 144 / 9 query heads


@pytest.mark.parametrize("budget,n_sink,recent,prefix", [
    (8, 2, (0, 3, 5), 1), (8, 0, (2, 2, 2), 5), (12, 4, (0, 0, 8), 12), (6, 1, (5, 0, 1), 3),
    (8, 2, (0, 3, 5), 20),  # a first call longer than the budget (the evaluation's case)
])
def test_keep_masks_are_the_kept_set_after_every_step(budget, n_sink, recent, prefix):
    rng = np.random.default_rng(budget + prefix)
    scores = rng.integers(0, 4, (3, 40)).astype(np.float32)  # many ties: earlier wins
    scores[1, 7] = np.nan  # ranks lowest
    m = keep_masks(scores, budget, n_sink, list(recent), prefix)
    for h in range(3):
        for t in range(40):
            if t < prefix:  # the first call attends causally
                want = np.arange(t + 1)
            else:  # what a cache kept after position t - 1, and the query's own key
                want = np.append(np_keep(scores[h, :t], budget, n_sink, recent[h]), t)
            np.testing.assert_array_equal(np.nonzero(m[h, t])[0], want, err_msg=f"head {h} query {t}")


def _filters(seed=3):
    f = np.random.default_rng(seed).standard_normal((2, 3, HD)).astype(np.float32)
    return mx.array(f / np.linalg.norm(f, axis=-1, keepdims=True))


CONFIGS = {
    "streaming_llm": (KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16), None),
    "random": (KVCacheConfig(method="random", head_dim=HD, qfilters_budget=16, qfilters_recent=4,
                             qfilters_seed=5), None),
    "qfilters": (KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=20, qfilters_recent=0,
                               qfilters_n_sink=2), _filters()),
    "qfilters-sign-1-perhead": (KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=16,
                                              qfilters_sign=-1, qfilters_filter_source="keys",
                                              qfilters_recent=((0, 3, 9), (6, 1, 2))), _filters(4)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("prefix", [1, 10, 30])
def test_simulated_nll_equals_the_caches_fed_token_by_token(name, prefix):
    # (tie-free scores: l2norm ties repeated tokens exactly at layer 0, and rounding, which
    # differs between one pass and decode steps, may then pick either)
    cfg, filters = CONFIGS[name]
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(2).integers(0, 101, 70).tolist()
    caches = [build_cache(cfg, i, filters=None if filters is None else filters[i]) for i in range(2)]
    want = streaming_nll(model, tokens, caches, prefix)
    got = simulated_nll(model, tokens, MaskedArm(cfg, filters=filters), prefix)
    assert len(got) == len(want) == 70 - prefix
    np.testing.assert_allclose(got, want, atol=2e-4)
    # and the eviction mattered: the full cache (mlx-lm's own) predicts otherwise
    assert np.abs(np.array(full_cache_nll(model, tokens, prefix)) - np.array(want)).max() > 1e-3


def test_a_score_function_replaces_the_method():
    cfg, filters = CONFIGS["qfilters"]
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(2).integers(0, 101, 50).tolist()

    def score(layer, keys):  # the filter's projection, written out
        return (keys.astype(mx.float32) @ filters[layer][:, :, None])[None, ..., 0][0]

    same = simulated_nll(model, tokens, MaskedArm(cfg, filters=filters), 4)
    got = simulated_nll(model, tokens, MaskedArm(cfg, score=score), 4)
    np.testing.assert_allclose(got, same, atol=1e-6)


def test_what_it_does_not_cover_is_refused():
    model = tiny_llama(seed=1)
    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    for bad in (0, 30):
        with pytest.raises(ValueError, match=rf"^prefix must be in \[1, 29\], got {bad}$"):
            simulated_nll(model, list(range(30)), MaskedArm(cfg), bad)
    with pytest.raises(ValueError, match="^method='full' evicts nothing: use evaluation.perplexity.full_cache_nll$"):
        MaskedArm(replace(cfg, method="full"))
    with pytest.raises(ValueError, match="^simulated_nll covers the streaming mode only$"):
        MaskedArm(replace(cfg, mode=CompressOnce(0.5)))
    with pytest.raises(ValueError, match=r"^method='qfilters' without score= needs filters= \(fixed at insertion: "
                                         r"online filters are not covered\)$"):
        MaskedArm(KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=16))


def test_keep_masks_refuse_windows_that_do_not_fit():
    s = np.zeros((2, 10), np.float32)
    for budget, n_sink, recent, prefix in [(8, 2, [0, 7], 1), (8, 0, [1], 1), (8, 0, [1, -1], 1),
                                           (8, 0, [1, 1], 0)]:
        with pytest.raises(ValueError, match="keep_masks: need 2 windows"):
            keep_masks(s, budget, n_sink, recent, prefix)


def test_a_layer_with_a_mask_of_its_own_is_refused(monkeypatch):
    import mlx_lm.models.llama as llama

    model = tiny_llama(seed=1)
    monkeypatch.setattr(llama, "create_attention_mask",
                        lambda h, cache=None, **kw: mx.ones((h.shape[1], h.shape[1]), dtype=mx.bool_))
    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    with pytest.raises(ValueError, match="layer 0 attends with its own mask"):
        simulated_nll(model, list(range(30)), MaskedArm(cfg), 4)


def test_attention_outside_mlx_lm_s_sdpa_raises(monkeypatch):
    import mlx_lm.models.llama as llama

    model = tiny_llama(seed=1)
    original = llama.scaled_dot_product_attention
    monkeypatch.setattr(llama, "scaled_dot_product_attention",
                        lambda *a, **k: original(*a, **k))  # not the function the masks replace
    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    with pytest.raises(RuntimeError, match="layers \\[0, 1\\]"):
        simulated_nll(model, list(range(30)), MaskedArm(cfg), 4)
    with pytest.raises(RuntimeError, match="layers \\[1\\] did not go through"):  # from a replayed layer 0 on
        simulated_pass(model, list(range(30)), MaskedArm(cfg), 4, start=1, hidden=mx.zeros((1, 29, 144)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_pass_from_a_recorded_layer_equals_the_whole_pass(name):
    cfg, filters = CONFIGS[name]
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(2).integers(0, 101, 40).tolist()
    arm = MaskedArm(cfg, filters=filters)
    whole, outs = simulated_pass(model, tokens, arm, 6, record=[0, 1])
    assert whole == simulated_nll(model, tokens, arm, 6)
    assert sorted(outs) == [0, 1] and outs[1].shape == (1, 39, 144)
    nll, o = simulated_pass(model, tokens, arm, 6, start=1, hidden=outs[0], record=[1])
    assert nll == whole and mx.array_equal(o[1], outs[1])
    # what the replayed layer returns is what layer 1 reads: another hidden state, other NLLs
    other, _ = simulated_pass(model, tokens, arm, 6, start=1, hidden=outs[0] * 0.5)
    assert np.abs(np.array(other) - np.array(whole)).max() > 1e-3
    assert all(a is b for a, b in zip(model.layers, model.model.layers))  # layers put back


def test_a_pass_from_a_layer_refuses_what_does_not_fit():
    model = tiny_llama(seed=1)
    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    h = mx.zeros((1, 29, 144))
    for kw, said in (({"start": 1}, "start 1, hidden None"), ({"start": 0, "hidden": h}, "start 0, hidden given"),
                     ({"start": 2, "hidden": h}, "start 2, hidden given"),
                     ({"start": -1, "hidden": h}, "start -1, hidden given")):
        with pytest.raises(ValueError, match=rf"^start must be in \[0, 2\) and hidden given exactly when start > 0 "
                                             rf"\({said}\)$"):
            simulated_pass(model, list(range(30)), MaskedArm(cfg), 4, **kw)
    for record in ([0], [2], [-1]):
        with pytest.raises(ValueError, match="record: layers must be in"):
            simulated_pass(model, list(range(30)), MaskedArm(cfg), 4, start=1, hidden=h, record=record)
    for bad in (mx.zeros((1, 28, 144)), mx.zeros((2, 29, 144)), mx.zeros((29, 144))):
        with pytest.raises(ValueError, match=r"^hidden must be \[1, 29, d_model\] \(the recorded output of layer 0\)"):
            simulated_pass(model, list(range(30)), MaskedArm(cfg), 4, start=1, hidden=bad)


def test_model_layers_are_restored_when_the_pass_raises():
    model = tiny_llama(seed=1)
    originals = list(model.layers)
    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    _, outs = simulated_pass(model, list(range(30)), MaskedArm(cfg), 4, record=[0])

    def fails(layer, keys):  # raises inside the pass, after the layers were swapped
        raise FloatingPointError("score failed")

    for kw in ({"start": 1, "hidden": outs[0], "record": [1]}, {"record": [0, 1]}):
        with pytest.raises(FloatingPointError, match="score failed"):
            simulated_pass(model, list(range(30)), MaskedArm(cfg, score=fails), 4, **kw)
        assert len(model.layers) == 2 and all(a is b for a, b in zip(model.layers, originals))


def test_a_model_whose_layers_list_is_a_copy_cannot_be_replayed():
    model = tiny_llama(seed=1)

    class Copying:  # a model whose ``layers`` is not the list its forward pass runs
        def __init__(self, m):
            self.m = m

        @property
        def layers(self):
            return list(self.m.layers)

        def __call__(self, *a, **k):
            return self.m(*a, **k)

    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    with pytest.raises(RuntimeError, match=r"^simulated_pass: the model did not run the layers of model.layers "
                                           r"\(layers below start cannot be replayed, outputs not recorded\)$"):
        simulated_pass(Copying(model), list(range(30)), MaskedArm(cfg), 4, start=1, hidden=mx.zeros((1, 29, 144)))
    with pytest.raises(RuntimeError, match="did not run the layers of model.layers"):
        simulated_pass(Copying(model), list(range(30)), MaskedArm(cfg), 4, record=[1])


def test_budgets_per_layer_equal_caches_of_those_budgets_fed_token_by_token():
    filters = _filters()
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(2).integers(0, 101, 60).tolist()
    windows = ((2, 5, 0), (9, 1, 4))  # each fits its layer's budget
    cfg = KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=24, qfilters_n_sink=2,
                        qfilters_recent=windows)
    budgets = (12, 24)
    caches = [build_cache(replace(cfg, qfilters_budget=b, qfilters_recent=windows[i]), i, filters=filters[i])
              for i, b in enumerate(budgets)]
    want = streaming_nll(model, tokens, caches, 5)
    got = simulated_nll(model, tokens, MaskedArm(cfg, filters=filters, budgets=budgets), 5)
    np.testing.assert_allclose(got, want, atol=2e-4)
    same = simulated_nll(model, tokens, MaskedArm(cfg, filters=filters), 5)  # 24 everywhere
    assert np.abs(np.array(same) - np.array(want)).max() > 1e-3
    assert MaskedArm(cfg, filters=filters).budget(1) == 24


@pytest.mark.parametrize("prefix", [1, 20])
def test_budgets_per_head_of_a_head_budgets_equal_its_head_group_caches_fed_token_by_token(prefix):
    # the simulator's arm of heads=HeadBudgets (what bench/sim_arms.py judges) against the
    # caches KVCacheBuilder builds for it: a HeadGroupsKVCache where a layer has two budgets
    from qfilters_mlx.cache.head_group_build import layer_cache
    from qfilters_mlx.cache.head_groups import HeadGroupsKVCache
    from qfilters_mlx.filters.head_budgets import head_budgets

    filters = _filters()
    model = tiny_llama(seed=1)
    tokens = np.random.default_rng(2).integers(0, 101, 70).tolist()
    cfg = KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=12, qfilters_n_sink=2)
    hb = head_budgets(np.array([[0.1, 0.9, 0.2], [0.3, 0.0, 0.4]]), 12, 2, n_big=1, multiple=3)
    assert hb.budgets == ((7, 36, 7), (7, 7, 7)) and hb.recents == ((3,) * 3,) * 2  # the rule by hand
    caches = [layer_cache(cfg, hb.groups(i), i, filters[i], lambda gc, gf, _l=i: build_cache(gc, _l, filters=gf))
              for i in range(2)]
    assert isinstance(caches[0], HeadGroupsKVCache) and not isinstance(caches[1], HeadGroupsKVCache)
    want = streaming_nll(model, tokens, caches, prefix)
    arm = MaskedArm(cfg, filters=filters, budgets=hb.budgets, recents=hb.recents)
    got = simulated_nll(model, tokens, arm, prefix)
    np.testing.assert_allclose(got, want, atol=2e-4)
    one = simulated_nll(model, tokens, MaskedArm(cfg, filters=filters), prefix)  # 12 everywhere
    assert np.abs(np.array(one) - np.array(want)).max() > 1e-3


def test_budgets_per_layer_are_checked():
    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16, qfilters_n_sink=4)
    for bad in ((16, 4), (16, 2.5), (16, True), (16, "8")):
        with pytest.raises(ValueError, match="budgets: one int > n_sink"):
            MaskedArm(cfg, budgets=bad)
    arm = MaskedArm(cfg, budgets=(8, np.int64(12)))
    assert arm.budget(0) == 8 and arm.budget(1) == 12
    for layer in (2, -1):
        with pytest.raises(ValueError, match="budgets has 2 layers; layer"):
            arm.budget(layer)
    model = tiny_llama(seed=1)
    cfg = replace(cfg, method="l2norm")  # (StreamingLLM's window is budget - n_sink whatever is given)
    with pytest.raises(ValueError, match="^layer 0: n_sink 4 \\+ recent window 8 exceed its budget 8$"):
        simulated_nll(model, list(range(30)), MaskedArm(replace(cfg, qfilters_recent=8), budgets=(8, 16)), 4)
    with pytest.raises(ValueError, match="^layer 1: n_sink 4 \\+ recent window 9 exceed its budget 12$"):
        simulated_nll(model, list(range(30)), MaskedArm(replace(cfg, qfilters_recent=((1, 2, 3), (0, 9, 1))),
                                                        budgets=(16, 12)), 4)
    for wrong in ((16,), (16, 16, 16)):  # one budget per layer of the model, no more, no fewer
        with pytest.raises(ValueError, match=f"^budgets has {len(wrong)} layers, the model 2$"):
            simulated_nll(model, list(range(30)), MaskedArm(cfg, budgets=wrong), 4)


def test_a_layer_called_twice_in_one_pass_is_refused():
    from qfilters_mlx.evaluation.simulate import _OnePass  # the stand-in cache of one layer

    cfg = KVCacheConfig(method="streaming_llm", head_dim=HD, qfilters_budget=16)
    c = _OnePass(0, MaskedArm(cfg), 4)
    k = mx.zeros((1, 3, 20, HD))
    assert c.update_and_fetch(k, k)[0] is k and c.offset == 20 and c.mask.shape == (1, 3, 20, 20)
    with pytest.raises(RuntimeError, match="^simulated_nll: a layer was called twice in one pass$"):
        c.update_and_fetch(k, k)
