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


def np_victim(scores, positions, position, n_sink, recent):
    """The slot decode_select frees next ([B, H, S] -> [B, H] int32): among slots whose
    position is neither a sink (< n_sink) nor in the recent window (>= position + 1 -
    recent), the lowest score; among equal scores the latest position. Python ints and
    floats: no overflow at any int64 position (NaN/inf already stored as -inf)."""
    B, H, S = scores.shape
    out = np.zeros((B, H), np.int32)
    for b in range(B):
        for h in range(H):
            cand = [j for j in range(S) if n_sink <= int(positions[b, h, j]) < position + 1 - recent]
            out[b, h] = min(cand, key=lambda j: (float(scores[b, h, j]), -int(positions[b, h, j])))
    return out


def np_write_slot(scores, positions, new, free, position):
    """A decode step's write in numpy: each (batch row, head) slot ``free [B, H]`` gets the
    new score ``new [B, H, 1]`` and the absolute ``position``; returns copies of
    ``scores [B, H, S]`` and ``positions [B, H, S]``."""
    scores, positions = scores.copy(), positions.copy()
    b, h = np.indices(free.shape)
    scores[b, h, free] = new[..., 0]
    positions[b, h, free] = position
    return scores, positions


def np_fmix32(h):
    """MurmurHash3's 32-bit finaliser on uint32 numpy arrays (wrapping arithmetic)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def np_hash_scores(positions, seed, layer):
    """The random arm (docs/configuration.md, "Eviction methods") at ``positions [..., H, T]``
    (heads on axis -2): uniform [0, 1)
    from MurmurHash3 fmix32 of position * golden ratio xor fmix32(head + seed * 0x27D4EB2F
    + layer * 0x165667B1 + 1), top 24 bits / 2**24 (positions taken modulo 2**32)."""
    with np.errstate(over="ignore"):
        pos = np.asarray(positions).astype(np.uint32)
        head = np.arange(pos.shape[-2], dtype=np.uint32)[:, None]
        mix = np.uint32((seed * 0x27D4EB2F + layer * 0x165667B1 + 1) & 0xFFFFFFFF)
        h = np_fmix32((pos * np.uint32(0x9E3779B1)) ^ np_fmix32(head + mix))
    return (h >> np.uint32(8)).astype(np.float64) / (1 << 24)


def np_random_scores(H, T, seed, layer):
    """The random arm at positions 0..T-1: ``[H, T]`` float64."""
    return np_hash_scores(np.broadcast_to(np.arange(T), (H, T)), seed, layer)
