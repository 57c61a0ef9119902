"""Windows chosen by the decoded loss: the greedy search written out with whole simulated
passes (no replayed layers) chooses the same windows and NLLs; the replayed passes equal whole
ones; what the search cannot take is refused."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.query_models import tiny_llama
from qfilters_mlx.config import KVCacheConfig, default_recent
from qfilters_mlx.evaluation.simulate import MaskedArm, simulated_nll
from qfilters_mlx.filters.decoded_windows import candidate_windows, search_windows

HD = 16  # tiny_llama: hidden 144 / 9 query heads, 3 KV heads


def _filters(layers, seed=3):
    f = np.random.default_rng(seed).standard_normal((layers, 3, HD)).astype(np.float32)
    return f / np.linalg.norm(f, axis=-1, keepdims=True)


def _mean_nll(model, tokens, filters, budget, n_sink, windows, prefix):
    cfg = KVCacheConfig(method="qfilters", head_dim=HD, qfilters_budget=budget, qfilters_n_sink=n_sink,
                        qfilters_recent=[[w] * 3 for w in windows])
    return float(np.mean(simulated_nll(model, tokens, MaskedArm(cfg, filters=mx.array(filters)), prefix)))


def _greedy_written_out(model, tokens, filters, budget, n_sink, prefix, cands, group, start):
    """The search with a whole simulated pass per candidate."""
    n = len(model.layers)
    windows = [start] * n
    best = _mean_nll(model, tokens, filters, budget, n_sink, windows, prefix)
    chosen = []
    for a in range(0, n, group):
        b = min(a + group, n)
        for w in cands:
            trial = windows[:a] + [w] * (b - a) + windows[b:]
            m = _mean_nll(model, tokens, filters, budget, n_sink, trial, prefix)
            if m < best:
                best, windows = m, trial
        chosen.append(windows[a])
    return windows, best, chosen


@pytest.mark.parametrize("layers,group,budget,n_sink,prefix", [
    (4, 1, 16, 4, 10), (4, 3, 12, 2, 1), (3, 3, 16, 0, 20), (5, 2, 10, 1, 6),
])
def test_search_equals_the_greedy_rule_with_whole_passes(layers, group, budget, n_sink, prefix):
    model = tiny_llama(seed=1, layers=layers)
    tokens = np.random.default_rng(layers + group).integers(0, 101, 60).tolist()
    f = _filters(layers)
    start = default_recent(budget, n_sink)
    cands = candidate_windows(budget, n_sink, start)
    want, want_nll, chosen = _greedy_written_out(model, tokens, f, budget, n_sink, prefix, cands, group, start)
    got, trace = search_windows(model, tokens, f, budget, n_sink, prefix=prefix, group=group)
    assert got.dtype == np.int32 and got.shape == (layers, 3)
    np.testing.assert_array_equal(got, np.array([[w] * 3 for w in want]))
    assert trace["nll"] == pytest.approx(want_nll, abs=1e-6)
    assert trace["start_nll"] == pytest.approx(
        _mean_nll(model, tokens, f, budget, n_sink, [start] * layers, prefix), abs=1e-6)
    assert [g["chosen"] for g in trace["groups"]] == chosen
    assert [g["layers"] for g in trace["groups"]] == [[a, min(a + group, layers)] for a in range(0, layers, group)]
    assert trace["candidates"] == cands
    for g in trace["groups"]:  # every candidate was tried, the chosen one has the least NLL
        assert sorted(int(k) for k in g["nll"]) == cands
        assert g["nll"][str(g["chosen"])] == min(g["nll"].values())


def test_search_moves_off_the_start_only_for_a_lower_nll():
    model = tiny_llama(seed=1, layers=2)
    tokens = np.random.default_rng(0).integers(0, 101, 50).tolist()
    f = _filters(2)
    # one candidate only: the start itself: nothing changes
    w, trace = search_windows(model, tokens, f, 16, 4, prefix=8, fractions=(0.5,), start=6)
    np.testing.assert_array_equal(w, np.full((2, 3), 6))
    assert trace["nll"] == trace["start_nll"]
    assert trace["candidates"] == [6]


def test_candidate_windows():
    assert candidate_windows(64, 4, 32) == [15, 32, 45, 60]  # round(f * 60) for 1/4, 3/4, 1; and 32
    assert candidate_windows(16, 4, 3, fractions=(0.0, 0.25, 1.0)) == [0, 3, 12]
    for budget, n_sink, start, fr in [(16, 4, 13, (0.5,)), (16, 4, -1, (0.5,)), (16, 4, 3, (1.5,)),
                                      (16, 4, 3, (-0.1,))]:
        with pytest.raises(ValueError, match="fractions must be in"):
            candidate_windows(budget, n_sink, start, fr)


def test_search_refuses_what_it_cannot_take():
    model = tiny_llama(seed=1, layers=2)
    tokens = list(range(30))
    with pytest.raises(ValueError, match=r"filters must be \[2, n_kv_heads, head_dim\]"):
        search_windows(model, tokens, _filters(3), 16, 4)
    with pytest.raises(ValueError, match="filters must be"):
        search_windows(model, tokens, _filters(2)[0], 16, 4)
    with pytest.raises(ValueError, match="group must be >= 1"):
        search_windows(model, tokens, _filters(2), 16, 4, group=0)


def test_a_text_too_short_to_evict_is_refused():
    model = tiny_llama(seed=1, layers=2)
    with pytest.raises(ValueError, match="17 calibration tokens evict nothing at budget 16"):
        search_windows(model, list(range(17)), _filters(2), 16, 4, prefix=4)
    search_windows(model, list(range(18)), _filters(2), 16, 4, prefix=4)  # one eviction: searched
