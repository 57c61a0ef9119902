"""Compress once: the paper's and kvpress's way of using a KV-cache press.

This module holds the rule's pure parts (:func:`keep_count`, :func:`check_target`) and
:func:`compress_caches`; the cache's side (``compress``, ``check_compress``, the limits
each call evicts to, the ``prompt_end`` trigger) is in ``QFiltersKVCache``
(:mod:`qfilters_mlx.cache.kv_cache`), on its hot path.

In ``qfilters_mode="streaming"`` (the default) a cache evicts down to a fixed budget
after every call, through the question and the answer. In ``"compress_once"`` mode
(Godey et al. 2025, arXiv:2503.02812, Sec. 4; kvpress's ``KVPressTextGenerationPipeline``)
the cache keeps every token it is fed until it is *compressed once*; then each
(batch row, KV head) holds the ``K`` tokens that compression kept, and later tokens
(the question, the answer) are appended without eviction; with ``qfilters_growth=G``
the cache evicts again (streaming rule, budget ``K + G``) once it holds more than
``K + G`` tokens.

A compression of a cache holding ``T`` tokens per (row, head) keeps

* ``K = max(1, int(T * (1 - ratio)))`` tokens with a ratio (kvpress's
  ``n_kept = int(k_len * (1 - compression_ratio))``; at least one), or
  ``K = min(T, budget)`` with an absolute budget;
* the first ``n_sink`` positions and the last ``recent`` ones (cut to ``K``: sinks
  first), the rest by highest insertion score (the method's, as in streaming mode:
  Q-Filters ``sign * <k, f>``, L2Norm ``-||k||``; StreamingLLM keeps the sinks and
  the ``K - n_sink`` newest), ties to the earlier position, in temporal order
  (:func:`qfilters_mlx.backends.reference.select_keep`, the streaming selection).

When is it compressed? :func:`compress_caches` (or ``cache.compress()``) at any time
(``qfilters_compress_at="manual"``), or automatically (``"prompt_end"``, the default)
at the first single-token call that follows a multi-token call. mlx-lm's
``generate_step`` (hence ``generate``, ``stream_generate`` and ``qfilters-mlx generate``)
prefills all prompt tokens but the last in calls of ``prefill_step_size`` tokens and
then feeds the last one alone, so the compression covers the prompt but its last
token (its last two when the final prefill chunk is one token long). A prompt fed one
token at a time (``prefill_step_size=1``) is never compressed by this trigger: call
:func:`compress_caches` yourself there.

Rewinds cannot cross a compression (the journal is cleared); tokens appended after
it can be trimmed exactly while nothing was evicted since (no journal needed);
``is_trimmable()`` follows the streaming rule (deeper trims would raise).
"""

from __future__ import annotations

__all__ = ["check_target", "compress_caches", "keep_count"]


def keep_count(tokens: int, ratio: float | None = None, budget: int | None = None) -> int:
    """Tokens a compression keeps of ``tokens``: ``max(1, int(tokens * (1 - ratio)))``
    (kvpress's rule) with a ratio, else ``min(tokens, budget)``."""
    if ratio is not None:
        return max(1, int(tokens * (1 - ratio)))
    return min(tokens, budget)


def check_target(ratio, budget) -> None:
    """Raise ``ValueError`` unless at most one of ``ratio`` (in ``[0, 1)``) and ``budget``
    (an int ``>= 1``) is given."""
    if ratio is not None and budget is not None:
        raise ValueError("give a compression ratio or a budget, not both")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not 0.0 <= ratio < 1.0):
        raise ValueError(f"ratio (the fraction of tokens removed) must be in [0, 1), got {ratio!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")


def _flatten(caches) -> list:
    out = []
    for c in caches:
        inner = getattr(c, "caches", None)  # MultiArmCache (evaluation batches)
        out.extend(_flatten(inner) if isinstance(inner, list) else [c])
    return out


def compress_caches(caches, ratio: float | None = None, budget: int | None = None) -> list[int]:
    """Compress every compress-once eviction cache of ``caches`` once, in place.

    Args:
        caches: a model's prompt cache (a list, one cache per layer; layers with
            mlx-lm's own caches, e.g. sliding-window ones, are left as they are).
        ratio: fraction of the tokens removed per (layer, batch row, KV head), kvpress's
            ``compression_ratio``; or ``budget``: tokens kept. Neither: each cache's
            configuration (``qfilters_compression_ratio``, else ``qfilters_budget``).

    Returns:
        The rows kept per (row, head) by each compressed cache, in layer order.

    Raises:
        ValueError: no eviction cache in ``caches``, or any cache cannot be compressed
            (``QFiltersKVCache.check_compress``); checked for all before any changes.
    """
    targets = [c for c in _flatten(caches) if callable(getattr(c, "check_compress", None))]
    if not targets:
        raise ValueError("compress_caches: no QFiltersKVCache in caches (build them with "
                         "KVCacheBuilder.for_model and qfilters_mode='compress_once')")
    for c in targets:
        c.check_compress(ratio, budget)
    return [c.compress(ratio, budget) for c in targets]
