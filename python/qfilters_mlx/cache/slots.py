"""Slot mode: single-token decode steps after an eviction (mixin of ``QFiltersKVCache``).

Once full, the cache holds ``budget + 1`` slots per (batch row, KV head), all
attended to, one of which (``_free [B, H]`` int32) the next token overwrites
(attention does not depend on key order; the kept set is the one
:func:`reference.select_keep` gives, see :func:`reference.decode_select`). A
step scores one key (``B * H_kv * D`` multiply-adds), writes its K/V row into
the free slot (``write_slot``, in place in the cpp backend: ``2 * B * H_kv * D
* itemsize`` bytes), and finds the next slot to free with one ``O(budget)``
scan of the scores per (row, head), copying the float32 scores and int64
positions (``12 * B * H_kv * (budget + 1)`` bytes). No K/V compaction, no sort.

The free slot's content is never read (the next step overwrites it first; a
multi-token call drops it). With a rewind journal (:mod:`.journal`) a step also
gathers the rows of the slot it just freed (K/V, score, position: for the
journal's record of the next step), evaluated together with the returned keys
through ``mx.depends``: the gathers then never hold the buffers when the next
``write_slot`` runs, so that write stays in place.

Any multi-token call, ``kept_positions()`` or a window mask first puts the rows
back in temporal order (:meth:`SlotModeMixin._leave_slots`: one argsort +
gather, ``O(budget log budget)``; outside a call the journal records the
switch so that rewinds stay exact); ``state`` reads a temporal view
(:meth:`SlotModeMixin._temporal`) without changing the layout.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.cache.journal import LayoutRecord, StepRecord, pad_rows, to_slots
from qfilters_mlx.cache.scorers import insertion_scores

_BIG = 2**62


def _take(buf: mx.array, order: mx.array) -> mx.array:
    return mx.take_along_axis(buf, order[..., None] if buf.ndim == 4 else order, axis=2)


class SlotModeMixin:
    """Decode steps in slot mode (see the module docstring) and the attention mask."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Attention mask for ``N`` new queries over the ``size() + N`` keys returned next.

        Stored tokens all precede the new ones, so the causal mask is
        bottom-right aligned: ``"causal"`` (``None`` for ``N == 1``: nothing to
        mask), or a boolean ``[N, size() + N]`` array when ``return_array``
        (also for ``N == 1``). With
        ``window_size`` the mask is built from absolute positions, which is
        possible while every head stores the same positions (before any
        eviction, so always for ``full``, and for ``streaming_llm``).

        Raises:
            ValueError: ``window_size`` after a per-head eviction.
        """
        from mlx_lm.models.base import create_causal_mask  # (lazily: importing mlx_lm runs our hook)

        S = self._n
        if window_size is None:
            if return_array:
                return create_causal_mask(N, S)
            return None if N == 1 else "causal"
        if not self.evicted:
            return create_causal_mask(N, S, window_size=window_size)
        if self.method != "streaming_llm":
            raise ValueError(
                "window_size masks are not supported after per-head eviction "
                f"(method={self.method!r}); use the model's own cache for sliding-window layers"
            )
        self._to_temporal()
        q = self.offset + mx.arange(N)[:, None]
        k = mx.concatenate([self.positions[0, 0, :S], self.offset + mx.arange(N)])[None]
        return (k <= q) & (k > q - window_size)

    def _slot_order(self) -> mx.array:
        """``[B, H, S-1]`` int32: the live slots in ascending position (free slot excluded)."""
        S = self.keys.shape[2]
        slot = mx.arange(S, dtype=mx.int32)[None, None, :]
        key = mx.where(slot == self._free[:, :, None], mx.array(_BIG, mx.int64), self.positions)
        return mx.argsort(key, axis=2)[:, :, : S - 1].astype(mx.int32)

    def _temporal(self) -> tuple:
        """``(keys, values, scores, positions)``: the live rows in temporal order
        (``[B, H, size(), ...]``; ``None`` while empty), leaving the layout as it is."""
        arrays = (self.keys, self.values, self.scores, self.positions)
        if self._free is None:
            return tuple(None if a is None else a[:, :, : self._n] for a in arrays)
        order = self._slot_order()
        return tuple(_take(a, order) for a in arrays)

    def _leave_slots(self):
        """Back from slot mode to ``budget`` rows in temporal order (drops the free slot).

        Returns ``(order, free, free-slot rows)`` (what a rewind needs to come
        back to the slot layout), or ``None`` when not in slot mode.
        """
        if self._free is None:
            return None
        order = self._slot_order()
        layout = (order, self._free, self._victim_rows)
        arrays = (self.keys, self.values, self.scores, self.positions)
        self.keys, self.values, self.scores, self.positions = (_take(a, order) for a in arrays)
        self._n = order.shape[2]
        self._free = None
        self._victim_rows = None
        return layout

    def _to_temporal(self) -> None:
        """Leave slot mode outside a call (recorded in the journal, 0 tokens)."""
        layout = self._leave_slots()
        if layout is not None and self._journal.active:
            self._journal.push(LayoutRecord(layout))

    def _undo_layout(self, record: LayoutRecord) -> None:
        """Back to the slot layout a :class:`LayoutRecord` left."""
        order, free, rows = record.slots
        arrays = (self.keys, self.values, self.scores, self.positions)
        arrays = to_slots(tuple(a[:, :, : self._n] for a in arrays), order)
        if rows is not None:  # the free slot's rows (needed if a deeper step is undone)
            arrays = tuple(mx.put_along_axis(a, free[:, :, None, None] if a.ndim == 4 else free[:, :, None],
                                             r, axis=2) for a, r in zip(arrays, rows))
        self.keys, self.values, self.scores, self.positions = arrays
        self._free, self._victim_rows = free, rows

    def _decode_step(self, keys, values):
        """Single-token update once the cache is full: write the token into the free
        slot (``backend.write_slot``, in place in the cpp backend), score it and pick
        the next slot to free (``backend.decode_select_keys`` for Q-Filters: one
        primitive in the cpp backend; ``decode_select`` of the method's score otherwise)."""
        c = self.config
        _, n_sink, recent = self._limits_now()  # (compress-once growth limit: .compression)
        entering = self._free is None
        record = None  # journaled only when rewinds are on (the default, depth 0, skips it)
        if self._journal.active:
            record = StepRecord(free=self._free, rows=self._victim_rows, n=self._n,
                                scores=self.scores if entering else None,
                                positions=self.positions if entering else None)
        if self._free is None:  # enter slot mode: one spare row after the kept ones
            n = self._n
            spare = lambda buf: mx.concatenate([buf[:, :, :n], buf[:, :, :1]], axis=2)  # noqa: E731
            self.keys, self.values = spare(self.keys), spare(self.values)
            self.scores, self.positions = spare(self.scores), spare(self.positions)
            B, H = self.keys.shape[:2]
            self._free = mx.full((B, H), n, dtype=mx.int32)
        free, be = self._free, self.backend
        stored_k, stored_v = self._store_rows(keys, values)  # (packed when quantized)
        self.keys = be.write_slot(self.keys, stored_k, free)
        self.values = be.write_slot(self.values, stored_v, free)
        if self.method == "qfilters":  # score + bookkeeping in one op (cpp)
            self.scores, self.positions, self._free = be.decode_select_keys(
                self.scores, self.positions, keys, self.filter, free, self.offset,
                c.score_sign, n_sink, recent,
            )
        else:
            pos = None
            if self.method in ("random", "streaming_llm"):
                pos = mx.full((*keys.shape[:2], 1), self.offset, dtype=mx.int64)
            new_scores = insertion_scores(
                c.method, keys, pos, filters=self.filter, sign=c.score_sign,
                seed=c.qfilters_seed, layer=self.layer_idx, backend=be, finite=False,
            )
            self.scores, self.positions, self._free = be.decode_select(
                self.scores, self.positions, new_scores, free, self.offset,
                n_sink, recent,
            )
        self.offset += 1
        if record is None:
            return self.keys, self.values
        self._journal.push(record)
        idx = self._free[:, :, None]
        rows = tuple(_take(a, idx) for a in (self.keys, self.values, self.scores, self.positions))
        self._victim_rows = rows
        return mx.depends([self.keys], list(rows))[0], self.values

    def _undo_step(self, record: StepRecord) -> None:
        """Undo the newest decode step (``record`` is its journal entry)."""
        if record.free is None:  # the step entered slot mode: drop the spare slot
            n, cap = record.n, record.scores.shape[2]  # (cap: the buffers' rows before the step)
            self.keys, self.values = pad_rows(self.keys[:, :, :n], cap), pad_rows(self.values[:, :, :n], cap)
            self.scores, self.positions = record.scores, record.positions
            self._free = None
        else:
            f = record.free
            if record.rows is not None:  # (else the slot's old content was never needed)
                k, v, sc, p = record.rows
                self.keys = self.backend.write_slot(self.keys, k, f)
                self.values = self.backend.write_slot(self.values, v, f)
                self.scores = mx.put_along_axis(self.scores, f[:, :, None], sc, axis=2)
                self.positions = mx.put_along_axis(self.positions, f[:, :, None], p, axis=2)
            self._free = f
        self._victim_rows = record.rows
        self.offset -= 1
