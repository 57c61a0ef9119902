"""Rewind journal: exact ``trim`` of the newest tokens after an eviction.

mlx-lm rewinds rejected draft tokens with ``trim(n)`` (speculative decoding) and
trims fetched prompt caches to a shared prefix (``LRUPromptCache``). Before the
first eviction every row is still stored and ``trim`` just drops rows. After
it, each call may have overwritten or evicted rows, so the cache keeps, for its
last calls covering at least ``max_rewind`` tokens, one record per call
that undoes it exactly (:class:`CallRecord`, :class:`StepRecord`). A rewind of
``n`` tokens undoes whole records, newest first, and when ``n`` ends inside a
multi-token call it re-applies that call's first tokens (kept in the record)
through the same code path, so the result is bit-identical to a cache that
never saw the rewound tokens: keys, values, scores, positions, slot layout,
``offset``, ``kept_positions()`` and the next outputs.

What a record holds (``B, H = batch, KV heads``; bytes are counted in ``nbytes``):

* a slot-mode decode step (:class:`StepRecord`): the slot it wrote, ``[B, H]``
  int32, and the rows that slot held before (the previous step's victim: K/V
  ``[B, H, 1, D]``, score ``[B, H, 1]`` float32, position ``[B, H, 1]`` int64):
  ``B H (4 + (D_k + D_v) itemsize + 12)`` bytes per step and layer. The rows
  are gathered when the victim is chosen and evaluated with the step's outputs
  (``mx.depends``), so the next in-place ``write_slot`` still reuses the buffer
  (no copy of the whole buffer per step). The step that enters slot mode keeps
  the scores/positions buffers before it instead (``12 B H capacity`` bytes:
  the budget's rows, or a 256-row step block under compress-once growth).
* a multi-token call (:class:`CallRecord`): the rows its eviction dropped
  (``[B, H, E, *]``, ``E`` = rows before + ``L`` - budget; with the rows kept
  they hold the call's own tokens, re-applied on a partial rewind), the slot
  layout it left (the temporal order ``[B, H, S-1]``, the free slot ``[B, H]``
  and that slot's rows) and the scalars before it (offset, rows, eviction flag,
  filter, first queries; the queries it was observed with while the filter is
  estimated from queries).

A rewind deeper than the journal raises ``ValueError`` before changing
anything. Saved prompt caches do not carry the journal: a reloaded cache
rewinds only what it has seen since it was loaded.

This module holds the records, :class:`RewindJournal` (the records of the newest calls;
at rest, runs of decode steps packed: :mod:`.journal_runs`) and what undoing one record
gives back from the cache's row arrays ``rows = (keys, values, scores, positions)`` (each
``[B, H, capacity, ...]``; :func:`undo_step`, :func:`undo_layout`, :func:`undo_call_rows`,
:func:`call_head_rows`; the row functions they use: :mod:`.journal_rows`).
``QFiltersKVCache.trim`` (:mod:`qfilters_mlx.cache.kv_cache`) pops the records and applies
these.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from qfilters_mlx.cache.journal_rows import pad_rows, rows_between, to_slots
from qfilters_mlx.cache.journal_runs import StepRun, pack_runs


@dataclass
class StepRecord:
    """Undo data of one slot-mode decode step (see module docstring)."""

    free: mx.array | None  # [B, H] slot written; None: the step entered slot mode
    rows: tuple | None  # (k, v, score, pos) the slot held; None: dead content
    n: int  # live rows before the step
    scores: mx.array | None = None  # [B, H, capacity] float32 buffer before a step entering slot mode
    positions: mx.array | None = None  # [B, H, capacity] int64 buffer before a step entering slot mode
    tokens: int = 1


@dataclass
class CallRecord:
    """Undo data of one multi-token call (see module docstring)."""

    tokens: int
    offset: int
    n: int
    evicted: bool
    filter: mx.array | None
    queries: mx.array | None  # the cache's first queries before the call
    slots: tuple | None = None  # (order [B,H,S-1], free [B,H], free-slot rows) if it left slot mode
    dropped: tuple | None = None  # (k, v, score, pos) rows the eviction dropped
    observed: mx.array | None = None  # queries observed for this call (re-apply)
    capacity: int = 0  # buffer rows before the call (restored when it exceeds ``n``: step blocks)


@dataclass
class LayoutRecord:
    """Undo data of a switch from slot mode to temporal order outside a call
    (``kept_positions()``, window masks): the slot layout left."""

    slots: tuple  # (order [B,H,S-1], free [B,H], free-slot rows)
    tokens: int = 0


def _nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(a) for a in x)
    return x.nbytes if isinstance(x, mx.array) else 0


class RewindJournal:
    """The records of the newest calls covering at least ``depth`` tokens."""

    def __init__(self, depth: int):
        self.depth = int(depth)
        self.records: deque = deque()
        self.tokens = 0  # tokens covered by the records

    @property
    def active(self) -> bool:
        return self.depth > 0

    @property
    def rewindable(self) -> int:
        """Tokens a rewind may remove after an eviction: ``min(depth, tokens journaled)``."""
        return min(self.depth, self.tokens)

    def push(self, record) -> None:
        self.records.append(record)
        self.tokens += record.tokens
        while len(self.records) > 1 and self.tokens - self.records[0].tokens >= self.depth:
            self.tokens -= self.records.popleft().tokens

    def pop(self):
        rec = self.records[-1]
        if isinstance(rec, StepRun):  # (its newest step; the run goes with its last one)
            free, rows, n = rec.pop_last()
            if not rec.n:
                self.records.pop()
            self.tokens -= 1
            return StepRecord(free=free, rows=rows, n=n)
        self.records.pop()
        self.tokens -= rec.tokens
        return rec

    def pack_steps(self) -> None:
        """Hold each run of consecutive slot-mode decode steps as one :class:`StepRun`
        (same undo data, stacked: five arrays per run instead of five per step)."""
        self.records = deque(pack_runs(self.records, lambda r: isinstance(r, StepRecord) and r.tokens == 1
                                       and r.free is not None and r.rows is not None))

    def calls_newest_first(self):
        """``(tokens, K/V rows)`` of each recorded call, newest first (a packed step run
        gives one ``(1, 1)`` per step: its steps are calls)."""
        for r in reversed(self.records):
            if isinstance(r, StepRun):
                yield from ((1, 1) for _ in range(r.tokens))
            else:
                yield r.tokens, record_rows(r)

    def last(self):
        return self.records[-1] if self.records else None

    def clear(self) -> None:
        self.records.clear()
        self.tokens = 0

    def keep_rows(self, limit: int) -> None:
        """Forget the oldest records until the K/V rows the journal holds (:func:`record_rows`)
        are at most ``limit``; the rewind reach shrinks to the tokens the rest cover.

        Raises:
            ValueError: ``limit < 0``.
        """
        if limit < 0:
            raise ValueError(f"keep_rows: limit must be >= 0, got {limit}")
        held = self.rows
        while self.records and held > limit:
            old = self.records[0]
            if isinstance(old, StepRun) and old.tokens > held - limit:
                old.drop_oldest(held - limit)
                self.tokens -= held - limit
                break
            self.records.popleft()
            held -= record_rows(old)
            self.tokens -= old.tokens

    @property
    def rows(self) -> int:
        """K/V rows the records hold (:func:`record_rows`)."""
        return sum(record_rows(r) for r in self.records)

    def arrays(self) -> list:
        """Every array the records hold (``None`` entries left out), oldest record first."""
        out = []
        self.map_arrays(lambda a: out.append(a) or a)
        return out

    def map_arrays(self, fn) -> None:
        """Replace every array the records hold by ``fn(array)`` (same shape and values:
        e.g. ``mx.contiguous``, which copies a view out of a larger buffer)."""
        for r in self.records:
            if isinstance(r, StepRecord):
                r.free, r.rows, r.scores, r.positions = (
                    _map(fn, x) for x in (r.free, r.rows, r.scores, r.positions))
            elif isinstance(r, StepRun):
                r.free, r.rows = _map(fn, r.free), _map(fn, r.rows)
            elif isinstance(r, LayoutRecord):
                r.slots = _map(fn, r.slots)
            else:
                r.filter, r.queries, r.slots, r.dropped, r.observed = (
                    _map(fn, x) for x in (r.filter, r.queries, r.slots, r.dropped, r.observed))

    def drop_tail(self, n: int) -> None:
        """Forget the newest ``n`` tokens (a plain trim before any eviction)."""
        while n > 0 and self.records:
            rec = self.records[-1]
            if rec.tokens <= n or isinstance(rec, StepRun):  # (a LayoutRecord only exists
                n -= self.pop().tokens  # after an eviction; a run gives its steps one by one)
                continue
            keep = rec.tokens - n
            if rec.observed is not None:
                rec.observed = rec.observed[:, :, :keep]
            rec.tokens, self.tokens, n = keep, self.tokens - n, 0

    @property
    def nbytes(self) -> int:
        total = 0
        for r in self.records:
            if isinstance(r, StepRecord):
                total += _nbytes((r.free, r.rows, r.scores, r.positions))
            elif isinstance(r, StepRun):
                total += _nbytes((r.free, r.rows))
            elif isinstance(r, LayoutRecord):
                total += _nbytes(r.slots)
            else:
                total += _nbytes((r.slots, r.dropped, r.observed))
        return total


def _map(fn, x):
    if x is None or not isinstance(x, (tuple, list, mx.array)):
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, a) for a in x)
    return fn(x)


def record_rows(record) -> int:
    """K/V rows (per batch row and KV head) a record holds: a decode step's victim row, a
    call's dropped rows, the free-slot row of a slot layout it left. Scores, positions,
    slot indices and filters are not rows (a few bytes per row; counted in ``nbytes``)."""
    if isinstance(record, StepRecord):
        return 0 if record.rows is None else 1
    if isinstance(record, StepRun):
        return record.tokens
    slots = record.slots
    rows = 0 if slots is None or slots[2] is None else 1
    if isinstance(record, CallRecord) and record.dropped is not None:
        keys = record.dropped[0]
        rows += (keys[0] if isinstance(keys, tuple) else keys).shape[2]
    return rows


def _put_slot(a: mx.array, free: mx.array, rows: mx.array) -> mx.array:
    return mx.put_along_axis(a, free[:, :, None, None] if a.ndim == 4 else free[:, :, None], rows, axis=2)


def undo_step(rows: tuple, record: StepRecord, write_slot) -> tuple:
    """``(rows, free, victim rows)`` before the slot-mode decode step ``record`` undoes
    (``rows`` after it; ``write_slot``: the backend's in-place K/V slot write). A step that
    entered slot mode drops the spare slot (``free`` None) and gets back the buffers'
    size before it; any other puts back the rows its slot held (when they were kept)."""
    keys, values, scores, positions = rows
    if record.free is None:  # the step entered slot mode: drop the spare slot
        n, cap = record.n, record.scores.shape[2]  # (cap: the buffers' rows before the step)
        rows = (pad_rows(keys[:, :, :n], cap), pad_rows(values[:, :, :n], cap),
                record.scores, record.positions)
        return rows, None, record.rows
    f = record.free
    if record.rows is not None:  # (else the slot's old content was never needed)
        k, v, sc, p = record.rows
        rows = (write_slot(keys, k, f), write_slot(values, v, f),
                mx.put_along_axis(scores, f[:, :, None], sc, axis=2),
                mx.put_along_axis(positions, f[:, :, None], p, axis=2))
    return rows, f, record.rows


def undo_layout(rows: tuple, n: int, slots: tuple) -> tuple:
    """``(rows, free, victim rows)``: the ``n`` temporal rows back in the slot layout
    ``slots = (order, free, free-slot rows)`` that a :class:`LayoutRecord` (or a
    :class:`CallRecord` that started in slot mode) left."""
    order, free, victim = slots
    rows = to_slots(tuple(a[:, :, :n] for a in rows), order)
    if victim is not None:  # the free slot's rows (needed if a deeper step is undone)
        rows = tuple(_put_slot(a, free, r) for a, r in zip(rows, victim))
    return rows, free, victim


def _pool(rows: tuple, n: int, record: CallRecord) -> tuple:
    """The ``n`` live rows followed by the rows the call's eviction dropped."""
    return tuple(mx.concatenate([a[:, :, :n], d], axis=2) for a, d in zip(rows, record.dropped))


def undo_call_rows(rows: tuple, n: int, record: CallRecord) -> tuple:
    """The row arrays before the multi-token call ``record`` (``rows`` after it, ``n`` live):
    unchanged when the call evicted nothing, else its ``record.n`` rows before the call in
    temporal order, padded to the buffers' size then (when it did not start in slot mode)."""
    if record.dropped is None:
        return rows
    before = rows_between(_pool(rows, n, record), -1, record.offset, record.n)
    if record.slots is None:  # the buffers' size before the call (step blocks: before the
        # first eviction, compress-once growth); a slot layout is rebuilt by undo_layout
        before = tuple(pad_rows(a, record.capacity) for a in before)
    return before


def call_head_rows(rows: tuple, n: int, record: CallRecord, m: int) -> tuple:
    """The K/V rows ``[B, H, m, D]`` of the first ``m`` tokens of the call ``record``
    (``rows`` after it, ``n`` live): re-applied when a rewind ends inside the call."""
    keys, values = rows[:2]
    if record.dropped is None:  # nothing evicted by the call: its rows follow the old ones
        return keys[:, :, record.n : record.n + m], values[:, :, record.n : record.n + m]
    k, v, _, _ = rows_between(_pool(rows, n, record), record.offset, record.offset + m, m)
    return k, v
