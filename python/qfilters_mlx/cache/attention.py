"""What a layer's attention reads from ``QFiltersKVCache`` besides ``update_and_fetch``'s
output (mlx-lm's cache methods): the attention mask (:func:`make_mask`, from the stored length
and, for sliding-window masks, the stored positions) and the last call's keys and values for
layers that reuse them (:func:`keys_and_values`). Like the cache's other component modules,
these read the cache's own (underscore) state."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["keys_and_values", "make_mask"]


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


def keys_and_values(cache):
    """The keys and values the last ``update_and_fetch`` returned (mlx-lm's cache method:
    what this layer's last attention call saw, stored ++ new, before that call's
    eviction), for layers that reuse another layer's K/V (gemma3n's KV-shared layers,
    afm7's KV-reuse blocks). ``[B, H_kv, S + L, D]`` each (``(packed, scales,
    biases)`` when quantized).

    Raises:
        ValueError: ``keep_last_kv`` is False (``KVCacheBuilder.for_model`` sets it on the
            layers a model reads this way), or no update since the cache was built,
            loaded or trimmed.
    """
    if not cache.keep_last_kv:
        raise ValueError(
            f"layer {cache.layer_idx}: keys_and_values() needs keep_last_kv=True (another layer "
            "reads this layer's K/V; KVCacheBuilder.for_model sets it for such models)")
    if cache._last_kv is None:
        raise ValueError(f"layer {cache.layer_idx}: keys_and_values() before any update_and_fetch "
                         "since the cache was built, loaded or trimmed")
    return cache._last_kv
