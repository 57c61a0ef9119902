"""``QFiltersKVCache``: a fixed-budget eviction cache implementing mlx-lm's cache protocol,
and its sibling ``QuantizedQFiltersKVCache`` (the same cache storing K/V quantized).

Data flow of one ``update_and_fetch(keys, values)`` call:

1. validate (before touching state; :func:`.inputs.check_update`);
2. if the Q-Filter does not exist yet and ``tokens_seen + L >= calib_tokens``,
   estimate it from exactly the first ``calib_tokens`` keys ever seen, freeze
   it, and score every stored token (:meth:`QFiltersKVCache._calibrate`);
3. score the new tokens once by the method's scorer (:mod:`qfilters_mlx.scorers`: Q-Filters
   ``sign * <k, u>``, float32); scores never change;
4. return ``stored ++ new``: every token of this call is visible to this call's queries;
5. then evict down to ``budget`` per (batch row, KV head): the first ``n_sink``
   and last ``recent`` positions are kept, the rest by highest score (ties:
   earlier position), temporal order preserved;
6. ``offset += L`` (absolute RoPE position, never the stored length).

The kept set does not depend on how the input was chunked. Single-token calls after an
eviction run in *slot mode* (``_decode_step``).

Longer than 350 lines because this one file holds the whole hot path (update, eviction,
slot-mode decode step) so that it reads top to bottom. What one ``update_and_fetch`` computes
reads in three places: this file (``update_and_fetch -> _update -> _append / _decode_step ->
_evict``), the method's scorer (:mod:`qfilters_mlx.scorers`: ``base.py`` and the method's
file) and :mod:`qfilters_mlx.backends.reference`, the semantics of the backend operations it
calls (``select_compact``, ``write_slot``, ``decode_select``; the backend chosen at
construction runs them, :mod:`qfilters_mlx.backends.dispatch`). Besides, each call passes its
inputs to :func:`.inputs.check_update` (raises before anything changes) and its rows through
the storage (:class:`~qfilters_mlx.cache.dense.DenseRows`: as given); the compress-once
trigger runs only in that mode, the journal records only when rewinds are on. The cache
knows no method name.

The cache's state has a shape (:mod:`.rows`): the live rows are one value, ``rows``
(:class:`~qfilters_mlx.cache.rows.Rows`: keys, values, scores, positions), that the components
take and return; what an eviction keeps is ``limits`` (budget, sinks, recent window, mode),
resolved from the configuration at setup, load and compression, not on every call; the
streaming eviction and the compression run the one routine ``_evict``
(:func:`.rows.evict`).

Off that path, named calls into component modules that read and write the cache's own
state, as nothing else does: :mod:`.rewind` (``trim``, ``is_trimmable``),
:mod:`.compression` (``compress``), :mod:`.calibration` (online filters), :mod:`.accounting`
(bytes, ``shrink_to_fit``), :mod:`.persistence` (``state``, copies), :mod:`.attention` (the
mask, ``keys_and_values``), :mod:`.quantized` (the sibling's storage).
"""

from __future__ import annotations

import math
from operator import attrgetter

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import _BaseCache

from qfilters_mlx.backends.dispatch import get_backend
import qfilters_mlx.cache.accounting as accounting
import qfilters_mlx.cache.compression as compression
import qfilters_mlx.cache.persistence as persistence
import qfilters_mlx.cache.rewind as rewind
from qfilters_mlx.cache.calibration import checked_filters, estimate_filter, observe_queries
from qfilters_mlx.cache.inputs import check_update
from qfilters_mlx.cache.dense import DenseRows
from qfilters_mlx.cache.journal import CallRecord, LayoutRecord, RewindJournal, StepRecord
from qfilters_mlx.cache.journal_rows import dropped_rows
from qfilters_mlx.cache.attention import keys_and_values, make_mask
from qfilters_mlx.cache.quantized import QuantizedRows, check_quantization, quantized_copy
from qfilters_mlx.cache.rows import EMPTY, Rows, evict, resolve_limits
from qfilters_mlx.cache.speculative import guard_speculative
from qfilters_mlx.config import (DEFAULT_BACKEND, DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_REWIND,
                                 KVCacheConfig, check_int)
from qfilters_mlx.config.build import AUTO
from qfilters_mlx.scorers import insertion_scores, random_scores

__all__ = ["DenseRows", "QFiltersKVCache", "QuantizedQFiltersKVCache", "build_cache",
           "insertion_scores", "random_scores"]

_BIG = 2**62


class QFiltersKVCache(_BaseCache):
    """Eviction KV cache for one attention layer, K/V stored in the model's dtype.

    Args:
        config: a validated :class:`KVCacheConfig` (``method`` names the scorer,
            :mod:`qfilters_mlx.scorers`); quantized storage: :class:`QuantizedQFiltersKVCache`,
            or :func:`build_cache`, which picks the class.
        layer_idx: index of the layer (seeds the ``random`` arm).
        filters: this layer's fixed Q-Filter ``[H_kv, D]`` (any float dtype, stored
            float32; score ``sign * <k, f>``): eviction starts at the first call. Needed
            with ``qfilters_filter_source="calibrated"``; ``None`` for the online filters.
        backend: kernel backend name (``"auto"``, ``"reference"``, ``"cpp"``, ``"metal"``);
            ``None``: the default (``"auto"``).
        max_rewind: tokens ``trim`` can rewind exactly after an eviction (the rewind
            journal, :mod:`.journal`); ``None``: the default (``"auto"``).

    Attributes:
        offset: absolute number of tokens fed (the RoPE position of the next token).
        scorer: the method's :class:`~qfilters_mlx.scorers.Scorer` for this layer.
        filter: ``[H_kv, D]`` float32 Q-Filter once calibrated, else ``None``.
        rows: the live rows, one :class:`~qfilters_mlx.cache.rows.Rows` value (``keys``,
            ``values``: ``[B, H_kv, capacity, D]`` buffers, rows ``[0, size())`` live;
            ``scores``: ``[B, H_kv, capacity]`` float32 insertion scores; ``positions``: int64
            absolute positions); ``keys``, ``values``, ``scores``, ``positions`` read them.
        limits: what the next eviction keeps (:class:`~qfilters_mlx.cache.rows.Limits`),
            resolved at setup, load and compression.
        recent_window: this layer's recent window (one int, or ``H_kv`` ints).
        backend: the resolved kernel backend; max_rewind: the rewind depth.
        storage: how rows are stored (:class:`DenseRows` here).
        keep_last_kv: keep what the last update returned for :meth:`keys_and_values`
            (layers whose K/V another layer reads; set by ``KVCacheBuilder.for_model``).

    Raises:
        TypeError: ``config`` is not a :class:`KVCacheConfig`.
        ValueError: the backend is not available; ``filters`` is ``None`` with
            ``qfilters_filter_source="calibrated"`` (the default: those filters come from
            ``KVCacheBuilder.for_model``); ``max_rewind < 0``.
    """

    step = 256  # rows a buffer grows by (mlx-lm's KVCache: 256)
    compressed_step = 32  # ... after a compression (the kept rows are the bulk: less slack)
    quantized = False  # the class stores K/V quantized (has ``bits``/``group_size``)

    def __init__(self, config: KVCacheConfig, layer_idx: int = 0, filters: mx.array | None = None,
                 *, backend: str | None = None, max_rewind: int | None = None):
        self._setup(config, layer_idx, filters, backend, max_rewind)

    def _setup(self, config, layer_idx, filters, backend, max_rewind, bits=None, group_size=None):
        """``__init__`` of both classes (``None``: each option's default)."""
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        filters = checked_filters(config, filters)
        guard_speculative()  # (mlx-lm's speculative decoding asks draft caches too)
        backend = DEFAULT_BACKEND if backend is None else backend
        max_rewind = DEFAULT_MAX_REWIND if max_rewind is None else max_rewind
        if max_rewind != AUTO:
            check_int("max_rewind", max_rewind, 0)
        if self.quantized:
            group_size = DEFAULT_KV_GROUP_SIZE if group_size is None else group_size
            if bits is None:
                raise ValueError(f"{type(self).__name__} needs bits= (2, 4 or 8), got None")
            check_quantization(bits, group_size, max_rewind, config.head_dim)
            self.bits, self.group_size = bits, group_size
            self.storage = QuantizedRows(bits, group_size)
        else:
            self.storage = DenseRows()
        self.config = config
        self.layer_idx = int(layer_idx)
        self.scorer = config.scorer.from_config(config, self.layer_idx)
        self.backend = get_backend(backend)
        self._backend_name = backend  # as requested ("auto" stays "auto" in saved files)
        self.max_rewind = AUTO if max_rewind == AUTO else int(max_rewind)
        self.filter_fixed = filters is not None  # given from outside: no calibration
        self.queries_observed = False  # set by observe_queries() while it is active
        self._queries_pending = False  # an update's queries have not arrived yet
        self._queries = None  # [B, H_q, <=calib, D] first calib_tokens queries
        self.rows = EMPTY
        self.filter = filters
        self.offset = 0
        self._n = 0  # live rows
        self.evicted = False
        self._free = None  # slot mode: [B, H] the slot the next token overwrites
        self._journal = RewindJournal(rewind.depth_now(self))  # exact `trim` after an eviction
        self._victim_rows = None  # (the free slot's rows, for the journal)
        self._compressed = None  # compress-once: (K, offset) of the compression once done
        self.resolve_limits()
        self._saw_chunk = False  # a multi-token call was seen (the `prompt_end` trigger)
        # what the last update returned, kept only for layers whose K/V another layer reads
        # (keys_and_values; otherwise it would keep a chunk's pre-eviction rows alive)
        self.keep_last_kv, self._last_kv = False, None

    # ------------------------------------------------------------------ helpers
    @property
    def method(self) -> str:
        """The method's registered name (``config.method``)."""
        return self.config.method

    # the live rows' arrays, read from the one value ``rows`` (:class:`~.rows.Rows`)
    keys = property(attrgetter("rows.keys"), doc="``rows.keys``: ``[B, H_kv, capacity, D]``.")
    values = property(attrgetter("rows.values"), doc="``rows.values``: ``[B, H_kv, capacity, D]``.")
    scores = property(attrgetter("rows.scores"), doc="``rows.scores``: ``[B, H_kv, capacity]`` float32.")
    positions = property(attrgetter("rows.positions"), doc="``rows.positions``: ``[B, H_kv, capacity]``.")

    @property
    def _needs_filter(self) -> bool:
        return self.scorer.uses_filter and not self.filter_fixed

    @property
    def _calibrates_from_queries(self) -> bool:
        return self._needs_filter and self.config.needs_queries

    @property
    def needs_queries(self) -> bool:
        """Whether the cache still waits for queries (query-based filter not estimated yet)."""
        return self.filter is None and self._calibrates_from_queries  # (asks config only before)

    @property
    def scoring_ready(self) -> bool:
        """Whether new tokens can be scored (the filter exists, or none is needed)."""
        return not self._needs_filter or self.filter is not None

    # ------------------------------------------------------------ cache protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Insert ``L`` new tokens and return the keys/values this call attends to.

        Args:
            keys, values: ``[B, H_kv, L, D]`` (RoPE already applied to keys at
                positions ``offset .. offset + L - 1``).

        Returns:
            ``(keys, values)``: ``[B, H_kv, S + L, D]`` where ``S = size()`` before
            the call; the last ``L`` rows are this call's tokens. A
            ``QuantizedQFiltersKVCache`` returns ``(packed, scales, biases)`` for each
            (:mod:`.quantized`).

        Raises:
            TypeError, ValueError: bad rank, dtype, shape change, ``L == 0``;
                raised before any state changes.
        """
        check_update(self, keys, values)
        return self._fetch(keys, values)

    def _fetch(self, keys, values):
        """``update_and_fetch`` of inputs already checked (a head-group cache checks every
        group's before any group changes)."""
        self._last_kv = None  # released before the buffers are written
        if self.limits.once:  # the `prompt_end` trigger, before anything is stored
            compression.before_call(self, keys.shape[2])
        out = self.storage.fetch(*self._update(keys, values))
        if self.keep_last_kv:
            self._last_kv = out
        return out

    def _update(self, keys, values):
        """``update_and_fetch`` after validation, returning the stored rows (also re-applies
        calls on a rewind)."""
        L = keys.shape[2]
        if L == 1 and self.evicted and not self._growing():
            return self._decode_step(keys, values)
        if self._journal.active:  # (rewinds on: the record that undoes this call)
            record = CallRecord(tokens=L, offset=self.offset, n=self._n, evicted=self.evicted,
                                filter=self.filter, queries=self._queries,
                                capacity=0 if self.rows.keys is None else self.rows.keys.shape[2])
            record.slots = self._leave_slots()
            self._journal.push(record)
        else:
            self._leave_slots()
        self._append(keys, values)
        self.offset += L
        if (not self.scoring_ready and not self._calibrates_from_queries
                and self.offset >= self.config.qfilters_calib_tokens):
            self._calibrate()
        n, r = self._n, self.rows
        out = r.keys[:, :, :n], r.values[:, :, :n]
        if self.scorer.evicts and self.scoring_ready and n > self.limits.budget:
            self._evict()
        # Positions (and scores before calibration) are read by no returned array:
        # schedule them so their graphs never grow across decode steps.
        mx.async_eval(self.rows.positions, self.rows.scores)
        return out

    def _append(self, keys, values) -> None:
        """Write the new rows after the live ones, growing buffers in ``step`` blocks
        (``compressed_step`` after a compression); a cache evicting to a fixed budget (the
        streaming one, or ``K + growth`` after a compression) grows to at most
        ``max(n + L, budget + 1)`` rows."""
        B, H, L, _ = keys.shape
        n = self._n
        pos = (mx.array(self.offset, dtype=mx.int64) + mx.arange(L, dtype=mx.int64))[None, None, :]
        pos = mx.broadcast_to(pos, (B, H, L))
        new_scores = self._score(keys, pos) if self.scoring_ready else None  # full-precision keys
        hold = self._needs_filter and not self.evicted and not self.scoring_ready
        keys, values = self.storage.store(keys, values, n, hold)
        r = self.rows
        if self.evicted and n + L > r.keys.shape[2] and not self._growing():
            # Steady state after eviction: exactly the rows needed, one copy of
            # the kept rows (the next eviction gathers them again anyway).
            cat = lambda buf, new: mx.concatenate([buf[:, :, :n], new], axis=2)  # noqa: E731
            self.rows = Rows(cat(r.keys, keys), cat(r.values, values), cat(r.scores, new_scores),
                             cat(r.positions, pos))
            self._n = n + L
            return
        if r.keys is None or n + L > r.keys.shape[2]:
            step = self.step if self._compressed is None else self.compressed_step
            cap = step * math.ceil((n + L) / step)
            if self.scorer.evicts and (budget := self.limits.budget) < math.inf:
                cap = min(cap, max(n + L, budget + 1))  # never over budget + chunk (of n + L)

            def grow(buf, new_shape, dtype):
                fresh = mx.zeros(new_shape, dtype)
                if buf is None or n == 0:
                    return fresh
                return mx.concatenate([buf[:, :, :n], fresh[:, :, n:]], axis=2)

            r = self.rows = Rows(grow(r.keys, (B, H, cap, keys.shape[3]), keys.dtype),
                                 grow(r.values, (B, H, cap, values.shape[3]), values.dtype),
                                 grow(r.scores, (B, H, cap), mx.float32),
                                 grow(r.positions, (B, H, cap), mx.int64))
        r.keys[:, :, n : n + L] = keys
        r.values[:, :, n : n + L] = values
        r.positions[:, :, n : n + L] = pos
        if new_scores is not None:
            r.scores[:, :, n : n + L] = new_scores
        self._n = n + L

    def _score(self, keys, positions):
        return self.scorer.insertion_scores(keys, positions, self.filter, self.backend)

    def _calibrate(self) -> None:
        """Freeze the filter from exactly the first ``calib_tokens`` keys (and, for
        query-based configs, queries; :func:`.calibration.estimate_filter`) and score all
        live rows. Called only before any eviction, when rows ``[0, calib_tokens)`` are
        the first ``calib_tokens`` tokens ever fed."""
        n, r = self._n, self.rows
        keys = self.storage.full_keys(r.keys, n)  # full precision (quantized: held apart)
        self.filter = estimate_filter(self.config, keys, self._queries)
        # (queries are kept until the first eviction: trim may undo this)
        r.scores[:, :, :n] = self._score(keys, r.positions[:, :, :n])
        self.storage.calibrated(n, self.config.qfilters_calib_tokens)

    def _evict(self, budget=None, n_sink=None, recent=None) -> None:
        """Keep the rows an eviction to ``budget`` keeps (:func:`.rows.evict`; ``None``: the
        :attr:`limits`): the streaming eviction after a call, and the compression
        (:func:`.compression.compress`). Notes the dropped rows in this call's rewind record."""
        if budget is None:
            budget, n_sink, recent, _ = self.limits
        n = self._n
        kept, rows = evict(self.backend, self.rows, n, budget, n_sink, recent)
        record = self._journal.last() if self._journal.active else None
        if isinstance(record, CallRecord) and record.dropped is None:  # this call's record
            record.dropped = dropped_rows(kept, self.rows.head(n))
        self.rows = rows
        self._n = kept.shape[2]
        self.evicted = True
        self._queries = None  # calibration is final (a rewind restores them from the journal)
        self.storage.evicted()

    # --------------------------------------------------------------- slot mode
    # Once full, the cache holds ``budget + 1`` slots per (batch row, KV head), all attended
    # to; ``_free [B, H]`` int32 is the one the next token overwrites (attention does not
    # depend on key order; the kept set is ``reference.select_keep``'s, see
    # ``reference.decode_select``). A step writes one K/V row in place (cpp backend) and scans
    # the scores once, ``O(budget)``: no compaction, no sort. With a rewind journal it also
    # gathers the freed slot's rows, evaluated with the returned keys (``mx.depends``) so that
    # the next ``write_slot`` stays in place. A multi-token call, ``kept_positions()`` or a
    # window mask first restores temporal order (``_leave_slots``: argsort + gather).
    def _decode_step(self, keys, values):
        """Single-token update once the cache is full: write the token into the free
        slot (``backend.write_slot``, in place in the cpp backend), score it and pick
        the next slot to free (the scorer's ``decode_select``: for Q-Filters one
        primitive in the cpp backend)."""
        _, n_sink, recent, _ = self.limits  # (compress-once: the growth limit's window)
        entering = self._free is None
        r = self.rows
        record = None  # journaled only when rewinds are on (the default, depth 0, skips it)
        if self._journal.active:
            record = StepRecord(free=self._free, rows=self._victim_rows, n=self._n,
                                scores=r.scores if entering else None,
                                positions=r.positions if entering else None)
        if entering:  # enter slot mode: one spare row after the kept ones
            n = self._n
            spare = lambda buf: mx.concatenate([buf[:, :, :n], buf[:, :, :1]], axis=2)  # noqa: E731
            r = Rows(*(spare(a) for a in r))
            B, H = r.keys.shape[:2]
            self._free = mx.full((B, H), n, dtype=mx.int32)
        free, be = self._free, self.backend
        stored_k, stored_v = self.storage.store(keys, values)  # (packed when quantized)
        k = be.write_slot(r.keys, stored_k, free)
        v = be.write_slot(r.values, stored_v, free)
        scores, positions, self._free = self.scorer.decode_select(
            be, r.scores, r.positions, keys, self.filter, free, self.offset, n_sink, recent)
        self.rows = Rows(k, v, scores, positions)
        self.offset += 1
        if record is None:
            return k, v
        self._journal.push(record)
        self._victim_rows = tuple(self.rows.take(self._free[:, :, None]))  # (a journal entry)
        return mx.depends([k], list(self._victim_rows))[0], v

    def _slot_order(self) -> mx.array:
        """``[B, H, S-1]`` int32: the live slots in ascending position (free slot excluded)."""
        S = self.rows.keys.shape[2]
        slot = mx.arange(S, dtype=mx.int32)[None, None, :]
        key = mx.where(slot == self._free[:, :, None], mx.array(_BIG, mx.int64), self.rows.positions)
        return mx.argsort(key, axis=2)[:, :, : S - 1].astype(mx.int32)

    def _temporal(self) -> Rows:
        """The live rows in temporal order (``[B, H, size(), ...]``; ``None`` while empty),
        leaving the layout as it is."""
        if self._free is None:
            return self.rows.head(self._n)
        return self.rows.take(self._slot_order())

    def _leave_slots(self):
        """Back from slot mode to ``budget`` rows in temporal order (drops the free slot).

        Returns ``(order, free, free-slot rows)`` (what a rewind needs to come
        back to the slot layout), or ``None`` when not in slot mode.
        """
        if self._free is None:
            return None
        order = self._slot_order()
        layout = (order, self._free, self._victim_rows)
        self.rows = self.rows.take(order)
        self._n = order.shape[2]
        self._free = None
        self._victim_rows = None
        return layout

    def resolve_limits(self) -> None:
        """Set ``recent_window`` (int, or H_kv per-head ints) and ``limits`` from the
        configuration and the compression done (``_compressed``): at setup, load and compression."""
        self.recent_window = self.config.layer_recent(self.layer_idx)
        done = None if self._compressed is None else self._compressed[0]
        self.limits = resolve_limits(self.config, self.recent_window, self.scorer.ranks, done)

    def _to_temporal(self) -> None:
        """Leave slot mode outside a call (recorded in the journal, 0 tokens)."""
        layout = self._leave_slots()
        if layout is not None and self._journal.active:
            self._journal.push(LayoutRecord(layout))

    make_mask = make_mask  # (.attention)

    # ------------------------------------------------------------ compress once
    # (mode=CompressOnce(...): the rule, the trigger and `compress` are in .compression;
    # the limits each call evicts to are `limits`, resolved there once)
    @property
    def compressed(self) -> bool:
        """Whether the cache has been compressed (compress-once mode)."""
        return self._compressed is not None

    def _growing(self) -> bool:
        """Whether single-token calls append (compress-once mode below its limit)
        instead of running slot-mode eviction steps."""
        return self.limits.once and self._n < self.limits.budget

    # compress-once (.compression), online calibration (.calibration)
    prepare_call = compression.before_call
    check_compress = compression.check_compress
    compress = compression.compress
    observe_queries = observe_queries

    # ----------------------------------------------------------------- rewinds (.rewind)
    is_trimmable = rewind.is_trimmable
    rewindable_tokens = property(rewind.rewindable_tokens)
    trim_count = rewind.trim_count
    trim = rewind.trim

    keys_and_values = keys_and_values  # (.attention)
    def size(self) -> int:
        """Number of tokens stored per (batch row, KV head)."""
        return self._n

    def empty(self) -> bool:
        return self.keys is None

    def kept_positions(self) -> mx.array:
        """``[B, H_kv, size()]`` int64 absolute positions of the stored tokens, ascending."""
        self._to_temporal()
        return self.rows.positions[:, :, : self._n]

    @classmethod
    def merge(cls, caches):
        """Batch per-sequence caches (mlx-lm's ``BatchGenerator``) into a
        :class:`~qfilters_mlx.cache.batch.BatchQFiltersCache` (imported here: importing
        :mod:`.batch` first imports mlx-lm's cache module, whose hook imports this one)."""
        from qfilters_mlx.cache.batch import BatchQFiltersCache

        return BatchQFiltersCache.merge(caches)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """This cache with its K/V stored quantized (mlx-lm's ``maybe_quantize_kv_cache``
        calls it for ``kv_bits`` / ``--kv-bits``): a :class:`QuantizedQFiltersKVCache`
        that continues exactly (see :meth:`QuantizedQFiltersKVCache.from_cache`); a
        quantized cache with these ``bits`` / ``group_size`` returns itself."""
        return QuantizedQFiltersKVCache.from_cache(self, group_size=group_size, bits=bits)

    # ---------------------------------------------------------------- bytes (.accounting)
    shrink_to_fit = accounting.shrink_to_fit
    nbytes = property(accounting.cache_nbytes)
    journal_nbytes = property(accounting.journal_nbytes)
    kept_kv_bytes = property(accounting.kept_kv_bytes)
    full_seq_bytes = property(accounting.full_seq_bytes)
    qfilters_kept_bytes = property(accounting.qfilters_kept_bytes)
    compression_ratio = property(accounting.compression_ratio)

    @property
    def tokens_seen(self) -> int:
        """Tokens fed so far (equals ``offset``)."""
        return self.offset

    @property
    def tokens_kept(self) -> int:
        """Tokens stored per (batch row, KV head)."""
        return self._n

    # --------------------------------- save, load, copies (.persistence: checked on load)
    state = property(persistence.saved_state, persistence.restore)

    def __getstate__(self) -> dict:
        """Everything but the resolved backend, which is stored by name."""
        return persistence.for_pickle(self.__dict__, self.backend.name)

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(persistence.from_pickle(d))


class QuantizedQFiltersKVCache(QFiltersKVCache):
    """``QFiltersKVCache`` storing the kept K/V quantized, as mlx-lm's ``QuantizedKVCache``
    stores them (:class:`~qfilters_mlx.cache.quantized.QuantizedRows`); every method is the
    parent's, the storage differs. ``update_and_fetch`` returns ``(packed, scales,
    biases)`` for keys and values, which mlx-lm's attention takes because the cache has
    ``bits``.

    Args:
        config, layer_idx, filters, backend, max_rewind: as :class:`QFiltersKVCache`
            (``max_rewind`` must be 0: a quantized cache cannot rewind after an eviction).
        bits: 2, 4 or 8; group_size: 32, 64 or 128 (the head dimension must be a multiple;
            default 64).

    Attributes:
        bits, group_size: the quantization (mlx-lm's attention reads them).

    Raises:
        ValueError: no ``bits``, or values the build options refuse for ``kv_bits`` /
            ``kv_group_size`` (:class:`~qfilters_mlx.config.BuildOptions`).
    """

    quantized = True

    def __init__(self, config: KVCacheConfig, layer_idx: int = 0, filters: mx.array | None = None,
                 *, bits: int | None = None, group_size: int | None = None,
                 backend: str | None = None, max_rewind: int | None = None):
        self._setup(config, layer_idx, filters, backend, max_rewind, bits, group_size)

    @classmethod
    def from_cache(cls, cache: QFiltersKVCache, group_size: int = 64, bits: int = 4):
        """``cache`` with its stored K/V quantized: the same kept rows, scores, positions,
        filter and slot layout, so it continues exactly as a cache built with ``kv_bits``
        would from here (scores were computed at full precision). A cache already quantized
        with these ``bits`` / ``group_size`` is returned as is.

        Raises:
            ValueError: other bits/group size than a quantized ``cache`` already has; a
                cache still waiting for the queries of its filter (``offset <
                calib_tokens``: mlx-lm's ``quantized_kv_start`` below ``calib_tokens``);
                invalid ``bits`` / ``group_size`` or ``max_rewind > 0`` (see
                ``KVCacheConfig``); a head dimension not a multiple of ``group_size``.
        """
        return quantized_copy(cache, cls, bits, group_size)


def build_cache(config: KVCacheConfig, layer_idx: int = 0, filters: mx.array | None = None, *,
                bits: int | None = None, group_size: int | None = None, backend: str | None = None,
                max_rewind: int | None = None) -> QFiltersKVCache:
    """One layer's eviction cache of the class the storage asks for: a
    :class:`QuantizedQFiltersKVCache` when ``bits`` is set, else a :class:`QFiltersKVCache`
    (arguments as theirs; ``KVCacheBuilder`` builds with it).

    Raises:
        TypeError, ValueError: as the class's constructor.
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if bits is not None:
        return QuantizedQFiltersKVCache(config, layer_idx, filters, bits=bits, group_size=group_size,
                                        backend=backend, max_rewind=max_rewind)
    return QFiltersKVCache(config, layer_idx, filters, backend=backend, max_rewind=max_rewind)


# mlx-lm's load_prompt_cache resolves cache classes by name in its own module:
# make ours resolvable there (adds a name; changes nothing else in mlx-lm).
mlx_cache.QFiltersKVCache = QFiltersKVCache
mlx_cache.QuantizedQFiltersKVCache = QuantizedQFiltersKVCache
