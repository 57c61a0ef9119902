"""``trim``: rewinding the newest tokens (mixin of ``QFiltersKVCache``).

Before the first eviction every row is stored and ``trim(n)`` drops the
newest ``n`` (any ``n``). After it, a rewind of up to ``qfilters_max_rewind``
tokens replays the journal (:mod:`qfilters_mlx.cache.journal`) backwards and
leaves the cache bit-identical to one that never saw the removed tokens;
deeper rewinds raise ``ValueError`` before changing anything.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.cache.journal import CallRecord, LayoutRecord, StepRecord, pad_rows, rows_between


class RewindMixin:
    """``is_trimmable`` / ``trim`` and the undo of one multi-token call."""

    def is_trimmable(self) -> bool:
        """Whether every rewind mlx-lm may ask of this cache is exact, now and later.

        mlx-lm trims only through ``trim_prompt_cache``, which skips (silently, returning 0) a
        cache that says False; its speculative decoding asks once, before the prompt, and
        its server asks before trimming a stored cache to a shared prefix. So this says True
        only when no such rewind can fail: ``method="full"`` (never evicts), or
        ``qfilters_max_rewind > 0`` (the journal makes rewinds exact after an eviction; a
        deeper one raises ``ValueError`` naming the field before changing anything). An
        evicting cache with ``qfilters_max_rewind=0`` (the default) says False from the
        start, even before its first eviction: speculative decoding is then refused by
        mlx-lm's start check before the prompt is fed (never rejected drafts left in the
        cache), and mlx-lm's server reuses stored prefixes without trimming them. ``trim``
        itself stays exact where it can be (see :meth:`trim`).
        """
        return self.method == "full" or self.config.qfilters_max_rewind > 0

    def trim_count(self, n: int) -> int:
        """How many tokens ``trim(n)`` would remove, changing nothing (batch caches check
        every row first).

        Raises:
            ValueError: ``trim(n)`` would raise (see :meth:`trim`).
        """
        n = int(n)
        if n <= 0:
            return 0
        can = self.rewindable_tokens
        if n <= can:
            return n
        if not self.evicted:
            return can  # a plain trim removes what is stored
        raise ValueError(
            f"cannot rewind {n} tokens after an eviction: this cache can restore the last "
            f"{can} (qfilters_max_rewind={self.config.qfilters_max_rewind}; a cache loaded "
            "from a file restores only what it saw since); for speculative decoding set "
            "qfilters_max_rewind >= num_draft_tokens (qfilters-mlx: --max-rewind)"
        )

    @property
    def rewindable_tokens(self) -> int:
        """How many tokens ``trim`` can remove now: ``size()`` before any eviction;
        after it, the journal's reach: the last ``qfilters_max_rewind`` tokens fed
        (fewer right after a rewind, which uses up the journal it replays, or
        after a reload; new tokens refill it)."""
        return self._n if not self.evicted else self._journal.rewindable

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens; returns the number removed (``n <= 0``: 0).

        Before any eviction: at most ``size()`` tokens, as a plain trim (a trim
        back into the calibration keys drops the filter, re-estimated once
        ``calib_tokens`` tokens are present again). After an eviction: exactly
        ``n`` tokens, restoring what the removed calls overwrote or evicted.

        Raises:
            ValueError: after an eviction, ``n`` exceeds what the journal can
                restore (``qfilters_max_rewind``, or fewer tokens seen since the
                cache was built or loaded); nothing is changed.
        """
        n = self.trim_count(n)  # raises before anything changes
        if n <= 0:
            return 0
        self._last_kv = None
        if not self.evicted:
            self._n -= n
            self.offset -= n
            if (self._needs_filter and self.filter is not None
                    and self.offset < self.config.qfilters_calib_tokens):
                self.filter = None
                self.scores = mx.zeros_like(self.scores)  # unscored again, as before calibration
            if self._queries is not None:
                self._queries = self._queries[:, :, : self.offset]
            self._journal.drop_tail(n)
            return n
        left = n
        while left > 0:
            rec = self._journal.pop()
            if isinstance(rec, StepRecord):
                self._undo_step(rec)
                left -= 1
                continue
            if isinstance(rec, LayoutRecord):
                self._undo_layout(rec)
                continue
            redo = None
            if rec.tokens > left:  # the rewind ends inside this call: re-apply its head
                m = rec.tokens - left
                redo = self._call_rows(rec, m)
            self._undo_call(rec)
            if redo is not None:
                self._update(redo[0], redo[1])
                if rec.observed is not None:
                    self.observe_queries(rec.observed[:, :, :m])
                left = 0
            else:
                left -= rec.tokens
        mx.async_eval([a for a in (self.keys, self.values, self.scores, self.positions,
                                   self._victim_rows) if a is not None])
        return n

    def _call_rows(self, rec: CallRecord, m: int) -> tuple:
        """The K/V rows ``[B, H, m, D]`` of the first ``m`` tokens of the newest call."""
        if rec.dropped is None:  # nothing evicted by the call: its rows follow the old ones
            return self.keys[:, :, rec.n : rec.n + m], self.values[:, :, rec.n : rec.n + m]
        pool = self._pool(rec)
        k, v, _, _ = rows_between(pool, rec.offset, rec.offset + m, m)
        return k, v

    def _pool(self, rec: CallRecord) -> tuple:
        live = (self.keys, self.values, self.scores, self.positions)
        return tuple(mx.concatenate([a[:, :, : self._n], d], axis=2) for a, d in zip(live, rec.dropped))

    def _undo_call(self, rec: CallRecord) -> None:
        """Undo the newest multi-token call (the cache is in its post-call state)."""
        if rec.dropped is not None:
            rows = rows_between(self._pool(rec), -1, rec.offset, rec.n)
            if rec.slots is None:  # the buffers' size before the call (step blocks: before the
                # first eviction, compress-once growth); a slot layout is rebuilt below
                rows = tuple(pad_rows(a, rec.capacity) for a in rows)
            self.keys, self.values, self.scores, self.positions = rows
        if self._needs_filter and rec.filter is None and self.filter is not None:
            self.scores = mx.zeros_like(self.scores)  # the old rows were never scored
        self.filter = rec.filter
        self._queries = rec.queries
        self.evicted = rec.evicted
        self.offset = rec.offset
        self._n = rec.n
        if rec.slots is not None:  # the call started in slot mode
            self._undo_layout(LayoutRecord(rec.slots))

    def _note_observed(self, queries) -> None:
        """Keep this call's queries in its journal record (re-applied on a partial rewind)."""
        record = self._journal.last() if self._journal.active else None
        if isinstance(record, CallRecord) and record.offset + record.tokens == self.offset:
            record.observed = queries
