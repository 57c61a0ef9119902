"""The attention mask of ``QFiltersKVCache`` (mlx-lm's ``make_mask`` cache method), built from
the cache's stored length and, for sliding-window masks, its stored positions."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["make_mask"]


def make_mask(cache, N: int, return_array: bool = False, window_size: int | None = None):
    """Attention mask for ``N`` new queries over the ``size() + N`` keys returned next.

    Stored tokens all precede the new ones, so the causal mask is
    bottom-right aligned: ``"causal"`` (``None`` for ``N == 1``: nothing to
    mask), or a boolean ``[N, size() + N]`` array when ``return_array``
    (also for ``N == 1``). With
    ``window_size`` the mask is built from absolute positions, which is
    possible while every head stores the same positions (before any
    eviction, and always for a method that keeps by position: ``full``, ``streaming_llm``).

    Raises:
        ValueError: ``window_size`` after a per-head eviction.
    """
    from mlx_lm.models.base import create_causal_mask  # (lazily: importing mlx_lm runs our hook)

    S = cache._n
    if window_size is None:
        if return_array:
            return create_causal_mask(N, S)
        return None if N == 1 else "causal"
    if not cache.evicted:
        return create_causal_mask(N, S, window_size=window_size)
    if cache.scorer.ranks:
        raise ValueError(
            "window_size masks are not supported after per-head eviction "
            f"(method={cache.method!r}); use the model's own cache for sliding-window layers"
        )
    cache._to_temporal()
    q = cache.offset + mx.arange(N)[:, None]
    k = mx.concatenate([cache.positions[0, 0, :S], cache.offset + mx.arange(N)])[None]
    return (k <= q) & (k > q - window_size)
