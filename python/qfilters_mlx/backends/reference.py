"""Pure-MLX reference for Q-Filters scoring, selection and compaction.

This module is the test oracle for the compiled kernels and the run-time fallback
when no kernel backend is available. It imports only ``mlx`` and shares no code
with the kernels it checks. Every function works on whole arrays: there is no
Python loop over tokens, heads or batch rows.

Shapes follow mlx-lm: keys and values are ``[B, H_kv, T, D]``.

Conventions (the kernels must match them exactly):

* **Filter orientation** (:func:`estimate_filter_from_keys`): the singular
  vector is flipped so that the keys' mean projection onto it is positive; if
  that mean is exactly zero, so that its largest-magnitude component is
  positive (first such component on a tie).
* **Tie-break** (:func:`select_keep`): a higher score wins; among equal scores the
  *earlier* position wins. NaN scores rank below every other value (NaN keys are
  never kept in preference to a finite one).
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.backends.windows import recent_windows

__all__ = [
    "estimate_filter_from_keys",
    "estimate_filter_from_queries",
    "projection_scores",
    "l2norm_scores",
    "select_keep",
    "compact",
    "write_slot",
    "decode_select",
]


def _check_ndim(name: str, x: mx.array, ndim: int) -> None:
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def estimate_filter_from_keys(keys: mx.array) -> mx.array:
    """Top right-singular vector of the uncentred keys of each KV head.

    Godey et al. 2025 (arXiv:2503.02812), Sec. 3: the Q-Filter of a head is the
    dominant singular direction of its (query/key) sample; here the key sample
    stands in for the queries (the "key-SVD" source). Batch rows are pooled:
    head ``h`` uses the ``B * T`` rows ``keys[:, h]``.

    Args:
        keys: ``[B, H, T, D]``, any float dtype; computed in float32.

    Returns:
        ``[H, D]`` float32 unit vectors, oriented so that the keys' mean
        projection is positive (largest-magnitude component positive if the
        mean is exactly zero). Key rows holding NaN or inf are left out.

    Raises:
        TypeError, ValueError: ``keys`` is not a 4-D array or has ``B * T == 0``.
    """
    _check_ndim("keys", keys, 4)
    B, H, T, D = keys.shape
    if B * T == 0:
        raise ValueError("keys must hold at least one token (B * T > 0)")
    x = keys.astype(mx.float32).transpose(1, 0, 2, 3).reshape(H, B * T, D)
    return _top_singular_oriented(x)


def _top_singular_oriented(x: mx.array) -> mx.array:
    """``x [G, N, D]`` -> ``[G, D]`` unit top right-singular vectors oriented so that
    the mean projection of the rows is >= 0 (ties: largest component positive).

    For ``N > D`` the SVD is taken of ``R [G, D, D]`` from the QR factorisation
    ``x = Q R``, which has the same right-singular vectors (``x = (Q U) S V^T``): MLX's
    ``svd`` builds the full ``[N, N]`` left factor, ``O(N^2)`` memory and time per head
    (2,048 queries: 2.3 s against 0.15 s per SmolLM2 layer; 16,384 did not fit)."""
    x = mx.where(mx.isfinite(x).all(axis=-1, keepdims=True), x, 0.0)
    r = mx.linalg.qr(x, stream=mx.cpu)[1] if x.shape[1] > x.shape[2] else x
    _, _, vt = mx.linalg.svd(r, stream=mx.cpu)
    u = vt[:, 0, :]
    u = u / mx.linalg.norm(u, axis=-1, keepdims=True)
    mean_proj = (x @ u[:, :, None]).squeeze(-1).mean(axis=-1)
    peak = mx.take_along_axis(u, mx.argmax(mx.abs(u), axis=-1)[:, None], axis=-1)[:, 0]
    flip = mx.where(mean_proj != 0, mean_proj < 0, peak < 0)
    return mx.where(flip[:, None], -u, u)


def estimate_filter_from_queries(queries: mx.array, n_kv_heads: int) -> mx.array:
    """The paper's estimator: Q-Filters from post-RoPE query vectors.

    Godey et al. 2025 (arXiv:2503.02812), Sec. 3: per query head, the top
    right-singular vector of the uncentred query sample, oriented so that the
    queries' **mean** projection onto it is positive (that end receives
    attention); then averaged over the query heads of each GQA group and
    renormalised. Batch rows are pooled; rows holding NaN/inf are left out.

    Args:
        queries: ``[B, H_q, T, D]``, any float dtype (computed in float32).
        n_kv_heads: ``H_kv``; must divide ``H_q``.

    Returns:
        ``[H_kv, D]`` float32 unit vectors; score a key with ``+<k, f>``.

    Raises:
        TypeError, ValueError: bad rank, ``B * T == 0``, ``H_q % n_kv_heads != 0``.
    """
    _check_ndim("queries", queries, 4)
    B, Hq, T, D = queries.shape
    if B * T == 0:
        raise ValueError("queries must hold at least one token (B * T > 0)")
    if n_kv_heads < 1 or Hq % n_kv_heads:
        raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide the query head count ({Hq})")
    x = queries.astype(mx.float32).transpose(1, 0, 2, 3).reshape(Hq, B * T, D)
    per_head = _top_singular_oriented(x)  # [H_q, D]
    f = per_head.reshape(n_kv_heads, Hq // n_kv_heads, D).mean(axis=1)
    return f / mx.linalg.norm(f, axis=-1, keepdims=True)


def projection_scores(keys: mx.array, filters: mx.array, sign: int = 1) -> mx.array:
    """Q-Filters score of each key: ``sign * <k, u_h>`` (paper Sec. 3, Eq. for the
    projection score), accumulated in float32 whatever the key dtype.

    Args:
        keys: ``[B, H, T, D]`` float32, float16 or bfloat16.
        filters: ``[H, D]`` (converted to float32).
        sign: ``+1`` or ``-1``.

    Returns:
        ``[B, H, T]`` float32 scores (finite for finite float16 keys even when the
        dot product exceeds the float16 range).

    Raises:
        TypeError, ValueError: wrong ranks, mismatched ``H``/``D``, bad ``sign``.
    """
    _check_ndim("keys", keys, 4)
    _check_ndim("filters", filters, 2)
    if tuple(filters.shape) != (keys.shape[1], keys.shape[3]):
        raise ValueError(
            f"filters must have shape [H, D] = {(keys.shape[1], keys.shape[3])}, "
            f"got {tuple(filters.shape)}"
        )
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    f = filters.astype(mx.float32)[None, :, :, None]  # [1, H, D, 1]
    s = (keys.astype(mx.float32) @ f).squeeze(-1)
    return s if sign == 1 else -s


def l2norm_scores(keys: mx.array) -> mx.array:
    """L2Norm score ``-||k||_2`` in float32 (Devoto et al. 2024): low-norm keys are kept.

    Args:
        keys: ``[B, H, T, D]``.

    Returns:
        ``[B, H, T]`` float32.
    """
    _check_ndim("keys", keys, 4)
    return -mx.sqrt(mx.square(keys.astype(mx.float32)).sum(axis=-1))


def _ordered_scores(scores: mx.array) -> mx.array:
    """float32 scores -> uint32 in the same order (negative values bit-inverted, the
    others with the sign bit set); NaN maps like -inf, -0.0 like +0.0."""
    s = scores.astype(mx.float32)
    s = mx.where(mx.isnan(s), -mx.inf, mx.where(s == 0, 0.0, s))
    bits = mx.view(s, mx.uint32)
    return mx.where((bits >> 31) == 1, ~bits, bits | mx.array(0x80000000, mx.uint32))


def _key_max() -> mx.array:
    """The largest uint64 rank key (for forced positions); built per call,
    no module-level arrays."""
    return (mx.array(0xFFFFFFFF, mx.uint32).astype(mx.uint64) << 32) | 0xFFFFFFFF


def _rank_key(scores: mx.array) -> mx.array:
    """A uint64 key whose ascending order is (score ascending, position descending).

    The float32 score is mapped to an order-preserving uint32 (negative values
    are bit-inverted, positive ones get the sign bit set) and placed in the
    high word; the low word holds ``0xFFFFFFFF - position``, so among equal
    scores the earlier position has the larger key. NaN maps to the smallest key.
    """
    T = scores.shape[-1]
    ordered = _ordered_scores(scores)
    pos = mx.arange(T, dtype=mx.uint32)
    low = mx.array(0xFFFFFFFF, mx.uint32) - pos
    return (ordered.astype(mx.uint64) << 32) | low.astype(mx.uint64)


def select_keep(scores: mx.array, budget: int, n_sink: int = 0, recent=0) -> mx.array:
    """Positions kept by sink/recent-masked top-k selection.

    The first ``n_sink`` and the last ``recent`` positions (``recent[h]`` for head
    ``h`` when per head) are always kept; the remaining ``budget - n_sink - recent``
    slots go to the highest scores among
    the other positions (StreamingLLM's sinks, Xiao et al. 2023, plus the
    Q-Filters ranking, Godey et al. 2025 Sec. 3). Ties: the earlier position
    wins; NaN ranks lowest.

    Args:
        scores: ``[B, H, T]`` float32.
        budget: tokens kept per (batch row, head); ``>= 1``.
        n_sink: leading positions always kept; ``>= 0``.
        recent: trailing positions always kept, ``>= 0``: one int, or ``H`` ints (a
            sequence or 1-D array; head ``h`` keeps its last ``recent[h]``).

    Returns:
        ``[B, H, min(budget, T)]`` int32 positions, ascending along the last axis.
        With ``budget >= T`` this is every position.

    Raises:
        TypeError, ValueError: bad rank or ``budget < 1``, ``n_sink < 0``,
        a window ``< 0``, ``n_sink + recent[h] > budget``, or not ``H`` windows.
    """
    _check_ndim("scores", scores, 3)
    for name, v in (("budget", budget), ("n_sink", n_sink)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    B, H, T = scores.shape
    windows = recent_windows(recent, H, n_sink, budget, inclusive=True)
    if budget >= T:
        return mx.broadcast_to(mx.arange(T, dtype=mx.int32), (B, H, T))
    key = _rank_key(scores)
    pos = mx.arange(T)
    start = (T - mx.array(windows, dtype=mx.int32))[None, :, None]  # [1, H, 1]
    forced = (pos < n_sink) | (pos >= start)
    key = mx.where(forced, _key_max(), key)
    # Partial selection, O(T) per row: the budget-th largest key is the threshold.
    # Keys are unique outside the forced set, and forced positions (<= budget of
    # them) all sit at the top, so exactly `budget` keys reach the threshold.
    thr = mx.partition(key, T - budget, axis=-1)[..., T - budget : T - budget + 1]
    keep = key >= thr
    # Scatter kept positions to their rank, giving ascending order without a sort;
    # dropped positions go to a spare slot that is sliced off.
    slot = mx.where(keep, mx.cumsum(keep.astype(mx.int32), axis=-1) - 1, budget)
    out = mx.zeros((B, H, budget + 1), dtype=mx.int32)
    src = mx.broadcast_to(pos.astype(mx.int32), (B, H, T))
    out = mx.put_along_axis(out, slot, src, axis=-1)
    return out[..., :budget]


def compact(keys: mx.array, values: mx.array, kept: mx.array) -> tuple[mx.array, mx.array]:
    """Gather the kept rows of keys and values (bit-exact copies).

    Args:
        keys: ``[B, H, T, D_k]``; values: ``[B, H, T, D_v]``.
        kept: ``[B, H, K]`` integer positions in ``[0, T)``.

    Returns:
        ``([B, H, K, D_k], [B, H, K, D_v])`` in the dtypes of the inputs.
    """
    _check_ndim("keys", keys, 4)
    _check_ndim("values", values, 4)
    _check_ndim("kept", kept, 3)
    idx = kept[..., None]
    return mx.take_along_axis(keys, idx, axis=2), mx.take_along_axis(values, idx, axis=2)


def write_slot(buf: mx.array, rows: mx.array, free: mx.array) -> mx.array:
    """``buf [B, H, S, D]`` with row ``free[b, h]`` replaced by ``rows [B, H, 1, D]``
    (a scatter: MLX updates ``buf`` in place when nothing else holds it)."""
    return mx.put_along_axis(buf, free.astype(mx.int32)[:, :, None, None], rows, axis=2)


def decode_select(scores, positions, new_scores, free, position: int, n_sink: int, recent):
    """Bookkeeping of one decode step of the slot-based eviction cache.

    The cache holds ``S = budget + 1`` slots per (batch row, KV head), one of
    them free. The new token goes into the free slot (its K/V rows by
    :func:`write_slot`; its score and position here), after which all ``S``
    slots are live and attended to. Then the slot to free next is chosen: the
    lowest-ranked slot whose position is neither a sink (``< n_sink``) nor in
    its head's recent window (``>= position + 1 - recent[h]``), with the ranking of
    :func:`select_keep` (lowest score; among equal scores the *later* position
    goes first). Repeating this keeps exactly the set :func:`select_keep`
    keeps over all tokens seen (by induction: the top ``m`` of a set plus one
    element is the old top ``m`` plus that element minus the lowest).

    Args:
        scores: ``[B, H, S]`` float32; positions: ``[B, H, S]`` int64.
        new_scores: ``[B, H, 1]`` (non-finite values are stored as ``-inf``).
        free: ``[B, H]`` int32 slot being written.
        position: absolute position of the new token.
        n_sink, recent: as in :func:`select_keep` (one int or ``H`` windows;
            ``n_sink + recent[h] < S``).

    Returns:
        ``(scores, positions, victim [B, H] int32)``.

    Raises:
        TypeError, ValueError: a window not an int, ``n_sink`` or a window ``< 0``,
            ``n_sink + recent[h] >= S``, or not ``H`` windows.
    """
    S = scores.shape[2]
    # (one int window in range, the cache's case every decode step: nothing to convert)
    if type(recent) is not int or not 0 <= n_sink <= n_sink + recent < S:
        windows = recent_windows(recent, scores.shape[1], n_sink, S, inclusive=False, limit_name="S")
        if type(recent) is not int:
            recent = mx.array(windows, dtype=mx.int64)[None, :, None]  # [1, H, 1]
    idx = free.astype(mx.int32)[:, :, None]
    s_new = new_scores.astype(mx.float32)
    s_new = mx.where(mx.isfinite(s_new), s_new, -mx.inf)
    scores = mx.put_along_axis(scores, idx, s_new, axis=2)
    positions = mx.put_along_axis(positions, idx, mx.full(idx.shape, position, dtype=mx.int64), axis=2)
    ordered = _ordered_scores(scores)
    evictable = (positions >= n_sink) & (positions < position + 1 - recent)
    # the lowest score among evictable slots (0xFFFFFFFF is above every ordered score),
    # then the latest int64 position among those slots: exact for any position
    lowest = mx.where(evictable, ordered, mx.array(0xFFFFFFFF, mx.uint32)).min(axis=-1, keepdims=True)
    tied = evictable & (ordered == lowest)
    victim = mx.argmax(mx.where(tied, positions, -1), axis=-1).astype(mx.int32)
    return scores, positions, victim


def query_orientation(filters: mx.array, queries: mx.array) -> mx.array:
    """Per KV head ``+1``/``-1``: the sign of the mean projection of the group's
    queries ``[B, H_q, T, D]`` onto ``filters [H_kv, D]`` (``+1`` on a zero mean)."""
    B, Hq, T, D = queries.shape
    H = filters.shape[0]
    q = queries.astype(mx.float32).reshape(B, H, Hq // H, T, D)
    mean = (q @ filters[None, :, None, :, None]).mean(axis=(0, 2, 3, 4))
    return mx.where(mean < 0, -1.0, 1.0)
