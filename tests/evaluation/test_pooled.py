"""Pooled gap ratios over segments, their segments-then-blocks bootstrap, and the
memory-equivalent budget, against the formulas written out in numpy."""

import math

import numpy as np
import pytest

from qfilters_mlx.evaluation.bootstrap import gap_ratio
from qfilters_mlx.evaluation.pooled import equivalent_budget, pooled_gap_ratio, pooled_ratio_bootstrap


def series(seed, n, T, base):
    rng = np.random.default_rng(seed)
    return [base + 0.3 * rng.standard_normal(T) for _ in range(n)]


def test_pooled_ratio_is_the_summed_gaps_and_one_segment_s_ratio_alone():
    full, sl, arm = series(0, 3, 50, 2.0), series(1, 3, 50, 2.4), series(2, 3, 50, 2.2)
    ppl = lambda x: math.exp(float(np.mean(x)))  # noqa: E731
    want = (sum(ppl(a) - ppl(f) for a, f in zip(arm, full))
            / sum(ppl(s) - ppl(f) for s, f in zip(sl, full)))
    assert pooled_gap_ratio(arm, sl, full) == pytest.approx(want, rel=1e-12)
    assert pooled_gap_ratio(arm[:1], sl[:1], full[:1]) == pytest.approx(gap_ratio(arm[0], sl[0], full[0]), rel=1e-12)
    with pytest.raises(ValueError, match="one NLL sequence per segment"):
        pooled_gap_ratio(arm[:2], sl, full)
    with pytest.raises(ValueError, match=r"segment 1: the series have \[50, 49, 50\] tokens"):
        pooled_gap_ratio(arm, [sl[0], sl[1][:-1], sl[2]], full)


def reference_bootstrap(cells, full, block, n_boot, seed):
    """The two-stage resampling written out: per resample, n segments with replacement, then in
    each ceil(T / block) block starts; the same starts for every series of that draw."""
    keys = sorted(cells)  # one arm besides streaming_llm
    rng = np.random.default_rng(seed)
    n = len(full)
    out = {k: [] for k in keys}
    for _ in range(n_boot):
        drawn = []
        for i in rng.integers(0, n, size=n):
            T = len(full[i])
            k = -(-T // block)
            starts = rng.integers(0, T - block + 1, size=k)
            idx = np.concatenate([np.arange(s, s + block) for s in starts])
            drawn.append((i, idx))
        mean = lambda x, i, idx: math.exp(float(np.mean(np.asarray(x[i])[idx])))  # noqa: E731
        gaps = {key: sum(mean(cells[key], i, idx) - mean(full, i, idx) for i, idx in drawn) for key in keys}
        for key in keys:
            out[key].append(gaps[key] / gaps[("streaming_llm", key[1])])
        arm = [k for k in keys if k[0] != "streaming_llm"]
        out.setdefault("all", []).append(sum(gaps[k] for k in arm) / sum(gaps[("streaming_llm", k[1])] for k in arm))
    return out


def test_the_bootstrap_equals_the_resampling_written_out():
    full = series(0, 3, 40, 2.0)
    cells = {("streaming_llm", 8): series(1, 3, 40, 2.5), ("x", 8): series(2, 3, 40, 2.3),
             ("streaming_llm", 16): series(3, 3, 40, 2.3), ("x", 16): series(4, 3, 40, 2.2)}
    got = pooled_ratio_bootstrap(cells, full, block=8, n_boot=300, seed=4)
    ref = reference_bootstrap(cells, full, 8, 300, 4)
    assert sorted(got) == ["x"] and sorted(got["x"], key=str) == [16, 8, "all"]
    for b in (8, 16):
        r, lo, hi = got["x"][b]
        assert r == pytest.approx(pooled_gap_ratio(cells[("x", b)], cells[("streaming_llm", b)], full), rel=1e-12)
        want = np.quantile(ref[("x", b)], [0.025, 0.975])
        assert (lo, hi) == pytest.approx(tuple(want), rel=1e-9)
    assert got["x"]["all"][1:] == pytest.approx(tuple(np.quantile(ref["all"], [0.025, 0.975])), rel=1e-9)
    ppl = lambda x: math.exp(float(np.mean(x)))  # noqa: E731
    gap = lambda key: sum(ppl(a) - ppl(f) for a, f in zip(cells[key], full))  # noqa: E731
    want = (gap(("x", 8)) + gap(("x", 16))) / (gap(("streaming_llm", 8)) + gap(("streaming_llm", 16)))
    assert got["x"]["all"][0] == pytest.approx(want, rel=1e-12)


def test_between_segment_spread_alone_sets_the_interval():
    # constant NLLs inside each segment: resampling blocks changes nothing, only which segments
    # are drawn; with two segments the extreme draws (one segment twice) have probability 1/4
    full = [np.full(32, 2.0), np.full(32, 2.0)]
    sl = [np.full(32, 2.5), np.full(32, 2.5)]
    arm = [np.full(32, 2.1), np.full(32, 2.4)]
    got = pooled_ratio_bootstrap({("streaming_llm", 4): sl, ("a", 4): arm}, full, block=4, n_boot=400)
    r0 = gap_ratio(arm[0], sl[0], full[0])
    r1 = gap_ratio(arm[1], sl[1], full[1])
    assert got["a"][4][1] == pytest.approx(r0, rel=1e-12) and got["a"][4][2] == pytest.approx(r1, rel=1e-12)
    # one segment, one block covering it: every resample is the segment itself
    one = pooled_ratio_bootstrap({("streaming_llm", 4): series(1, 1, 20, 2.5), ("a", 4): series(2, 1, 20, 2.2)},
                                 series(0, 1, 20, 2.0), block=20, n_boot=50)
    assert one["a"][4][0] == pytest.approx(one["a"][4][1], rel=1e-12) == pytest.approx(one["a"][4][2], rel=1e-12)


def test_the_bootstrap_refuses_what_it_cannot_pair():
    full = series(0, 2, 10, 2.0)
    with pytest.raises(ValueError, match="^budget 8 of 'a' has no streaming_llm cell$"):
        pooled_ratio_bootstrap({("a", 8): series(1, 2, 10, 2.2)}, full)
    with pytest.raises(ValueError, match=r"^block must be in \[1, 10\], got 11$"):
        pooled_ratio_bootstrap({("streaming_llm", 8): series(1, 2, 10, 2.2)}, full, block=11)


def test_the_equivalent_budget_interpolates_log_perplexity_in_log_budget():
    budgets = [64, 128, 256, 512]
    ref = [30 * b ** -0.2 for b in budgets]  # a power law: a straight line in log-log
    for target in (100, 64, 300, 512):
        got, out = equivalent_budget(budgets, ref, 30 * target ** -0.2)
        assert got == pytest.approx(target, rel=1e-9) and out is False
    got, out = equivalent_budget(budgets, ref, 30 * 1024 ** -0.2)  # beyond 512: extrapolated
    assert got == pytest.approx(1024, rel=1e-9) and out is True
    got, out = equivalent_budget(budgets, ref, 30 * 32 ** -0.2)
    assert got == pytest.approx(32, rel=1e-9) and out is True
    # piecewise: between 128 and 256 only those two points count
    kinked = [20.0, 16.0, 12.0, 11.5]
    got, _ = equivalent_budget(budgets, kinked, 14.0)
    u = (math.log(14) - math.log(16)) / (math.log(12) - math.log(16))
    assert got == pytest.approx(math.exp(math.log(128) + u * math.log(2)), rel=1e-12)
    with pytest.raises(ValueError, match="must decrease with the budget"):
        equivalent_budget(budgets, [20, 16, 16, 11], 14)
    with pytest.raises(ValueError, match="two or more increasing budgets"):
        equivalent_budget([64], [20], 14)
