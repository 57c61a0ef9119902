"""Rewinds of a :class:`~qfilters_mlx.cache.kv_cache.QFiltersKVCache`: ``trim`` and the
questions mlx-lm asks before it (``is_trimmable``), as functions of the cache.

Before any eviction a rewind is a plain trim (drop the newest rows). After one, the rewind
journal (:mod:`.journal`: one record per call or decode step, pushed by the cache's hot
path when rewinds are on) restores what the removed calls overwrote or evicted, so the
cache ends exactly as if the removed tokens had never been fed; a rewind that ends inside
a recorded call re-applies that call's head. After a compression (compress-once mode) the
journal is cleared; the tokens appended since it can be dropped while none was evicted.

The functions read and write the cache's own state (its underscore attributes), as the
cache's other component modules do; nothing outside ``cache/`` does.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.cache.compression import grown_exact
from qfilters_mlx.cache.journal import (LayoutRecord, RewindJournal, StepRecord, call_head_rows,
                                        undo_call_rows, undo_layout, undo_step)
from qfilters_mlx.cache.rows import Rows
from qfilters_mlx.config.build import AUTO, AUTO_REWIND

__all__ = ["depth_now", "is_trimmable", "rewindable_tokens", "trim", "trim_count"]


def is_trimmable(cache) -> bool:
    """Whether every rewind mlx-lm may ask of ``cache`` is exact, now and later.

    mlx-lm trims only through ``trim_prompt_cache``, which skips (silently, returning 0) a
    cache that says False; its speculative decoding asks once, before the prompt, and its
    server asks before trimming a stored cache to a shared prefix. So this says True only
    when no such rewind can fail: a method that never evicts, or ``max_rewind > 0`` (the
    journal makes rewinds exact after an eviction; a deeper one raises ``ValueError``
    naming the field before changing anything). An evicting cache with ``max_rewind=0``
    says False from the start, even before its first eviction: speculative decoding is
    then refused by mlx-lm's start check before the prompt is fed, and mlx-lm's server
    reuses stored prefixes without trimming them.

    With ``max_rewind="auto"`` (the default) asking turns the journal on: before the first
    eviction (nothing is lost yet) the cache starts journaling its last
    :data:`~qfilters_mlx.config.AUTO_REWIND` tokens and says True; after an eviction it
    had no journal for, or with quantized storage (no journal), False.
    """
    if not cache.scorer.evicts:
        return True
    if cache.max_rewind != AUTO:
        return cache.max_rewind > 0
    if not cache._journal.active:
        if cache.quantized or cache.evicted:
            return False
        cache._journal = RewindJournal(AUTO_REWIND)
    return True


def depth_now(cache) -> int:
    """The journal depth a new or reloaded cache starts with (``"auto"``: none yet)."""
    return 0 if not cache.scorer.evicts or cache.max_rewind == AUTO else cache.max_rewind


def rewindable_tokens(cache) -> int:
    """Tokens ``trim`` can remove now: ``size()`` before any eviction; after it, the
    journal's reach (the last ``max_rewind`` tokens fed; fewer right after a rewind or a
    reload); after a compression without a journal, the tokens appended since it while
    none was evicted."""
    reach = cache._n if not cache.evicted else cache._journal.rewindable
    return max(reach, 0 if cache._journal.active else grown_exact(cache))


def trim_count(cache, n: int) -> int:
    """How many tokens ``trim(cache, n)`` would remove, changing nothing.

    Raises:
        ValueError: after an eviction, ``n`` exceeds what the journal can restore.
    """
    n = int(n)
    if n <= 0:
        return 0
    can = rewindable_tokens(cache)
    if n <= can:
        return n
    if not cache.evicted:
        return can  # a plain trim removes what is stored
    raise ValueError(
        f"cannot rewind {n} tokens after an eviction: this cache can restore the last "
        f"{can} (max_rewind={cache.max_rewind!r}; a cache loaded from a file restores only "
        f"what it saw since; 'auto' journals {AUTO_REWIND} tokens once is_trimmable() is asked "
        "before the first eviction); for speculative decoding set max_rewind >= "
        "num_draft_tokens (qfilters-mlx: --max-rewind)")


def trim(cache, n: int) -> int:
    """Remove the newest ``n`` tokens of ``cache``; returns the number removed (``n <= 0``: 0).

    Before any eviction: at most ``size()`` tokens, as a plain trim (a trim back into the
    calibration keys drops the filter, re-estimated once ``calib_tokens`` tokens are present
    again). After an eviction: exactly ``n`` tokens, restoring what the removed calls
    overwrote or evicted. After a compression (no journal): also the tokens appended since
    it, while none was evicted.

    Raises:
        ValueError: as :func:`trim_count`; nothing is changed.
    """
    n = int(n)
    if n > 0 and cache.evicted and not cache._journal.active and n <= grown_exact(cache):
        _drop_newest(cache, n)
        return n
    n = trim_count(cache, n)  # raises before anything changes
    if n <= 0:
        return 0
    cache._last_kv = None
    if not cache.evicted:
        _drop_newest(cache, n)
        cache._journal.drop_tail(n)
        return n
    left = n
    while left > 0:
        rec = cache._journal.pop()
        if isinstance(rec, StepRecord):
            rows, cache._free, cache._victim_rows = undo_step(cache.rows, rec,
                                                                 cache.backend.write_slot)
            cache.rows = Rows(*rows)
            cache.offset -= 1
            left -= 1
        elif isinstance(rec, LayoutRecord):
            _undo_layout(cache, rec.slots)
        elif rec.tokens > left:  # the rewind ends inside this call: re-apply its head
            m = rec.tokens - left
            redo = call_head_rows(cache.rows, cache._n, rec, m)
            _undo_call(cache, rec)
            cache._update(redo[0], redo[1])
            if rec.observed is not None:
                cache.observe_queries(rec.observed[:, :, :m])
            left = 0
        else:
            _undo_call(cache, rec)
            left -= rec.tokens
    mx.async_eval([a for a in (*cache.rows, cache._victim_rows) if a is not None])
    return n


def _drop_newest(cache, n: int) -> None:
    """A plain trim: drop the newest ``n`` stored rows (none of them evicted anything)."""
    cache._last_kv = None
    cache._n -= n
    cache.offset -= n
    if (cache._needs_filter and cache.filter is not None
            and cache.offset < cache.config.qfilters_calib_tokens):
        cache.filter = None
        cache.rows = cache.rows._replace(scores=mx.zeros_like(cache.rows.scores))  # unscored again
    if cache._queries is not None:
        cache._queries = cache._queries[:, :, : cache.offset]


def _undo_layout(cache, slots: tuple) -> None:
    rows, cache._free, cache._victim_rows = undo_layout(cache.rows, cache._n, slots)
    cache.rows = Rows(*rows)


def _undo_call(cache, rec) -> None:
    """Undo the newest multi-token call (the cache is in its post-call state)."""
    cache.rows = Rows(*undo_call_rows(cache.rows, cache._n, rec))
    if cache._needs_filter and rec.filter is None and cache.filter is not None:
        cache.rows = cache.rows._replace(scores=mx.zeros_like(cache.rows.scores))  # never scored
    cache.filter, cache._queries, cache.evicted = rec.filter, rec.queries, rec.evicted
    cache.offset = rec.offset
    cache._n = rec.n
    if rec.slots is not None:  # the call started in slot mode
        _undo_layout(cache, rec.slots)
