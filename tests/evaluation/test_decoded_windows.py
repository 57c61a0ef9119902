"""Windows chosen by the decoded loss: the greedy search written out with whole simulated
passes (no replayed layers) chooses the same windows and NLLs; the replayed passes equal whole
ones; what the search cannot take is refused."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.query_models import tiny_llama
from qfilters_mlx.config import KVCacheConfig, default_recent
from qfilters_mlx.evaluation.simulate import MaskedArm, simulated_nll
from qfilters_mlx.evaluation.decoded_windows import candidate_windows, min_tokens, search_windows

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
    assert candidate_windows(16, 4, 0, fractions=(0.5,)) == [0, 6]  # the start may be either end
    assert candidate_windows(16, 4, 12, fractions=(0.5,)) == [6, 12]
    for budget, n_sink, start, fr in [(16, 4, 13, (0.5,)), (16, 4, -1, (0.5,)), (16, 4, 3, (1.5,)),
                                      (16, 4, 3, (-0.1,))]:
        with pytest.raises(ValueError, match="fractions must be in"):
            candidate_windows(budget, n_sink, start, fr)


def test_search_refuses_what_it_cannot_take():
    model = tiny_llama(seed=1, layers=2)
    tokens = list(range(30))
    with pytest.raises(ValueError, match=r"^filters must be \[2, n_kv_heads, head_dim\] \(one per layer of the "
                                         r"model\), got shape \(3, 3, 16\)$"):
        search_windows(model, tokens, _filters(3), 16, 4)
    with pytest.raises(ValueError, match="filters must be"):
        search_windows(model, tokens, _filters(2)[0], 16, 4)
    with pytest.raises(ValueError, match="^group must be >= 1, got 0$"):
        search_windows(model, tokens, _filters(2), 16, 4, group=0)
    for budget, n_sink in ((4, 4), (3, 4), (16, -1)):
        with pytest.raises(ValueError, match=f"^budget must exceed n_sink >= 0, got budget {budget}, n_sink {n_sink}$"):
            search_windows(model, tokens, _filters(2), budget, n_sink)


def test_a_text_too_short_to_evict_is_refused():
    model = tiny_llama(seed=1, layers=2)
    assert min_tokens(16, 4) == 19 and min_tokens(16, 30) == 32 and min_tokens(64) == 130
    with pytest.raises(ValueError, match=r"^18 calibration tokens show no eviction at budget 16 with a 4-token "
                                         r"first call: need at least max\(prefix, budget \+ 1\) \+ 2 = 19$"):
        search_windows(model, list(range(18)), _filters(2), 16, 4, prefix=4)
    with pytest.raises(ValueError, match="need at least .* = 32$"):
        search_windows(model, list(range(31)), _filters(2), 16, 4, prefix=30)
    # at the fewest tokens one scored query sees an eviction: the windows differ in NLL
    _, trace = search_windows(model, np.random.default_rng(0).integers(0, 101, 19).tolist(), _filters(2), 16, 4,
                              prefix=4)
    assert len(set(trace["groups"][0]["nll"].values())) > 1


def test_default_sinks_and_float64_filters():
    model = tiny_llama(seed=1, layers=2)
    tokens = np.random.default_rng(5).integers(0, 101, 40).tolist()
    f = _filters(2)
    w4, t4 = search_windows(model, tokens, f, 16, 4, prefix=8)
    w, t = search_windows(model, tokens, f, 16, prefix=8)  # n_sink defaults to 4
    np.testing.assert_array_equal(w, w4)
    assert t == t4 and t["n_sink"] == 4 and t["budget"] == 16 and t["start"] == default_recent(16, 4)
    w64, t64 = search_windows(model, tokens, f.astype(np.float64), 16, 4, prefix=8)  # scored in float32
    np.testing.assert_array_equal(w64, w4)
    assert t64 == t4


class _FakeLoss:
    """Stands in for ``simulated_pass``: the mean NLL of a window table is ``sum_l table[l][w_l]``;
    a layer's recorded output is the windows of the layers up to it, so the hidden state a pass
    starts from tells which windows the layers below had."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, model, tokens, arm, prefix, *, start=0, hidden=None, record=()):
        c = arm.config  # the cache's config: the filter's method, head_dim, budget and sinks; float32 filters
        assert (c.method, c.head_dim, c.qfilters_budget, c.qfilters_n_sink) == ("qfilters", HD, 20, 4)
        assert arm.filters.dtype == mx.float32 and arm.score is None and arm.budgets is None
        windows = [arm.config.layer_recent(i)[0] for i in range(len(self.table))]
        assert all(len(set(arm.config.layer_recent(i))) == 1 for i in range(len(self.table)))
        assert hidden == (None if start == 0 else tuple(windows[:start])), "replayed another configuration"
        self.calls.append((start, tuple(windows), tuple(record)))
        loss = sum(self.table[i][w] for i, w in enumerate(windows))
        return [loss, loss], {r: tuple(windows[:r + 1]) for r in record}


def test_the_greedy_rule_on_a_known_loss(monkeypatch):
    import qfilters_mlx.evaluation.simulate as simulate

    # budget 20, n_sink 4: start 10, candidates 4 / 10 / 12 / 16
    table = [{4: 1.0, 10: 1.0, 12: 0.5, 16: 0.5},  # layer 0: 12 and 16 tie below the start: 12 (first)
             {4: 0.2, 10: 0.2, 12: 0.3, 16: 0.1},  # layer 1: 4 ties the start (kept out), 16 wins
             {4: 0.0, 10: 0.0, 12: 0.0, 16: 0.0},  # layer 2: all tie: the start stays
             {4: 0.9, 10: 0.5, 12: 0.4, 16: 0.7}]  # layer 3: 12
    fake = _FakeLoss(table)
    monkeypatch.setattr(simulate, "simulated_pass", fake)
    lines = []
    model = tiny_llama(seed=1, layers=4)
    w, trace = search_windows(model, list(range(30)), _filters(4).astype(np.float64), 20, 4, prefix=3, group=1,
                              progress=lines.append)
    np.testing.assert_array_equal(w[:, 0], [12, 16, 10, 12])
    assert trace["start_nll"] == pytest.approx(1.0 + 0.2 + 0.0 + 0.5)
    assert trace["nll"] == pytest.approx(0.5 + 0.1 + 0.0 + 0.4)
    assert [g["chosen"] for g in trace["groups"]] == [12, 16, 10, 12]
    assert fake.calls[0] == (0, (10, 10, 10, 10), (0, 1, 2))  # the start, every output a group starts from
    assert [c[0] for c in fake.calls[1:]] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3  # one pass per candidate
    assert fake.calls[4] == (1, (12, 4, 10, 10), (1, 2))  # layer 0 chosen, layer 1 tried, outputs from 1 up
    assert fake.calls[-1] == (3, (12, 16, 10, 16), ())  # the last group: nothing above it to replay
    assert lines[0] == "  budget 20, layers 0-0: window 12 (mean NLL 1.2000; 4: 1.7000, 10: 1.7000, 12: 1.2000, " \
                       "16: 1.2000)"
    assert lines[2].startswith("  budget 20, layers 2-2: window 10 (mean NLL 1.1000; 4: 1.1000, 10: 1.1000, ")
    fake.calls.clear()  # float16 filters (an mx.array) are scored in float32 too
    w16, _ = search_windows(model, list(range(30)), mx.array(_filters(4)).astype(mx.float16), 20, 4, prefix=3, group=1)
    np.testing.assert_array_equal(w16, w)
    # groups of 3 layers: one window for layers 0-2, then layer 3
    fake.calls.clear()
    w, trace = search_windows(model, list(range(30)), _filters(4), 20, 4, prefix=3, group=3, progress=lines.append)
    np.testing.assert_array_equal(w[:, 0], [16, 16, 16, 12])  # layers 0-2: 16 (0.6) < 12 (0.8) < start (1.2)
    assert [g["layers"] for g in trace["groups"]] == [[0, 3], [3, 4]]
    assert lines[-2].startswith("  budget 20, layers 0-2: window 16 ") and lines[-1].startswith(
        "  budget 20, layers 3-3: window 12 ")
