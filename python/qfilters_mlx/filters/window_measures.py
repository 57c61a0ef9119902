"""What a candidate recent window costs one head, measured on calibration keys, queries
and values (numpy, float64): the simulated kept set and two measures of it.

The simulated cache at query position ``t`` (eviction has happened, ``t > budget``)
holds the ``n_sink`` sinks, the last ``r`` positions before ``t``, the
``budget - n_sink - r`` other positions with the highest score (exactly
:func:`qfilters_mlx.backends.reference.select_keep` up to ties, since scores are fixed
at insertion and an evicted position never returns), and query ``t`` attends to that
set plus itself.

- :func:`output_error` (the rule :mod:`qfilters_mlx.filters.windows` uses): the mean
  squared distance between the head's attention output over the kept set
  (``softmax`` renormalised over it) and over the whole prefix,
  ``|| sum_{s in S} p_s v_s / sum_{s in S} p_s - sum_s p_s v_s ||^2``, averaged over
  the query heads of the GQA group and the sampled positions. It is what the next
  layer receives, so it sees what attention mass alone does not: positions with large
  attention and small values (attention sinks, punctuation) move the output little
  when kept, and a lot when their mass is renormalised away.
- :func:`captured_mass`: the attention mass the kept set captures under full
  attention (the first rule; kept for comparison: on SmolLM2 it ranked filter-heavy
  windows far above StreamingLLM, 0.96 vs 0.85 at budget 512, while StreamingLLM's
  perplexity was better).
"""

from __future__ import annotations

import numpy as np

__all__ = ["captured_mass", "kept_mask", "measure_windows", "output_error", "sample_times"]


def sample_times(T: int, budget: int, n: int) -> np.ndarray:
    """Up to ``n`` query positions, evenly spread over ``[budget + 1, T)`` (eviction has
    happened before each); empty when ``T <= budget + 1``."""
    if T <= budget + 1:
        return np.zeros(0, dtype=int)
    return np.unique(np.linspace(budget + 1, T - 1, n).round().astype(int))


def kept_mask(scores: np.ndarray, t: int, budget: int, n_sink: int, r: int) -> np.ndarray:
    """``[H, t + 1]`` bool: the positions a head's cache holds when query ``t`` attends
    (sinks, the last ``r`` before ``t``, the top ``budget - n_sink - r`` scores of the
    rest, and ``t`` itself). ``scores``: ``[H, >= t]``, higher kept."""
    H = scores.shape[0]
    mask = np.zeros((H, t + 1), dtype=bool)
    mask[:, :n_sink] = True
    hi = max(t - r, n_sink)
    mask[:, hi:] = True
    m = min(budget - n_sink - r, hi - n_sink)
    if m > 0:
        top = np.argpartition(-scores[:, n_sink:hi], m - 1, axis=-1)[:, :m] + n_sink
        np.put_along_axis(mask, top, True, -1)
    return mask


def _probs(q: np.ndarray, k: np.ndarray, t: int) -> np.ndarray:
    """``[H, G, t + 1]`` full-attention weights of query ``t`` (scale ``1/sqrt(D)``)."""
    logits = np.einsum("hgd,hsd->hgs", q[:, :, t], k[:, : t + 1]) / np.sqrt(q.shape[-1])
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


def measure_windows(keys, queries, scores, budget: int, n_sink: int, grid, times,
                    values=None) -> dict[str, np.ndarray]:
    """Both measures of every candidate window and head, from one pass over ``times``
    (the attention weights and the kept set of each ``(t, r)`` are computed once).

    Args:
        keys: ``[H, T, D]`` post-RoPE keys of one layer (one sequence).
        queries: ``[H, G, T, D]`` post-RoPE queries, grouped by KV head.
        scores: ``[H, T]`` eviction scores (higher kept).
        budget, n_sink: the cache's.
        grid: candidate windows (each ``<= budget - n_sink``).
        times: query positions ``t`` (each ``> budget``).
        values: ``[H, T, D_v]`` values of the same layer, or ``None`` (no output error).

    Returns:
        ``{"mass": [len(grid), H]}`` (plus ``"output"`` when ``values`` are given),
        float64, mean over ``times`` and the group's query heads: the captured attention
        mass, and ``|| o_kept - o_full ||^2`` in units of the values squared.
    """
    k, q, s = (np.asarray(x, np.float64) for x in (keys, queries, scores))
    v = None if values is None else np.asarray(values, np.float64)
    out = {name: np.zeros((len(grid), k.shape[0])) for name in (("mass",) if v is None else ("mass", "output"))}
    for t in times:
        p = _probs(q, k, t)  # [H, G, t+1]
        if v is not None:
            vt = v[:, : t + 1]
            full = np.einsum("hgs,hsd->hgd", p, vt)
        for i, r in enumerate(grid):
            pk = p * kept_mask(s, t, budget, n_sink, r)[:, None]
            kept_mass = pk.sum(-1)  # [H, G]
            out["mass"][i] += kept_mass.mean(-1)  # mass is linear in p
            if v is not None:
                kept = np.einsum("hgs,hsd->hgd", pk, vt) / kept_mass[..., None]
                out["output"][i] += ((kept - full) ** 2).sum(-1).mean(-1)
    return {name: m / max(len(times), 1) for name, m in out.items()}


def captured_mass(keys, queries, scores, budget: int, n_sink: int, grid, times) -> np.ndarray:
    """The ``"mass"`` of :func:`measure_windows`: ``[len(grid), H]`` mean captured attention mass."""
    return measure_windows(keys, queries, scores, budget, n_sink, grid, times)["mass"]


def output_error(keys, queries, values, scores, budget: int, n_sink: int, grid, times) -> np.ndarray:
    """The ``"output"`` of :func:`measure_windows`: ``[len(grid), H]`` mean squared
    attention-output error (``values``: ``[H, T, D_v]``)."""
    return measure_windows(keys, queries, scores, budget, n_sink, grid, times, values=values)["output"]
