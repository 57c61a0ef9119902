"""Compress once: the paper's and kvpress's way of using a KV-cache press.

This module holds the rule's pure parts (:func:`keep_count`, :func:`check_target`),
:func:`compress_caches`, and the cache's side as functions of one
:class:`~qfilters_mlx.cache.kv_cache.QFiltersKVCache` (:func:`compress`,
:func:`check_compress`, the ``prompt_end`` trigger :func:`before_call`,
:func:`grown_exact`); the limits each call evicts to are resolved here once, at the compression
(``QFiltersKVCache.limits``, :func:`~qfilters_mlx.cache.rows.resolve_limits`), and the
compression evicts with the streaming eviction's routine (``QFiltersKVCache._evict``). Like
the cache's other component modules, these functions read and write the cache's own state.

In the streaming mode (``mode=Streaming()``, the default) a cache evicts down to a fixed budget
after every call, through the question and the answer. In the compress-once mode (``mode=CompressOnce(ratio, growth, at)``)
(Godey et al. 2025, arXiv:2503.02812, Sec. 4; kvpress's ``KVPressTextGenerationPipeline``)
the cache keeps every token it is fed until it is *compressed once*; then each
(batch row, KV head) holds the ``K`` tokens that compression kept, and later tokens
(the question, the answer) are appended without eviction; with ``growth=G``
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
(``at="manual"``), or automatically (``"prompt_end"``, the default)
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

import mlx.core as mx

from qfilters_mlx.cache.rows import window

__all__ = ["before_call", "check_compress", "check_target", "compress", "compress_caches",
           "grown_exact", "keep_count"]


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


def before_call(cache, tokens: int) -> None:
    """The ``prompt_end`` trigger, run before a call of ``tokens`` tokens is stored: the first
    single-token call after a multi-token one compresses ``cache`` (compress-once mode with
    ``at="prompt_end"``, not compressed yet; otherwise nothing)."""
    c = cache.config
    if cache._compressed is not None or not c.compress_once or c.mode.at != "prompt_end":
        return
    if tokens > 1:
        cache._saw_chunk = True
    elif cache._saw_chunk:
        compress(cache)


def check_compress(cache, ratio: float | None = None, budget: int | None = None) -> None:
    """Raise the error :func:`compress` would raise, changing nothing.

    Raises:
        ValueError: the cache is not in compress-once mode, holds nothing, its filter is not
            estimated yet, or a bad ``ratio`` / ``budget``.
    """
    c = cache.config
    if not c.compress_once:
        raise ValueError(f"layer {cache.layer_idx}: compression needs mode=CompressOnce(...) "
                         f"(this cache has mode={c.mode!r})")
    check_target(ratio, budget)
    if cache.keys is None or cache._n == 0:
        raise ValueError(f"layer {cache.layer_idx}: the cache is empty; nothing to compress")
    if not cache.scoring_ready:
        hint = " and its queries observed (observe_queries)" if cache.needs_queries else ""
        raise ValueError(
            f"layer {cache.layer_idx}: cannot compress before the filter is estimated "
            f"({cache.offset} tokens seen, qfilters_calib_tokens={c.qfilters_calib_tokens}"
            f"{hint}); pass calibrated filters (qfilters_filters) or a smaller "
            f"qfilters_calib_tokens")


def compress(cache, ratio: float | None = None, budget: int | None = None) -> int:
    """Compress the stored tokens of ``cache`` once; returns ``K``, the rows kept per
    (batch row, KV head) (module docstring: the rule).

    Args:
        ratio: fraction removed, in ``[0, 1)``; budget: absolute tokens kept. Neither:
            the config's ``mode.ratio``, else its ``qfilters_budget``.

    Raises:
        ValueError: as :func:`check_compress`, before anything changes.
    """
    check_compress(cache, ratio, budget)
    c = cache.config
    if ratio is None and budget is None:
        ratio = c.mode.ratio
        budget = c.qfilters_budget if ratio is None else None
    cache._to_temporal()
    cache._journal.clear()  # rewinds cannot cross the compression
    n = cache._n
    keep = keep_count(n, ratio, budget)
    if keep < n:
        cache._evict(keep, *window(c, cache.scorer.ranks, keep))  # (the streaming eviction's routine)
        mx.async_eval(*cache.rows)
    cache._compressed = (cache._n, cache.offset)
    cache.resolve_limits()
    return cache._n


def grown_exact(cache) -> int:
    """Tokens appended to ``cache`` since its compression, all still stored (none evicted
    since); 0 when not compressed or in slot mode."""
    if cache._compressed is None or cache._free is not None:
        return 0
    k, offset = cache._compressed
    grown = cache._n - k
    return grown if grown == cache.offset - offset else 0


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
            configuration (``mode.ratio``, else ``qfilters_budget``).

    Returns:
        The rows kept per (row, head) by each compressed cache, in layer order.

    Raises:
        ValueError: no eviction cache in ``caches``, or any cache cannot be compressed
            (:func:`check_compress`); checked for all before any changes.
    """
    targets = [c for c in _flatten(caches) if callable(getattr(c, "check_compress", None))]
    if not targets:
        raise ValueError("compress_caches: no QFiltersKVCache in caches (build them with "
                         "KVCacheBuilder.for_model and mode=CompressOnce(...))")
    for c in targets:
        c.check_compress(ratio, budget)
    return [c.compress(ratio, budget) for c in targets]
