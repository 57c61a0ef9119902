"""``QFiltersKVCache``: a fixed-budget eviction cache implementing mlx-lm's cache protocol.

Data flow of one ``update_and_fetch(keys, values)`` call (DESIGN.md):

1. validate (before touching state);
2. if the Q-Filter does not exist yet and ``tokens_seen + L >= calib_tokens``,
   estimate it from exactly the first ``calib_tokens`` keys ever seen, freeze
   it, and score every stored token (:mod:`.calibration`);
3. score the new tokens once (``sign * <k, u>``, float32); scores never change;
4. return ``stored ++ new``: every token of this call is visible to this call's
   queries;
5. then evict down to ``budget`` per (batch row, KV head): the first ``n_sink``
   and last ``recent`` positions are kept, the rest by highest score (ties:
   earlier position), temporal order preserved;
6. ``offset += L`` (absolute RoPE position, never the stored length).

The kept set does not depend on how the input was chunked (the filter comes from
a fixed set of keys; selection is a pure function of scores and tokens fed).

Single-token calls after an eviction run in *slot mode* (:mod:`.slots`);
``trim`` rewinds exactly within ``qfilters_max_rewind`` tokens (:mod:`.rewind`,
:mod:`.journal`); ``state``, copies and ``to_quantized`` in :mod:`.persistence`; bytes in :mod:`.accounting`;
input checks in :mod:`.validation`; filter calibration and ``observe_queries`` in
:mod:`.calibration`; compress-once mode (``qfilters_mode``: keep every
token until one compression, then append) in :mod:`.compression`; quantized storage
(``kv_bits``) in :mod:`.quantized`.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import _BaseCache

from qfilters_mlx.backends.dispatch import get_backend
from qfilters_mlx.cache.accounting import FILTER_BYTES_PER_ELEMENT, ByteAccountingMixin
from qfilters_mlx.cache.calibration import CalibrationMixin
from qfilters_mlx.cache.compression import CompressionMixin
from qfilters_mlx.cache.journal import CallRecord, RewindJournal, dropped_rows
from qfilters_mlx.cache.persistence import PersistenceMixin
from qfilters_mlx.cache.quantized import QuantizedStorageMixin
from qfilters_mlx.cache.rewind import RewindMixin
from qfilters_mlx.cache.scorers import insertion_scores
from qfilters_mlx.cache.slots import SlotModeMixin
from qfilters_mlx.cache.validation import ValidationMixin
from qfilters_mlx.config import KVCacheConfig

__all__ = ["FILTER_BYTES_PER_ELEMENT", "QFiltersKVCache", "QuantizedQFiltersKVCache"]


class QFiltersKVCache(ValidationMixin, CalibrationMixin, CompressionMixin, SlotModeMixin, RewindMixin, PersistenceMixin, ByteAccountingMixin, _BaseCache):
    """Eviction KV cache for one attention layer.

    Args:
        config: a validated :class:`KVCacheConfig` (``method`` selects the scorer).
        layer_idx: index of the layer (seeds the ``random`` arm).
        filters: this layer's fixed Q-Filter ``[H_kv, D]`` (any float dtype, stored
            float32; score ``sign * <k, f>``): eviction starts at the first call. Needed
            with ``qfilters_filter_source="calibrated"``; ``None`` for the online filters.

    Attributes:
        offset: absolute number of tokens fed (the RoPE position of the next token).
        filter: ``[H_kv, D]`` float32 Q-Filter once calibrated, else ``None``.
        keys, values: ``[B, H_kv, capacity, D]`` buffers; rows ``[0, size())`` are live.
        keep_last_kv: keep what the last update returned for :meth:`keys_and_values`
            (layers whose K/V another layer reads; set by ``KVCacheBuilder.for_model``).

    Raises:
        TypeError: ``config`` is not a :class:`KVCacheConfig`.
        ValueError: the configured backend is not available; ``filters`` is ``None`` with
            ``qfilters_filter_source="calibrated"`` (the default: those filters come from
            ``KVCacheBuilder.for_model``).
    """

    step = 256

    def __new__(cls, config=None, *args, **kwargs):
        """``QFiltersKVCache(config)`` with ``config.kv_bits`` set builds a
        :class:`QuantizedQFiltersKVCache` (quantized storage, :mod:`.quantized`)."""
        if cls is QFiltersKVCache and getattr(config, "kv_bits", None) is not None:
            cls = QuantizedQFiltersKVCache
        return super().__new__(cls)

    def __init__(self, config: KVCacheConfig, layer_idx: int = 0, filters: mx.array | None = None):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        filters = self._checked_filters(config, filters)
        self.config = config
        self.layer_idx = int(layer_idx)
        self.backend = get_backend(config.qfilters_backend)
        self.filter_fixed = filters is not None  # given from outside: no calibration
        self.queries_observed = False  # set by observe_queries() while it is active
        self._queries_pending = False  # an update's queries have not arrived yet
        self._queries = None  # [B, H_q, <=calib, D] first calib_tokens queries
        self.keys = None
        self.values = None
        self.scores = None  # [B, H, capacity] float32; meaningful once scoring is ready
        self.positions = None  # [B, H, capacity] int64 absolute positions
        self.filter = filters
        self.offset = 0
        self._n = 0  # live rows
        self.evicted = False
        # Slot mode (single-token decode after an eviction): budget + 1 slots, all
        # attended to; `_free [B, H]` is the slot the next token overwrites. Rows
        # are then not in temporal order; `_leave_slots` restores it.
        self._free = None
        # Rewind journal (exact `trim` after an eviction) and the rows of the free slot.
        self._journal = RewindJournal(0 if config.method == "full" else config.qfilters_max_rewind)
        self._victim_rows = None
        self._reset_compression()  # compress-once mode (:mod:`.compression`)
        # keys_and_values(): what the last update returned, kept only for layers whose K/V another
        # layer reads (set by KVCacheBuilder for shared-KV models; holding it otherwise would keep
        # a chunk's pre-eviction rows alive between calls)
        self.keep_last_kv = False
        self._last_kv = None

    # ------------------------------------------------------------------ helpers
    @property
    def method(self) -> str:
        return self.config.method

    @property
    def recent_window(self):
        """This layer's recent window: one int, or ``H_kv`` ints (per head; see
        :meth:`KVCacheConfig.layer_recent`)."""
        return self.config.layer_recent(self.layer_idx)

    def _append(self, keys, values) -> None:
        """Write the new rows after the live ones, growing buffers in ``step`` blocks; a cache
        evicting to a fixed budget grows to at most ``max(n + L, budget + 1)`` rows."""
        B, H, L, _ = keys.shape
        n = self._n
        pos = (mx.array(self.offset, dtype=mx.int64) + mx.arange(L, dtype=mx.int64))[None, None, :]
        pos = mx.broadcast_to(pos, (B, H, L))
        new_scores = self._score(keys, pos) if self.scoring_ready else None  # full-precision keys
        keys, values = self._store_rows(keys, values)
        if self.evicted and n + L > self.keys.shape[2] and not self._growing():
            # Steady state after eviction: exactly the rows needed, one copy of
            # the kept rows (the next eviction gathers them again anyway).
            cat = lambda buf, new: mx.concatenate([buf[:, :, :n], new], axis=2)  # noqa: E731
            self.keys, self.values = cat(self.keys, keys), cat(self.values, values)
            self.positions = cat(self.positions, pos)
            self.scores = cat(self.scores, new_scores)
            self._n = n + L
            return
        if self.keys is None or n + L > self.keys.shape[2]:
            cap = self.step * math.ceil((n + L) / self.step)
            if self.method != "full" and not self.config.compress_once:  # never over budget + chunk
                cap = min(cap, max(n + L, self.config.qfilters_budget + 1))  # (a function of n + L)

            def grow(buf, new_shape, dtype):
                fresh = mx.zeros(new_shape, dtype)
                if buf is None or n == 0:
                    return fresh
                return mx.concatenate([buf[:, :, :n], fresh[:, :, n:]], axis=2)

            self.keys = grow(self.keys, (B, H, cap, keys.shape[3]), keys.dtype)
            self.values = grow(self.values, (B, H, cap, values.shape[3]), values.dtype)
            self.scores = grow(self.scores, (B, H, cap), mx.float32)
            self.positions = grow(self.positions, (B, H, cap), mx.int64)
        self.keys[:, :, n : n + L] = keys
        self.values[:, :, n : n + L] = values
        self.positions[:, :, n : n + L] = pos
        if new_scores is not None:
            self.scores[:, :, n : n + L] = new_scores
        self._n = n + L

    def _store_rows(self, keys, values):
        """The rows as stored (as given here; :mod:`.quantized` packs them)."""
        return keys, values

    def _score(self, keys, positions):
        c = self.config
        return insertion_scores(
            c.method, keys, positions, filters=self.filter, sign=c.score_sign,
            seed=c.qfilters_seed, layer=self.layer_idx, backend=self.backend,
        )

    def _evict(self) -> None:
        n = self._n
        kept, k, v = self.backend.select_compact(
            self.scores[:, :, :n], self.keys[:, :, :n], self.values[:, :, :n], *self._limits_now(),
        )
        record = self._journal.last() if self._journal.active else None
        if isinstance(record, CallRecord) and record.dropped is None:  # this call's record
            live = (self.keys, self.values, self.scores, self.positions)
            record.dropped = dropped_rows(kept, tuple(a[:, :, :n] for a in live))
        self.scores = mx.take_along_axis(self.scores[:, :, :n], kept, axis=2)
        self.positions = mx.take_along_axis(self.positions[:, :, :n], kept, axis=2)
        self.keys, self.values = k, v
        self._n = kept.shape[2]
        self.evicted = True
        self._queries = None  # calibration is final (a rewind restores them from the journal)

    # ------------------------------------------------------------ cache protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Insert ``L`` new tokens and return the keys/values this call attends to.

        Args:
            keys, values: ``[B, H_kv, L, D]`` (RoPE already applied to keys at
                positions ``offset .. offset + L - 1``).

        Returns:
            ``(keys, values)``: ``[B, H_kv, S + L, D]`` where ``S = size()`` before
            the call; the last ``L`` rows are this call's tokens. With ``kv_bits``
            (``QuantizedQFiltersKVCache``): ``(packed, scales, biases)`` for each (:mod:`.quantized`).

        Raises:
            TypeError, ValueError: bad rank, dtype, shape change, ``L == 0``;
                raised before any state changes.
        """
        self._validate(keys, values)
        self._last_kv = None  # released before the buffers are written
        self._before_call(keys.shape[2])  # compress-once trigger (before anything is stored)
        out = self._update(keys, values)
        if self.keep_last_kv:
            self._last_kv = out
        return out

    def keys_and_values(self):
        """The keys and values the last ``update_and_fetch`` returned (mlx-lm's cache method:
        what this layer's last attention call saw, stored ++ new, before that call's
        eviction), for layers that reuse another layer's K/V (gemma3n's KV-shared layers,
        afm7's KV-reuse blocks). ``[B, H_kv, S + L, D]`` each (``(packed, scales,
        biases)`` with ``kv_bits``).

        Raises:
            ValueError: ``keep_last_kv`` is False (``KVCacheBuilder.for_model`` sets it on the
                layers a model reads this way), or no update since the cache was built,
                loaded or trimmed.
        """
        if not self.keep_last_kv:
            raise ValueError(
                f"layer {self.layer_idx}: keys_and_values() needs keep_last_kv=True (another layer "
                "reads this layer's K/V; KVCacheBuilder.for_model sets it for such models)")
        if self._last_kv is None:
            raise ValueError(f"layer {self.layer_idx}: keys_and_values() before any update_and_fetch "
                             "since the cache was built, loaded or trimmed")
        return self._last_kv

    def _update(self, keys, values):
        """``update_and_fetch`` after validation (also re-applies calls on a rewind)."""
        L = keys.shape[2]
        if L == 1 and self.evicted and not self._growing():
            return self._decode_step(keys, values)
        record = CallRecord(tokens=L, offset=self.offset, n=self._n, evicted=self.evicted,
                            filter=self.filter, queries=self._queries,
                            capacity=0 if self.keys is None else self.keys.shape[2])
        record.slots = self._leave_slots()
        if self._journal.active:
            self._journal.push(record)
        self._append(keys, values)
        self.offset += L
        if (not self.scoring_ready and not self._calibrates_from_queries
                and self.offset >= self.config.qfilters_calib_tokens):
            self._calibrate()
        n = self._n
        out = self.keys[:, :, :n], self.values[:, :, :n]
        if self.method != "full" and self.scoring_ready and n > self._budget_now():
            self._evict()
        # Positions (and scores before calibration) are read by no returned array:
        # schedule them so their graphs never grow across decode steps.
        mx.async_eval(self.positions, self.scores)
        return out

    def size(self) -> int:
        """Number of tokens stored per (batch row, KV head)."""
        return self._n

    def empty(self) -> bool:
        return self.keys is None

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
        that continues exactly (see :meth:`QuantizedStorageMixin.from_cache`)."""
        return QuantizedQFiltersKVCache.from_cache(self, group_size=group_size, bits=bits)

    def kept_positions(self) -> mx.array:
        """``[B, H_kv, size()]`` int64 absolute positions of the stored tokens, ascending."""
        self._to_temporal()
        return self.positions[:, :, : self._n]


# mlx-lm's load_prompt_cache resolves cache classes by name in its own module:
# make ours resolvable there (adds a name; changes nothing else in mlx-lm).
mlx_cache.QFiltersKVCache = QFiltersKVCache


class QuantizedQFiltersKVCache(QuantizedStorageMixin, QFiltersKVCache):
    """``QFiltersKVCache`` storing the kept K/V quantized (``config.kv_bits``; :mod:`.quantized`)."""


mlx_cache.QuantizedQFiltersKVCache = QuantizedQFiltersKVCache
