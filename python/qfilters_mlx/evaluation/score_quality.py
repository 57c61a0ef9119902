"""Score quality: does a method's score of a cached token predict the attention it receives?

Per KV head, the Spearman rank correlation (``scipy.stats.spearmanr``) between
each method's score of the cached tokens (sinks excluded) and the attention
those tokens receive from the next ``window`` queries (:func:`received_attention`,
float64 numpy softmax, averaged over the GQA group). The scores come from the
same functions the cache uses (:func:`qfilters_mlx.cache.kv_cache.insertion_scores`,
:mod:`qfilters_mlx.backends.reference`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

__all__ = ["method_scores", "received_attention", "score_quality", "spearman"]


def spearman(a, b) -> float:
    """Spearman rank correlation of two 1-D samples (``scipy.stats.spearmanr``);
    NaN when either is constant."""
    from scipy.stats import spearmanr

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def received_attention(queries: np.ndarray, keys: np.ndarray, cached: int, window: int) -> np.ndarray:
    """Attention that each of the first ``cached`` tokens receives from the next ``window`` queries.

    Args:
        queries: ``[Hq, T, D]`` post-RoPE queries of one layer (one sequence).
        keys: ``[Hkv, T, D]`` post-RoPE keys.
        cached: number of cached tokens (positions ``0 .. cached-1``).
        window: queries at positions ``cached .. cached+window-1``; each
            attends causally to every earlier position and itself.

    Returns:
        ``[Hkv, cached]``: softmax weight on each cached token, averaged over
        the ``window`` queries and over the query heads of each GQA group.
    """
    Hq, T, D = queries.shape
    Hkv = keys.shape[0]
    if not 0 < cached and cached + window <= T:
        raise ValueError(f"need 0 < cached and cached + window <= T, got {cached}, {window}, {T}")
    g = Hq // Hkv
    q = queries[:, cached : cached + window].astype(np.float64)  # [Hq, W, D]
    k = np.repeat(keys[:, : cached + window].astype(np.float64), g, axis=0)  # [Hq, S, D]
    logits = q @ k.transpose(0, 2, 1) / math.sqrt(D)  # [Hq, W, S]
    pos = np.arange(cached + window)
    causal = pos[None, :] <= (cached + np.arange(window))[:, None]
    logits = np.where(causal[None], logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(axis=-1, keepdims=True)
    mass = w[:, :, :cached].mean(axis=1)  # [Hq, cached]
    return mass.reshape(Hkv, g, cached).mean(axis=1)


def method_scores(keys: mx.array, layer: int, calib_tokens: int, seed: int, queries=None,
                  calibrated=None) -> dict[str, np.ndarray]:
    """Each method's score of every token, ``[Hkv, T]`` (higher = kept), from the
    same functions the cache uses; ``recency`` (the position) stands for StreamingLLM.

    With ``queries [Hq, T, D]`` the query-based filters are scored too (online
    query filter and auto-sign key filter, both from the first ``calib_tokens``
    queries); with ``calibrated [Hkv, D]`` the offline filter of this layer.
    """
    from qfilters_mlx.backends import reference
    from qfilters_mlx.cache.kv_cache import insertion_scores

    k = keys[None]  # [1, Hkv, T, D]
    T = k.shape[2]
    pos = mx.broadcast_to(mx.arange(T, dtype=mx.int64)[None, None], k.shape[:3])
    filt = reference.estimate_filter_from_keys(k[:, :, :calib_tokens])
    out = {
        "qfilters-keys+1": insertion_scores("qfilters", k, pos, filters=filt, sign=1),
        "qfilters-keys-1": insertion_scores("qfilters", k, pos, filters=filt, sign=-1),
        "l2norm": insertion_scores("l2norm", k, pos),
        "random": insertion_scores("random", k, pos, seed=seed, layer=layer),
        "recency (streaming_llm)": pos.astype(mx.float32),
    }
    if queries is not None:
        q = queries[None, :, :calib_tokens]
        qf = reference.estimate_filter_from_queries(q, k.shape[1])
        auto = filt * reference.query_orientation(filt, q)[:, None]
        out["qfilters-queries"] = insertion_scores("qfilters", k, pos, filters=qf, sign=1)
        out["qfilters-keys-auto"] = insertion_scores("qfilters", k, pos, filters=auto, sign=1)
    if calibrated is not None:
        out["qfilters-calibrated"] = insertion_scores("qfilters", k, pos, filters=calibrated, sign=1)
    return {name: np.array(v[0]) for name, v in out.items()}


def score_quality(queries: mx.array, keys: mx.array, layer: int, *, cached: int, window: int,
                  calib_tokens: int, n_sink: int, seed: int = 0,
                  calibrated=None) -> dict[str, list[float]]:
    """Per KV head, Spearman between each method's score of the cached tokens
    (sinks excluded) and the attention they receive from the next ``window`` queries.

    Args:
        queries: ``[1, Hq, T, D]`` post-RoPE queries of one layer; keys: ``[1, Hkv, T, D]``.
        layer: layer index (seeds the random arm as in the cache).
        cached: cached tokens; window: following queries.
        calib_tokens: keys the key-SVD filter is estimated from (the first ones).
        n_sink: leading positions excluded (every method keeps them).

    Returns:
        ``{method: [rho per KV head]}``.
    """
    target = received_attention(np.array(queries[0], np.float32), np.array(keys[0], np.float32),
                                cached, window)
    scores = method_scores(keys[0], layer, calib_tokens, seed, queries=queries[0],
                           calibrated=calibrated)
    return {
        name: [spearman(s[h, n_sink:cached], target[h, n_sink:]) for h in range(target.shape[0])]
        for name, s in scores.items()
    }
