"""Bootstrap confidence interval of a perplexity-gap ratio (numpy).

For an arm X, StreamingLLM S and the full cache F scored on the same tokens, the
statistic is ``(ppl(X) - ppl(F)) / (ppl(S) - ppl(F))`` with ``ppl = exp(mean NLL)``.
Tokens of one text are not independent, so the resampling is a paired **moving-block
bootstrap** (Kuensch 1989): contiguous blocks of ``block`` tokens, drawn with
replacement, the same blocks for the three series. The interval is the percentile
interval of ``n_boot`` resamples (seeded, reproducible).
"""

from __future__ import annotations

import numpy as np

__all__ = ["gap_ratio", "gap_ratio_ci"]


def gap_ratio(nll_arm, nll_ref, nll_full) -> float:
    """``(exp(mean arm) - exp(mean full)) / (exp(mean ref) - exp(mean full))``."""
    f = np.exp(np.mean(nll_full))
    with np.errstate(divide="ignore", invalid="ignore"):
        return float((np.exp(np.mean(nll_arm)) - f) / (np.exp(np.mean(nll_ref)) - f))


def gap_ratio_ci(nll_arm, nll_ref, nll_full, *, block: int = 64, n_boot: int = 2000,
                 level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``(ratio, low, high)``: the gap ratio and its bootstrap percentile interval.

    Args:
        nll_arm, nll_ref, nll_full: per-token NLLs (nats) of the same ``n`` tokens.
        block: block length in tokens (``1 <= block <= n``).
        n_boot: resamples; level: interval coverage; seed: RNG seed.

    Raises:
        ValueError: lengths differ, or ``block`` is outside ``[1, n]``.
    """
    if len({len(v) for v in (nll_arm, nll_ref, nll_full)}) != 1:
        raise ValueError("the three NLL series must have the same length")
    x = np.stack([np.asarray(v, np.float64) for v in (nll_arm, nll_ref, nll_full)])
    n = x.shape[1]
    if not 1 <= block <= n:
        raise ValueError(f"block must be in [1, {n}], got {block}")
    csum = np.concatenate([np.zeros((3, 1)), np.cumsum(x, axis=1)], axis=1)
    starts = np.arange(n - block + 1)
    block_sums = csum[:, starts + block] - csum[:, starts]  # [3, n_blocks]
    k = int(np.ceil(n / block))
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(starts), size=(n_boot, k))
    means = block_sums[:, pick].sum(-1) / (k * block)  # [3, n_boot]
    ppl = np.exp(means)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (ppl[0] - ppl[2]) / (ppl[1] - ppl[2])
    ratios = ratios[np.isfinite(ratios)]
    a = (1 - level) / 2
    low, high = np.quantile(ratios, [a, 1 - a]) if len(ratios) else (np.nan, np.nan)
    return gap_ratio(nll_arm, nll_ref, nll_full), float(low), float(high)
