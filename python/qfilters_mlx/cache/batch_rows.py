"""Helpers of :class:`qfilters_mlx.cache.batch.BatchQFiltersCache`: which rows may share a
batch (:func:`check_rows`), which tokens of a padded call are real (:func:`plan_rows`), and
the attention mask over left-padded per-row keys (:func:`padded_mask`)."""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.config import KVCacheConfig

__all__ = ["check_rows", "padded_mask", "plan_rows"]


def _describe_difference(a, b) -> str | None:
    """``None`` when caches ``a`` and ``b`` may be rows of one batch, else what differs."""
    if a.config != b.config:
        diff = [f"{name}: {getattr(a.config, name)!r} vs {getattr(b.config, name)!r}"
                for name in a.config.__dataclass_fields__
                if getattr(a.config, name) != getattr(b.config, name)]
        return "configuration (" + "; ".join(diff) + ")"
    build = ("backend", "max_rewind", "bits", "group_size")
    ours = [getattr(a, k, None) for k in build]
    theirs = [getattr(b, k, None) for k in build]
    ours[0], theirs[0] = a.backend.name, b.backend.name
    if ours != theirs:
        return "build options (" + "; ".join(f"{k}: {x!r} vs {y!r}" for k, x, y in zip(build, ours, theirs)
                                             if x != y) + ")"
    if a.layer_idx != b.layer_idx:
        return f"layer index ({a.layer_idx} vs {b.layer_idx})"
    if a.filter_fixed != b.filter_fixed:
        return "filter origin (a given filters file vs a filter estimated online)"
    if a.filter_fixed and not (a.filter.shape == b.filter.shape
                               and bool(mx.array_equal(a.filter, b.filter))):
        return "given Q-Filters (qfilters_filters)"
    return None


def check_rows(caches: list, what: str = "merge") -> None:
    """Check that ``caches`` (per-sequence eviction caches) may be the rows of one batch.

    Every row must be the same eviction cache class (never a plain mlx-lm cache:
    a batch never silently becomes one), hold at most one sequence (batch size 1)
    and share the configuration (``KVCacheConfig`` equality: method, budget,
    sinks, recent window, calibration, sign, backend, ...), the layer index and,
    when the filters are given from a file, the filters themselves. Filters
    estimated online are per row by design and may differ.

    Raises:
        ValueError: naming the first offending row and what differs.
    """
    if not caches:
        raise ValueError(f"{what}: no caches to batch")
    first = caches[0]
    if not isinstance(getattr(first, "config", None), KVCacheConfig):
        raise ValueError(f"{what}: row 0 is a {type(first).__name__}, not a Q-Filters eviction cache")
    for i, c in enumerate(caches):
        if type(c) is not type(first):
            raise ValueError(
                f"{what}: row {i} is a {type(c).__name__} but row 0 is a {type(first).__name__}; "
                "a batch of eviction caches never mixes in other cache kinds (it would silently "
                "stop holding the budget)")
        if c.keys is not None and c.keys.shape[0] != 1:
            raise ValueError(f"{what}: row {i} holds {c.keys.shape[0]} sequences; merge takes "
                             "per-sequence caches (batch size 1)")
        diff = _describe_difference(first, c)
        if diff is not None:
            raise ValueError(f"{what}: row {i} differs from row 0 in its {diff}; every row of a "
                             "batch must use the same cache configuration")


def plan_rows(N: int, skip: list[int], remaining: list) -> list[tuple[int, int]]:
    """The real tokens of each row in a call of ``N`` (padded) tokens.

    Args:
        N: tokens per row in the call.
        skip: per row, left-padding tokens still to come (dropped first).
        remaining: per row, real tokens still to come before right padding, or
            ``None`` (every token after the left padding is real).

    Returns:
        per row ``(start, count)``: the row's real tokens are ``[start, start + count)``.
    """
    plan = []
    for s, r in zip(skip, remaining):
        start = min(s, N)
        count = N - start if r is None else min(r, N - start)
        plan.append((start, count))
    return plan


def padded_mask(N: int, sizes: list[int], plan: list[tuple[int, int]]) -> mx.array:
    """Boolean attention mask ``[B, 1, N, S]`` for per-row keys left-padded to ``S``.

    Row ``i`` stores ``sizes[i]`` tokens and gets ``count_i`` real tokens at query
    positions ``[start_i, start_i + count_i)``; its returned keys are its
    ``sizes[i] + count_i`` real keys, right-aligned in ``S = max(sizes[i] +
    count_i, 1)`` columns. A real query ``j`` sees the row's stored keys and its
    real tokens up to itself (causal, bottom-right aligned); padding columns are
    never seen. Padding queries (whose outputs are discarded) see every column
    (zeros where padded), so that no softmax row is empty.
    """
    B = len(sizes)
    tot = [s + c for s, (_, c) in zip(sizes, plan)]
    S = max(max(tot), 1)
    pad = mx.array([S - t for t in tot])[:, None, None]
    size = mx.array(sizes)[:, None, None]
    start = mx.array([p[0] for p in plan])[:, None, None]
    count = mx.array([p[1] for p in plan])[:, None, None]
    j = mx.arange(N)[None, :, None]
    k = mx.arange(S)[None, None, :]
    real_q = (j >= start) & (j < start + count)
    causal = (k >= pad) & (k - pad <= size + (j - start))
    mask = mx.where(real_q, causal, mx.ones((B, N, S), dtype=mx.bool_))
    return mask[:, None]
