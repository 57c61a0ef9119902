"""An independent numpy model of the whole eviction cache (imports nothing from qfilters_mlx).

The method, written out from docs/method.md ("How the cache evicts"):

* every token is scored once, when it enters: ``sign * <k, u_h>`` in float32
  for Q-Filters with a fixed filter ``u [H, D]`` given from outside,
  ``-||k||_2`` (float32) for L2Norm, nothing (0) for StreamingLLM; a
  non-finite score (a key holding NaN or inf) counts as ``-inf``;
* after each call that leaves more than ``budget`` tokens stored, the cache
  keeps, per (batch row, KV head), the first ``n_sink`` absolute positions,
  the last ``recent`` positions fed, and the highest scores among the other
  positions (ties: the earlier position wins), in temporal order;
* ``offset`` counts every token fed (the absolute position of the next one).

Because the scores never change and the rule only ever drops the lowest of a
set, the kept set after a call is a pure function of all the tokens fed so far
(it does not depend on chunking, on decode steps or on where the cache was
saved or copied); this model therefore keeps the whole history and recomputes
the selection from scratch after every call. A rewind (``trim``) is the history
cut short.

Arrays: keys/values ``[B, H, T, D]`` numpy (any float dtype, stored as given),
scores ``[B, H, T]`` float32, positions ``[B, H, K]`` int64.
"""

from __future__ import annotations

import numpy as np


def model_scores(method: str, keys: np.ndarray, filters: np.ndarray | None, sign: int) -> np.ndarray:
    """``[B, H, T]`` float32 scores of ``keys [B, H, T, D]`` (non-finite -> -inf)."""
    k = keys.astype(np.float32)
    if method == "qfilters":
        s = np.einsum("bhtd,hd->bht", k, filters.astype(np.float32), dtype=np.float32)
        s = s if sign == 1 else -s
    elif method == "l2norm":
        s = -np.sqrt(np.sum(k * k, axis=-1, dtype=np.float32))
    elif method == "streaming_llm":
        s = np.zeros(k.shape[:3], np.float32)
    else:
        raise ValueError(f"the model covers qfilters (fixed filter), l2norm, streaming_llm; got {method!r}")
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(s), s, -np.inf).astype(np.float32)


def model_keep(scores: np.ndarray, budget: int, n_sink: int, recent: int) -> np.ndarray:
    """Kept positions of one row of scores ``[T]`` (all of them when ``T <= budget``), ascending."""
    T = scores.shape[0]
    if T <= budget:
        return np.arange(T)
    kept = set(range(min(n_sink, T))) | set(range(max(T - recent, 0), T))
    rest = [p for p in range(T) if p not in kept]
    # highest score first; on equal scores the earlier position first
    rest.sort(key=lambda p: (-float(scores[p]), p))
    kept |= set(rest[: budget - len(kept)])
    return np.array(sorted(kept), dtype=np.int64)


class CacheModel:
    """The cache as a history of every token fed (see the module docstring).

    Args:
        method: ``"qfilters"`` (needs ``filters [H, D]``), ``"l2norm"`` or ``"streaming_llm"``.
        budget, n_sink, recent: the configuration (``recent`` as protected:
            ``budget - n_sink`` for StreamingLLM).
        filters: ``[H, D]`` fixed filter; sign: +1 / -1.
    """

    def __init__(self, method, budget, n_sink, recent, filters=None, sign=1):
        self.method, self.budget, self.n_sink, self.recent = method, budget, n_sink, recent
        self.filters, self.sign = filters, sign
        self.keys = self.values = self.scores = None  # history [B, H, T, ...]
        self.call_ends: list[int] = []  # history length at the end of each call

    # ------------------------------------------------------------------ state
    @property
    def offset(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def evicted(self) -> bool:
        """Whether some call (still in the history) ended with more than ``budget`` tokens."""
        return any(e > self.budget for e in self.call_ends)

    def kept(self) -> np.ndarray:
        """``[B, H, K]`` int64 kept absolute positions, ascending."""
        B, H, T = self.scores.shape
        if not self.evicted:
            return np.broadcast_to(np.arange(T, dtype=np.int64), (B, H, T))
        return np.stack([np.stack([model_keep(self.scores[b, h], self.budget, self.n_sink, self.recent)
                                   for h in range(H)]) for b in range(B)])

    def rows(self, positions: np.ndarray) -> tuple:
        """``(keys, values, scores)`` of the given ``[B, H, K]`` positions."""
        take = lambda a: np.take_along_axis(a, positions[..., None] if a.ndim == 4 else positions, axis=2)  # noqa: E731
        return take(self.keys), take(self.values), take(self.scores)

    # ------------------------------------------------------------------ calls
    def update(self, keys: np.ndarray, values: np.ndarray) -> tuple:
        """Feed ``L`` tokens; returns the positions ``[B, H, S + L]`` this call attends to
        (the kept set before the call, then the new tokens)."""
        before = None if self.keys is None else self.kept()
        s = model_scores(self.method, keys, self.filters, self.sign)
        cat = lambda a, b: b.copy() if a is None else np.concatenate([a, b], axis=2)  # noqa: E731
        start = self.offset
        self.keys, self.values, self.scores = cat(self.keys, keys), cat(self.values, values), cat(self.scores, s)
        B, H, L = s.shape
        new = np.broadcast_to(np.arange(start, start + L, dtype=np.int64), (B, H, L))
        self.call_ends.append(self.offset)
        return new if before is None else np.concatenate([before, new], axis=2)

    def trim(self, n: int) -> int:
        """Drop the newest ``n`` tokens (the caller checks what the cache allows)."""
        n = min(max(n, 0), self.offset)
        if n == 0:
            return 0
        T = self.offset - n
        self.keys, self.values, self.scores = (a[:, :, :T] for a in (self.keys, self.values, self.scores))
        self.call_ends = [e for e in self.call_ends if e <= T]
        if not self.call_ends or self.call_ends[-1] != T:
            self.call_ends.append(T)  # a rewind inside a call re-applies its head as a call
        return n
