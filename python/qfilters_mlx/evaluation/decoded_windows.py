"""Recent windows chosen by the decoded loss itself (``qfilters-mlx calibrate --window-rule decoded``).

The per-head rules of :mod:`qfilters_mlx.filters.windows` score each window by a measure taken on full-cache
states (attention-output error, captured mass) and do not see errors compounding through
the layers while decoding. This rule scores a window by what it does to the model: the
teacher-forced NLL of calibration text with streaming eviction simulated in one forward pass
(:func:`qfilters_mlx.evaluation.simulate.simulated_pass`: per-layer, per-KV-head attention
masks of the kept sets; the same NLLs as decoding token by token with the cache).

Search (greedy, bottom-up, one group of ``group`` consecutive layers at a time): every layer
starts at the library's default window (:func:`qfilters_mlx.config.default_recent`); for
each group, every candidate window ``round(f * (budget - n_sink))``, ``f`` in ``fractions``
(``f = 1``: StreamingLLM in those layers), is given to all KV heads of the group's layers,
the layers below keep what was chosen for them, the layers above their start value; the
candidate with the lowest mean NLL wins (equal NLLs: the window the group has; between other
candidates, the smaller window). A candidate
reruns only the layers from the group up (the hidden state entering the group is recorded
once per choice), so a group costs ``len(candidates)`` partial forward passes.
"""

from __future__ import annotations

import numpy as np

from qfilters_mlx.evaluation.perplexity import PerplexitySizes
from qfilters_mlx.filters.windows import window_grid

DECODED_FRACTIONS = (0.25, 0.75, 1.0)
"""Candidate windows as fractions of ``budget - n_sink``, tried besides the start window."""
DECODED_GROUP = 5
"""Consecutive layers that share one window in the search."""
DECODED_PREFIX = PerplexitySizes.ppl_prefix
"""Tokens of the first call of the simulated decoding (the perplexity protocol's prefix)."""


def min_tokens(budget: int, prefix: int = DECODED_PREFIX) -> int:
    """Fewest calibration tokens whose simulated decoding shows an eviction: the last scored
    query (position ``T - 2``) must come after the first call and see more than ``budget``
    earlier tokens, so ``T >= max(prefix, budget + 1) + 2``."""
    return max(prefix, budget + 1) + 2


def candidate_windows(budget: int, n_sink: int, start: int, fractions=DECODED_FRACTIONS) -> list[int]:
    """``start`` and ``round(f * (budget - n_sink))`` for ``f`` in ``fractions``, ascending, unique.

    Raises:
        ValueError: a fraction outside [0, 1], or ``start`` outside ``[0, budget - n_sink]``.
    """
    span = budget - n_sink
    if any(not 0.0 <= f <= 1.0 for f in fractions) or not 0 <= start <= span:
        raise ValueError(f"fractions must be in [0, 1] and start in [0, {span}] (budget {budget}, "
                         f"n_sink {n_sink}): got {list(fractions)}, {start}")
    return sorted({int(start), *window_grid(budget, n_sink, fractions)})


def search_windows(model, tokens, filters, budget: int, n_sink: int = 4, *, prefix: int = DECODED_PREFIX,
                   fractions=DECODED_FRACTIONS, group: int = DECODED_GROUP, start: int | None = None,
                   progress=None) -> tuple[np.ndarray, dict]:
    """Windows ``[n_layers, n_kv_heads]`` for one budget by the decoded loss (module docstring).

    Args:
        model: an mlx-lm model every layer of which is budgeted and maskable (what
            :func:`~qfilters_mlx.evaluation.simulate.simulated_pass` takes).
        tokens: 1-D calibration token ids (``prefix`` first, the rest scored).
        filters: ``[n_layers, n_kv_heads, D]`` calibrated filters (scores ``+<k, f>``, fixed
            at insertion).
        budget, n_sink: the cache's budget and sinks.
        prefix, fractions, group: first-call tokens, candidate fractions, layers per group.
        start: every layer's window before the search (default
            :func:`~qfilters_mlx.config.default_recent`).
        progress: called with one line per group, or ``None``.

    Returns:
        ``(windows [n_layers, n_kv_heads] int32, trace)``: ``trace["budget"]``, ``"n_sink"``,
        ``"start"`` (the start window), ``"candidates"`` (ascending), ``"start_nll"`` and
        ``"nll"`` (mean NLL of the scored tokens before and after, nats), and per group
        ``trace["groups"]``: ``{"layers": [a, b), "nll": {window: mean NLL}, "chosen": window}``.

    Raises:
        ValueError: ``budget <= n_sink``; ``group < 1``; fewer than ``max(prefix, budget + 1) + 2`` tokens (no scored
            token would see an eviction); filters not ``[len(model.layers), H, D]``; what
            :func:`candidate_windows` and the simulation raise.
    """
    from qfilters_mlx.config import KVCacheConfig, default_recent
    from qfilters_mlx.evaluation.simulate import MaskedArm, simulated_pass

    import mlx.core as mx

    f = mx.array(np.asarray(filters, np.float32))
    n_layers = len(model.layers)
    if f.ndim != 3 or f.shape[0] != n_layers:
        raise ValueError(f"filters must be [{n_layers}, n_kv_heads, head_dim] (one per layer of the model), "
                         f"got shape {f.shape}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if budget <= n_sink or n_sink < 0:
        raise ValueError(f"budget must exceed n_sink >= 0, got budget {budget}, n_sink {n_sink}")
    need = min_tokens(budget, prefix)
    if len(tokens) < need:
        raise ValueError(f"{len(tokens)} calibration tokens show no eviction at budget {budget} with a "
                         f"{prefix}-token first call: need at least max(prefix, budget + 1) + 2 = {need}")
    H, D = f.shape[1], f.shape[2]
    start = default_recent(budget, n_sink) if start is None else int(start)
    cands = candidate_windows(budget, n_sink, start, fractions)
    groups = [(a, min(a + group, n_layers)) for a in range(0, n_layers, group)]
    bounds = [b - 1 for _, b in groups[:-1]]  # layers whose outputs enter the next group

    def run(windows, first, hidden):
        cfg = KVCacheConfig(method="qfilters", head_dim=D, qfilters_budget=budget, qfilters_n_sink=n_sink,
                            qfilters_recent=[[int(w)] * H for w in windows])
        nll, outs = simulated_pass(model, tokens, MaskedArm(cfg, filters=f), prefix, start=first,
                                   hidden=hidden, record=[b for b in bounds if b >= first])
        return float(np.mean(nll)), outs

    windows = [start] * n_layers
    best, outs = run(windows, 0, None)
    trace = {"budget": budget, "n_sink": n_sink, "start": start, "candidates": cands, "start_nll": best,
             "groups": []}
    for a, b in groups:
        hidden = outs[a - 1] if a else None
        tried = {windows[a]: best}
        for w in cands:
            if w in tried:
                continue
            trial = windows[:a] + [w] * (b - a) + windows[b:]
            tried[w], o = run(trial, a, hidden)
            if tried[w] < best:
                best, windows, outs = tried[w], trial, {**outs, **o}
        trace["groups"].append({"layers": [a, b], "nll": {str(k): v for k, v in sorted(tried.items())},
                                "chosen": windows[a]})
        if progress is not None:
            progress(f"  budget {budget}, layers {a}-{b - 1}: window {windows[a]} (mean NLL {best:.4f}; "
                     + ", ".join(f"{k}: {v:.4f}" for k, v in sorted(tried.items())) + ")")
    trace["nll"] = best
    return np.array([[w] * H for w in windows], np.int32), trace


def decoded_summary(windows: np.ndarray, trace: dict) -> dict:
    """What a filters file stores of one budget's search (``recent_summary`` metadata): the rule,
    the mean window, the mean NLL before and after, and the window chosen per group."""
    return {"rule": "decoded", "mean_window": float(np.mean(windows)), "start_nll": trace["start_nll"],
            "nll": trace["nll"], "groups": [g["chosen"] for g in trace["groups"]]}
