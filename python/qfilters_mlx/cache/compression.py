"""Compress once: the paper's and kvpress's way of using a KV-cache press (mixin + function).

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

import math

import mlx.core as mx

__all__ = ["CompressionMixin", "compress_caches", "keep_count"]


def keep_count(tokens: int, ratio: float | None = None, budget: int | None = None) -> int:
    """Tokens a compression keeps of ``tokens``: ``max(1, int(tokens * (1 - ratio)))``
    (kvpress's rule) with a ratio, else ``min(tokens, budget)``."""
    if ratio is not None:
        return max(1, int(tokens * (1 - ratio)))
    return min(tokens, budget)


def _check_target(ratio, budget) -> None:
    if ratio is not None and budget is not None:
        raise ValueError("give a compression ratio or a budget, not both")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not 0.0 <= ratio < 1.0):
        raise ValueError(f"ratio (the fraction of tokens removed) must be in [0, 1), got {ratio!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")


class CompressionMixin:
    """Compress-once mode of ``QFiltersKVCache`` (see the module docstring).

    State: ``_compressed`` is ``None`` before the first compression, else ``(K, offset)``:
    the rows kept and the offset at that moment; ``_saw_chunk`` records a multi-token call
    (the ``prompt_end`` trigger).
    """

    def _reset_compression(self) -> None:
        self._compressed = None
        self._saw_chunk = False

    @property
    def compressed(self) -> bool:
        """Whether the cache has been compressed (compress-once mode)."""
        return self._compressed is not None

    # ------------------------------------------------------------- limits
    def _budget_now(self):
        """Rows kept per (row, head) after a call: the streaming budget; in compress-once
        mode ``inf`` before the compression and ``K + growth`` (or ``inf``) after it."""
        c = self.config
        if not c.compress_once:
            return c.qfilters_budget
        if self._compressed is None or c.qfilters_growth is None:
            return math.inf
        return max(1, self._compressed[0] + c.qfilters_growth)

    def _window(self, budget: int) -> tuple[int, int]:
        """``(n_sink, recent)`` at ``budget`` kept rows (cut to it, sinks first)."""
        c = self.config
        if not c.compress_once:
            return c.qfilters_n_sink, self.recent_window  # (one int, or H_kv per-head windows)
        sinks = min(c.qfilters_n_sink, budget)
        if c.method == "streaming_llm":
            return sinks, budget - sinks
        return sinks, min(c.qfilters_recent, budget - sinks)

    def _limits_now(self) -> tuple[int, int, int]:
        """``(budget, n_sink, recent)`` of the next eviction."""
        b = self._budget_now()
        return (b, *self._window(b))

    def _growing(self) -> bool:
        """Whether single-token calls append (compress-once mode below its limit)
        instead of running slot-mode eviction steps."""
        return self.config.compress_once and self._n < self._budget_now()

    def prepare_call(self, tokens: int) -> None:
        """Run the compress-once ``prompt_end`` trigger for a coming call of ``tokens`` tokens
        (idempotent; ``update_and_fetch`` runs it too). A batch cache calls it before it sizes
        its rows for the attention mask, so that a row compressing at this call is sized
        after its compression."""
        self._before_call(tokens)

    def _before_call(self, tokens: int) -> None:
        """The ``prompt_end`` trigger, run before a call of ``tokens`` tokens is stored."""
        c = self.config
        if not c.compress_once or self._compressed is not None or c.qfilters_compress_at != "prompt_end":
            return
        if tokens > 1:
            self._saw_chunk = True
        elif self._saw_chunk:
            self.compress()

    # -------------------------------------------------------------- compress
    def check_compress(self, ratio: float | None = None, budget: int | None = None) -> None:
        """Raise the error :meth:`compress` would raise, changing nothing.

        Raises:
            ValueError: the cache is not in compress-once mode, holds nothing, its
                filter is not estimated yet, or a bad ``ratio``/``budget``.
        """
        c = self.config
        if not c.compress_once:
            raise ValueError(f"layer {self.layer_idx}: compression needs qfilters_mode='compress_once' "
                             f"(this cache has qfilters_mode={c.qfilters_mode!r})")
        _check_target(ratio, budget)
        if self.keys is None or self._n == 0:
            raise ValueError(f"layer {self.layer_idx}: the cache is empty; nothing to compress")
        if not self.scoring_ready:
            hint = " and its queries observed (observe_queries)" if self.needs_queries else ""
            raise ValueError(
                f"layer {self.layer_idx}: cannot compress before the filter is estimated "
                f"({self.offset} tokens seen, qfilters_calib_tokens={c.qfilters_calib_tokens}"
                f"{hint}); pass calibrated filters (qfilters_filters) or a smaller "
                f"qfilters_calib_tokens")

    def compress(self, ratio: float | None = None, budget: int | None = None) -> int:
        """Compress the stored tokens once (see the module docstring); returns ``K``.

        Args:
            ratio: fraction removed, in ``[0, 1)``; budget: absolute tokens kept.
                Neither: the config's ``qfilters_compression_ratio``, else its
                ``qfilters_budget``.

        Raises:
            ValueError: as :meth:`check_compress`, before anything changes.
        """
        self.check_compress(ratio, budget)
        c = self.config
        if ratio is None and budget is None:
            ratio = c.qfilters_compression_ratio
            budget = c.qfilters_budget if ratio is None else None
        self._to_temporal()
        n = self._n
        keep = keep_count(n, ratio, budget)
        if keep < n:
            sinks, recent = self._window(keep)
            live = tuple(a[:, :, :n] for a in (self.keys, self.values, self.scores, self.positions))
            kept, k, v = self.backend.select_compact(live[2], live[0], live[1], keep, sinks, recent)
            self.scores = mx.take_along_axis(live[2], kept, axis=2)
            self.positions = mx.take_along_axis(live[3], kept, axis=2)
            self.keys, self.values = k, v
            self._n = keep
            self.evicted = True
            self._queries = None
            mx.async_eval(self.keys, self.values, self.scores, self.positions)
        self._compressed = (self._n, self.offset)
        self._journal.clear()  # rewinds cannot cross the compression
        return self._n

    # ------------------------------------------------------------------ trim
    def _grown_exact(self) -> int:
        """Tokens appended since the compression, all still stored (none evicted since)."""
        if self._compressed is None or self._free is not None:
            return 0
        k, offset = self._compressed
        grown = self._n - k
        return grown if grown == self.offset - offset else 0

    @property
    def rewindable_tokens(self) -> int:
        return max(super().rewindable_tokens, 0 if self._journal.active else self._grown_exact())

    def trim(self, n: int) -> int:
        """As :meth:`RewindMixin.trim`; after a compression (no journal) also the tokens
        appended since it, while none was evicted (a plain drop of the newest rows)."""
        n = int(n)
        if (n > 0 and self.evicted and not self._journal.active and n <= self._grown_exact()):
            self._last_kv = None
            self._n -= n
            self.offset -= n
            return n
        return super().trim(n)


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
            (:meth:`CompressionMixin.check_compress`); checked for all before any changes.
    """
    targets = [c for c in _flatten(caches) if isinstance(c, CompressionMixin)]
    if not targets:
        raise ValueError("compress_caches: no QFiltersKVCache in caches (build them with "
                         "KVCacheBuilder.for_model and qfilters_mode='compress_once')")
    for c in targets:
        c.check_compress(ratio, budget)
    return [c.compress(ratio, budget) for c in targets]
