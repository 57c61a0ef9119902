"""Gap ratios pooled over several text segments, with a segments-then-blocks bootstrap, and the
memory-equivalence of a budget (numpy).

For one budget, an arm X, StreamingLLM S and the full cache F scored on the same tokens of
segments ``i = 1..n``, the pooled gap ratio is

    ``sum_i (ppl_i(X) - ppl_i(F)) / sum_i (ppl_i(S) - ppl_i(F))``,  ``ppl_i = exp(mean NLL of segment i)``:

the perplexity points X loses to the full cache over those S loses, all segments together (one
segment's ratio, :func:`qfilters_mlx.evaluation.bootstrap.gap_ratio`, when ``n = 1``). Its
interval comes from a two-stage bootstrap (Davison and Hinkley 1997, section 3.8, resampling at
both stages): draw ``n`` segments with replacement, then inside each drawn segment ``ceil(T /
block)`` moving blocks of ``block`` tokens (Kuensch 1989), the same blocks for every series of
that segment (arms and budgets are paired); percentile interval of ``n_boot`` resamples.

The memory-equivalence of budget ``B``: the StreamingLLM budget ``B'`` whose perplexity equals
the arm's at ``B``, by linear interpolation of ``log ppl`` against ``log B`` between the
measured budgets (extrapolated from the two nearest budgets when outside them, and said).
"""

from __future__ import annotations

import numpy as np

__all__ = ["equivalent_budget", "pooled_gap_ratio", "pooled_ratio_bootstrap"]


def _ppl(means) -> np.ndarray:
    return np.exp(np.asarray(means, np.float64))


def pooled_gap_ratio(arm, ref, full) -> float:
    """The pooled gap ratio of per-segment NLL series.

    Args:
        arm, ref, full: ``n`` per-token NLL sequences (nats) each, segment ``i`` of the three
            over the same tokens.

    Raises:
        ValueError: not ``n >= 1`` segments in each, or a segment's three lengths differ.
    """
    _check(arm, ref, full)
    f = _ppl([np.mean(x) for x in full])
    a = _ppl([np.mean(x) for x in arm]) - f
    r = _ppl([np.mean(x) for x in ref]) - f
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(a.sum() / r.sum())


def _check(*series) -> None:
    n = {len(s) for s in series}
    if len(n) != 1 or n == {0}:
        raise ValueError(f"one NLL sequence per segment in each series, got {[len(s) for s in series]}")
    for i, seg in enumerate(zip(*series)):
        if len({len(x) for x in seg}) != 1:
            raise ValueError(f"segment {i}: the series have {[len(x) for x in seg]} tokens")


def pooled_ratio_bootstrap(cells: dict, full: list, *, block: int = 64, n_boot: int = 2000, level: float = 0.95,
                           seed: int = 0) -> dict:
    """Pooled gap ratios of several (arm, budget) cells, of all budgets of an arm, and two-stage
    bootstrap percentile intervals, every cell on the same resamples.

    Args:
        cells: ``{(arm, budget): [n per-segment NLL sequences]}``; the reference is the arm named
            ``"streaming_llm"`` at each budget (required for every budget of another arm).
        full: ``n`` per-segment NLL sequences of the full cache.
        block: moving-block length in tokens (``1 <= block <=`` the shortest segment).
        n_boot, level, seed: resamples, interval coverage, RNG seed.

    Returns:
        ``{arm: {budget: (ratio, low, high), "all": (ratio, low, high)}}`` for every arm but
        StreamingLLM; ``"all"`` pools every budget of the arm too (its gaps summed over segments
        and budgets, over StreamingLLM's).

    Raises:
        ValueError: a budget without StreamingLLM, segments of different lengths across series,
            ``block`` out of range.
    """
    keys = sorted(cells, key=lambda k: (k[0], k[1]))
    arms = sorted({a for a, _ in keys if a != "streaming_llm"})
    for a, b in keys:
        if ("streaming_llm", b) not in cells:
            raise ValueError(f"budget {b} of {a!r} has no streaming_llm cell")
        _check(cells[(a, b)], full)
    n = len(full)
    lengths = [len(x) for x in full]
    if not 1 <= block <= min(lengths):
        raise ValueError(f"block must be in [1, {min(lengths)}], got {block}")
    series = [full] + [cells[k] for k in keys]  # series 0: the full cache
    # per segment: [n_series, T_i + 1] cumulative sums, block sums [n_series, n_blocks_i]
    block_sums = []
    for i in range(n):
        x = np.stack([np.asarray(s[i], np.float64) for s in series])
        c = np.concatenate([np.zeros((len(series), 1)), np.cumsum(x, axis=1)], axis=1)
        starts = np.arange(lengths[i] - block + 1)
        block_sums.append(c[:, starts + block] - c[:, starts])
    rng = np.random.default_rng(seed)
    means = np.empty((n_boot, n, len(series)))  # resample r, drawn segment slot m, series
    for r in range(n_boot):
        for m, i in enumerate(rng.integers(0, n, size=n)):
            k = int(np.ceil(lengths[i] / block))
            pick = rng.integers(0, block_sums[i].shape[1], size=k)
            means[r, m] = block_sums[i][:, pick].sum(-1) / (k * block)
    point = np.array([[np.mean(s[i]) for s in series] for i in range(n)])[None]  # [1, n, n_series]

    def gaps(m):  # [R, n, n_series] -> {(arm, budget): [R]}, summed over the drawn segments
        g = np.exp(m) - np.exp(m[..., :1])
        return {k: g[..., j + 1].sum(-1) for j, k in enumerate(keys)}

    def ratio(g, arm, budgets):
        with np.errstate(divide="ignore", invalid="ignore"):
            return (sum(g[(arm, b)] for b in budgets) / sum(g[("streaming_llm", b)] for b in budgets))

    at, boot = gaps(point), gaps(means)
    a = (1 - level) / 2
    out = {}
    for arm in arms:
        budgets = sorted(b for x, b in keys if x == arm)
        row = {}
        for b in budgets + ["all"]:
            bs = budgets if b == "all" else [b]
            lo, hi = np.quantile(ratio(boot, arm, bs), [a, 1 - a])
            row[b] = (float(ratio(at, arm, bs)[0]), float(lo), float(hi))
        out[arm] = row
    return out


def equivalent_budget(budgets, ref_ppl, ppl: float) -> tuple[float, bool]:
    """``(B', extrapolated)``: the budget at which the reference (StreamingLLM) reaches
    perplexity ``ppl``, by linear interpolation of ``log ppl`` in ``log budget``.

    Args:
        budgets: increasing budgets (tokens), at least two.
        ref_ppl: the reference's perplexity at each budget, decreasing.
        ppl: the perplexity to match.

    Returns:
        ``B'`` and whether it lies outside ``[budgets[0], budgets[-1]]`` (then extrapolated from
        the two nearest budgets' line).

    Raises:
        ValueError: fewer than two budgets, budgets not increasing, or ``ref_ppl`` not strictly
            decreasing (no single budget would match).
    """
    x = np.log(np.asarray(budgets, np.float64))
    y = np.log(np.asarray(ref_ppl, np.float64))
    if len(x) < 2 or len(x) != len(y) or not (np.diff(x) > 0).all():
        raise ValueError(f"need two or more increasing budgets with one perplexity each, got {budgets}, {ref_ppl}")
    if not (np.diff(y) < 0).all():
        raise ValueError(f"the reference's perplexity must decrease with the budget, got {list(ref_ppl)}")
    t = np.log(ppl)
    # the segment [i, i + 1] whose perplexities bracket t (the end ones when outside)
    i = int(np.clip(np.searchsorted(-y, -t) - 1, 0, len(x) - 2))
    u = (t - y[i]) / (y[i + 1] - y[i])
    return float(np.exp(x[i] + u * (x[i + 1] - x[i]))), bool(t > y[0] or t < y[-1])
