"""Independent numpy oracles for the tests (share no code with the package)."""

import numpy as np


def np_keep(scores, budget, n_sink, recent):
    """Kept positions of one row: forced sinks/recent, then highest scores, earlier wins ties.

    NaN ranks lowest; -0.0 ties +0.0 (numpy compares them equal).
    """
    s = np.asarray(scores, dtype=np.float64)
    T = s.shape[0]
    pos = np.arange(T)
    if budget >= T:
        return pos
    s = np.where(np.isnan(s), -np.inf, s)
    forced = (pos < n_sink) | (pos >= T - recent)
    order = np.lexsort((pos, -s))  # score descending, then position ascending
    free = [p for p in order if not forced[p]][: budget - int(forced.sum())]
    return np.sort(np.concatenate([pos[forced], np.asarray(free, dtype=int)]))


def np_keep_rows(scores, budget, n_sink, recent):
    """np_keep over a [B, H, T] array -> [B, H, K]; ``recent`` is one int or one window
    per head (head h of every batch row keeps its last ``recent[h]`` positions)."""
    s = np.asarray(scores)
    B, H, _ = s.shape
    windows = list(recent) if np.ndim(recent) else [int(recent)] * H
    return np.stack([np.stack([np_keep(s[b, h], budget, n_sink, windows[h]) for h in range(H)])
                     for b in range(B)])


def np_attention(q, k, v, mask=None):
    """Softmax attention in float64: q [..., N, D], k/v [..., S, D], mask [N, S] bool."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(-1, keepdims=True)
    return w @ v
