"""``QFiltersKVCache``: a fixed-budget eviction cache implementing mlx-lm's cache protocol,
and its sibling ``QuantizedQFiltersKVCache`` (the same cache storing K/V quantized).

Longer than 350 lines because this one file holds the whole hot path (update, scoring,
eviction, slot-mode decode step, compress-once compression) and its input checks, so
that it reads top to bottom; the parts off that path are components in their own
modules (below).

Data flow of one ``update_and_fetch(keys, values)`` call:

1. validate (before touching state; :meth:`QFiltersKVCache._validate`);
2. if the Q-Filter does not exist yet and ``tokens_seen + L >= calib_tokens``,
   estimate it from exactly the first ``calib_tokens`` keys ever seen, freeze
   it, and score every stored token (:meth:`QFiltersKVCache._calibrate`);
3. score the new tokens once (:func:`insertion_scores`: ``sign * <k, u>``, float32);
   scores never change;
4. return ``stored ++ new``: every token of this call is visible to this call's
   queries;
5. then evict down to ``budget`` per (batch row, KV head): the first ``n_sink``
   and last ``recent`` positions are kept, the rest by highest score (ties:
   earlier position), temporal order preserved;
6. ``offset += L`` (absolute RoPE position, never the stored length).

The kept set does not depend on how the input was chunked (the filter comes from
a fixed set of keys; selection is a pure function of scores and tokens fed).
Single-token calls after an eviction run in *slot mode* (:meth:`QFiltersKVCache._decode_step`,
below); compress-once mode (``qfilters_mode``: keep every token until one compression,
then append) is :meth:`QFiltersKVCache.compress` and the limits it sets.

Reading path of one ``update_and_fetch`` call, three files: this one
(``update_and_fetch -> _validate -> _before_call -> _update -> _append / _decode_step ->
_evict``); :mod:`qfilters_mlx.backends.reference`, the semantics of the backend operations
it calls (``projection_scores``, ``select_compact``, ``write_slot``, ``decode_select``;
the backend chosen at construction runs them, :mod:`qfilters_mlx.backends.dispatch`); and
:mod:`.journal`, the records it pushes when rewinds are on. Off that path: the call that
crosses ``calib_tokens`` estimates the filter once (:mod:`.calibration`), and a
``QuantizedQFiltersKVCache`` stores rows through :mod:`.quantized` where this file's dense
storage (:class:`DenseRows`) keeps them as given.

Components the cache calls (none of them is a base class): :mod:`.journal` (rewind
records and the undo of one record), :mod:`.calibration` (online filter estimation),
:mod:`.persistence` (the ``state`` format and copies), :mod:`.accounting` (bytes),
:mod:`.quantized` (quantized row storage); :mod:`.compression` holds the compress-once
rule's pure parts and :func:`~qfilters_mlx.cache.compression.compress_caches`.

Methods and their scores at insertion (each token is scored once, when it enters the
cache; higher scores are kept):

=============== ============================= ==========================================
method          score at insertion            source
=============== ============================= ==========================================
qfilters        ``sign * <k, u>``             Godey et al. 2025, arXiv:2503.02812
l2norm          ``-||k||_2``                  Devoto et al. 2024 (kvpress KnormPress)
streaming_llm   none (sinks + recent window)  Xiao et al. 2023
random          seeded uniform in ``[0, 1)``  control arm
full            none (never evicts)           baseline
=============== ============================= ==========================================
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import _BaseCache

from qfilters_mlx.backends import reference
from qfilters_mlx.backends.dispatch import get_backend
from qfilters_mlx.cache.accounting import arrays_nbytes, kv_bytes, method_bytes
from qfilters_mlx.cache.calibration import check_queries, estimate_filter, first_queries
from qfilters_mlx.cache.compression import check_target, keep_count
from qfilters_mlx.cache.journal import (CallRecord, LayoutRecord, RewindJournal, StepRecord,
                                        call_head_rows, dropped_rows, undo_call_rows, undo_layout,
                                        undo_step)
from qfilters_mlx.cache.persistence import Snapshot, decode, encode, for_pickle, from_pickle
from qfilters_mlx.cache.quantized import QuantizedRows
from qfilters_mlx.config import KVCacheConfig
from qfilters_mlx.config import check_int
from qfilters_mlx.config.build import AUTO, AUTO_REWIND, check_build

__all__ = ["DenseRows", "QFiltersKVCache", "QuantizedQFiltersKVCache", "build_cache",
           "insertion_scores", "random_scores"]

_BIG = 2**62
_GOLDEN = 0x9E3779B1
_MIX1 = 0x85EBCA6B
_MIX2 = 0xC2B2AE35


# ------------------------------------------------------------------------- scores
def _u32(x: int) -> mx.array:
    return mx.array(x & 0xFFFFFFFF, dtype=mx.uint32)


def _fmix32(h: mx.array) -> mx.array:
    """MurmurHash3's 32-bit finaliser (wrapping uint32 arithmetic)."""
    h = h ^ (h >> 16)
    h = h * _u32(_MIX1)
    h = h ^ (h >> 13)
    h = h * _u32(_MIX2)
    return h ^ (h >> 16)


def random_scores(positions: mx.array, seed: int, layer: int) -> mx.array:
    """Seeded uniform scores in ``[0, 1)`` that depend only on (seed, layer, head, position).

    Being a pure function of the absolute position, the random arm is
    reproducible and independent of how the prompt was chunked.

    Args:
        positions: ``[B, H, L]`` integer absolute token positions.
        seed: non-negative int; layer: layer index.

    Returns:
        ``[B, H, L]`` float32.
    """
    H = positions.shape[1]
    head = mx.arange(H, dtype=mx.uint32)[None, :, None]
    h = positions.astype(mx.uint32) * _u32(_GOLDEN)
    h = h ^ _fmix32(head + _u32(seed * 0x27D4EB2F + layer * 0x165667B1 + 1))
    h = _fmix32(h)
    return (h >> 8).astype(mx.float32) * (1.0 / (1 << 24))


def insertion_scores(method: str, keys: mx.array, positions, *, filters=None,
                     sign: int = 1, seed: int = 0, layer: int = 0, backend=None,
                     finite: bool = True) -> mx.array:
    """Scores ``[B, H, L]`` float32 of new keys ``[B, H, L, D]`` for ``method`` (the table in
    the module docstring).

    ``qfilters`` needs ``filters`` ``[H, D]`` and uses ``backend.projection_scores``
    when a backend is given (the reference otherwise). A non-finite score (a key
    holding NaN or inf) becomes ``-inf``: such a token is evicted before any
    finite-scored one, unless it is a sink or in the recent window. With
    ``finite=False`` the scores are returned as computed (NaN/inf kept), for a caller
    that maps them itself (the slot cache's ``decode_select``).
    """
    if method in ("qfilters", "l2norm"):
        if method == "qfilters":
            fn = backend.projection_scores if backend is not None else reference.projection_scores
            s = fn(keys, filters, sign)
        else:
            s = reference.l2norm_scores(keys)
        # Non-finite keys (NaN/inf) rank lowest: never kept over a finite-scored token.
        # (`finite=False` leaves that to the caller: decode_insert does it itself.)
        return mx.where(mx.isfinite(s), s, -mx.inf) if finite else s
    if method == "random":
        return random_scores(positions, seed, layer)
    # streaming_llm and full never rank by score.
    return mx.zeros(keys.shape[:3], dtype=mx.float32)


# ------------------------------------------------------------------------ storage
@dataclasses.dataclass
class DenseRows:
    """K/V rows stored as given (the storage of ``QFiltersKVCache``; it holds nothing, so
    any two are equal); the quantized one, :class:`~qfilters_mlx.cache.quantized.QuantizedRows`,
    has the same methods."""

    nbytes = 0  # bytes held besides the stored rows

    def check(self, keys, values) -> None:
        """Nothing to check beyond :meth:`QFiltersKVCache._validate`."""

    def store(self, keys, values, n: int = 0, hold: bool = False) -> tuple:
        """The new rows as stored: as given."""
        return keys, values

    def fetch(self, keys, values) -> tuple:
        """What attention reads from stored rows: the rows."""
        return keys, values

    def layout(self, keys, values) -> tuple:
        """``(B, H_kv, D_k, D_v, dtype)`` of the input rows (stored ``keys`` non-empty)."""
        B, H, _, D = keys.shape
        return B, H, D, values.shape[3], keys.dtype

    def full_keys(self, keys, n: int) -> mx.array:
        """The full-precision keys of the first ``n`` rows: the stored ones."""
        return keys[:, :, :n]

    def calibrated(self, n: int, calib_tokens: int) -> None:
        """Nothing held for calibration."""

    def evicted(self) -> None:
        """Nothing held for calibration."""

    def arrays(self) -> list:
        """The arrays held besides the stored rows: none."""
        return []

    def map_arrays(self, fn) -> None:
        """Nothing to replace."""


def _take(buf: mx.array, order: mx.array) -> mx.array:
    return mx.take_along_axis(buf, order[..., None] if buf.ndim == 4 else order, axis=2)


def _checked_filters(config: KVCacheConfig, filters):
    """The constructor's ``filters`` argument checked (``[H_kv, D]`` floating point, or
    ``None`` unless the config needs it: the calibrated filter) and cast to float32."""
    if filters is not None:
        if not isinstance(filters, mx.array) or filters.ndim != 2:
            raise ValueError("filters must be an mx.array [H_kv, D], got "
                             f"{getattr(filters, 'shape', type(filters).__name__)}")
        if not mx.issubdtype(filters.dtype, mx.floating):
            raise TypeError(f"filters must be floating point, got {filters.dtype}")
        hd = config.head_dim
        if hd is not None and filters.shape[1] != hd:
            raise ValueError(f"filters head_dim {filters.shape[1]} != config.head_dim {hd}")
        filters = filters.astype(mx.float32)
    elif config.method == "qfilters" and config.qfilters_filter_source == "calibrated":
        raise ValueError(
            "qfilters_filter_source='calibrated' (the default) scores with the model's calibrated "
            "query filter, which KVCacheBuilder.for_model / install find or make: build the caches "
            "with them, pass filters= ([H_kv, D]), or choose an online filter "
            "(qfilters_filter_source='queries' inside observe_queries, or 'keys')")
    return filters


class QFiltersKVCache(_BaseCache):
    """Eviction KV cache for one attention layer, K/V stored in the model's dtype.

    Args:
        config: a validated :class:`KVCacheConfig` (``method`` selects the scorer) with
            ``kv_bits=None`` (quantized storage: :class:`QuantizedQFiltersKVCache`, or
            :func:`build_cache`, which picks the class).
        layer_idx: index of the layer (seeds the ``random`` arm).
        filters: this layer's fixed Q-Filter ``[H_kv, D]`` (any float dtype, stored
            float32; score ``sign * <k, f>``): eviction starts at the first call. Needed
            with ``qfilters_filter_source="calibrated"``; ``None`` for the online filters.
        backend: kernel backend name (``"auto"``, ``"reference"``, ``"cpp"``, ``"metal"``);
            ``None``: ``config.qfilters_backend``.
        max_rewind: tokens ``trim`` can rewind exactly after an eviction (the rewind
            journal, :mod:`.journal`); ``None``: ``config.qfilters_max_rewind``.

    Attributes:
        offset: absolute number of tokens fed (the RoPE position of the next token).
        filter: ``[H_kv, D]`` float32 Q-Filter once calibrated, else ``None``.
        keys, values: ``[B, H_kv, capacity, D]`` buffers; rows ``[0, size())`` are live.
        scores: ``[B, H_kv, capacity]`` float32 insertion scores; positions: int64 absolute
            positions of the rows.
        backend: the resolved kernel backend; max_rewind: the rewind depth.
        storage: how rows are stored (:class:`DenseRows` here).
        keep_last_kv: keep what the last update returned for :meth:`keys_and_values`
            (layers whose K/V another layer reads; set by ``KVCacheBuilder.for_model``).

    Raises:
        TypeError: ``config`` is not a :class:`KVCacheConfig`.
        ValueError: the backend is not available; ``filters`` is ``None`` with
            ``qfilters_filter_source="calibrated"`` (the default: those filters come from
            ``KVCacheBuilder.for_model``); ``config.kv_bits`` is set; ``max_rewind < 0``.
    """

    step = 256
    quantized = False  # the class stores K/V quantized (has ``bits``/``group_size``)

    def __init__(self, config: KVCacheConfig, layer_idx: int = 0, filters: mx.array | None = None,
                 *, backend: str | None = None, max_rewind: int | None = None):
        if isinstance(config, KVCacheConfig) and config.kv_bits is not None:
            raise ValueError(
                f"config.kv_bits={config.kv_bits}: QFiltersKVCache stores K/V unquantized; build a "
                "QuantizedQFiltersKVCache, or use build_cache(config, ...) or KVCacheBuilder, which "
                "pick the class from kv_bits")
        self._setup(config, layer_idx, filters, backend, max_rewind)

    def _setup(self, config, layer_idx, filters, backend, max_rewind, bits=None, group_size=None):
        """``__init__`` of both classes: the only place that reads the build options
        (``qfilters_backend``, ``qfilters_max_rewind``, ``kv_bits``, ``kv_group_size``)."""
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        filters = _checked_filters(config, filters)
        backend = config.qfilters_backend if backend is None else backend
        if max_rewind is None:
            max_rewind = config.qfilters_max_rewind
        if max_rewind != AUTO:
            check_int("max_rewind", max_rewind, 0)
        if self.quantized:
            bits = config.kv_bits if bits is None else bits
            group_size = config.kv_group_size if group_size is None else group_size
            if bits is None:
                raise ValueError(f"{type(self).__name__} needs config.kv_bits (2, 4 or 8) or bits=, "
                                 "got None")
            _check_quantization(bits, group_size, max_rewind, config.head_dim)
            self.bits, self.group_size = bits, group_size
            self.storage = QuantizedRows(bits, group_size)
        else:
            self.storage = DenseRows()
        self.config = config
        self.layer_idx = int(layer_idx)
        self.backend = get_backend(backend)
        self._backend_name = backend  # as requested ("auto" stays "auto" in saved files)
        self.max_rewind = AUTO if max_rewind == AUTO else int(max_rewind)
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
        self._journal = RewindJournal(self._depth_now())
        self._victim_rows = None
        # Compress-once mode: `(K, offset)` of the compression once done; `_saw_chunk`: a
        # multi-token call was seen (the `prompt_end` trigger).
        self._compressed = None
        self._saw_chunk = False
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

    @property
    def _needs_filter(self) -> bool:
        return self.method == "qfilters" and not self.filter_fixed

    @property
    def _calibrates_from_queries(self) -> bool:
        return self._needs_filter and self.config.needs_queries

    @property
    def needs_queries(self) -> bool:
        """Whether the cache still waits for queries (query-based filter not estimated yet)."""
        return self._calibrates_from_queries and self.filter is None

    @property
    def scoring_ready(self) -> bool:
        """Whether new tokens can be scored (the filter exists, or none is needed)."""
        return not self._needs_filter or self.filter is not None

    def _rows(self) -> tuple:
        return self.keys, self.values, self.scores, self.positions

    def _set_rows(self, rows: tuple) -> None:
        self.keys, self.values, self.scores, self.positions = rows

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
        self._validate(keys, values)
        self._last_kv = None  # released before the buffers are written
        self._before_call(keys.shape[2])  # compress-once trigger (before anything is stored)
        out = self.storage.fetch(*self._update(keys, values))
        if self.keep_last_kv:
            self._last_kv = out
        return out

    def _validate(self, keys, values) -> None:
        """Rank, dtype, shape agreement with the cache and its filter, and the
        query-observation contract of query-calibrated caches; before any state changes.

        Raises:
            TypeError: not an ``mx.array``, not floating point, or dtypes that disagree.
            ValueError: not ``[B, H_kv, L, D]``, ``L == 0``, a shape that does not match the
                cache, its filter or its storage, or queries that a query-calibrated cache
                needs but never saw.
        """
        self.storage.check(keys, values)
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, mx.array):
                raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}")
            if x.ndim != 4:
                raise ValueError(f"{name} must be [B, H_kv, L, D], got shape {tuple(x.shape)}")
            if not mx.issubdtype(x.dtype, mx.floating):
                raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys and values must agree on [B, H_kv, L], got {tuple(keys.shape)} "
                f"and {tuple(values.shape)}"
            )
        if keys.dtype != values.dtype:
            raise TypeError(f"keys and values must share a dtype, got {keys.dtype} and {values.dtype}")
        if keys.shape[2] == 0:
            raise ValueError("keys must hold at least one token (L >= 1)")
        if self.needs_queries and not self.queries_observed:
            raise ValueError(
                "this cache estimates its filter from queries (qfilters_sign='auto' or "
                "qfilters_filter_source='queries'): run the model inside "
                "`with qfilters_mlx.observe_queries(model, caches):`"
            )
        if self.needs_queries and self._queries_pending:
            raise ValueError(
                f"layer {self.layer_idx}: the queries of the previous update_and_fetch never arrived "
                "(observe_queries did not see this layer's attention), so this cache cannot estimate "
                "its filter and would grow past its budget; use qfilters_filter_source='keys' with "
                "qfilters_sign=+1 or -1, or filters from a file (`qfilters-mlx calibrate`)"
            )
        if self.filter is not None and tuple(self.filter.shape) != (keys.shape[1], keys.shape[3]):
            raise ValueError(
                f"filters shape {tuple(self.filter.shape)} does not match keys "
                f"[H_kv, D] = {(keys.shape[1], keys.shape[3])}"
            )
        window = self.recent_window
        if not isinstance(window, int) and len(window) != keys.shape[1]:
            raise ValueError(f"layer {self.layer_idx}: qfilters_recent has {len(window)} per-head "
                             f"windows, the keys have H_kv = {keys.shape[1]} heads")
        hd = self.config.head_dim
        if hd is not None and keys.shape[3] != hd:
            raise ValueError(f"keys head_dim {keys.shape[3]} does not match config.head_dim {hd}")
        if self.keys is not None:
            B, H, D, Dv, dtype = self.storage.layout(self.keys, self.values)
            if (keys.shape[0], keys.shape[1], keys.shape[3]) != (B, H, D):
                raise ValueError(
                    f"keys [B, H_kv, L, D] = {tuple(keys.shape)} do not match the cache "
                    f"(B={B}, H_kv={H}, D={D})"
                )
            if values.shape[3] != Dv:
                raise ValueError(f"values head_dim {values.shape[3]} does not match the cache ({Dv})")
            if keys.dtype != dtype:
                raise TypeError(f"keys dtype {keys.dtype} does not match the cache ({dtype})")
        # Checks passed: the update goes ahead; a cache waiting for queries expects this
        # call's queries (observe_queries) before its next update.
        self._queries_pending = self.needs_queries

    def _update(self, keys, values):
        """``update_and_fetch`` after validation, returning the stored rows (also re-applies
        calls on a rewind)."""
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

    def _append(self, keys, values) -> None:
        """Write the new rows after the live ones, growing buffers in ``step`` blocks; a cache
        evicting to a fixed budget grows to at most ``max(n + L, budget + 1)`` rows."""
        B, H, L, _ = keys.shape
        n = self._n
        pos = (mx.array(self.offset, dtype=mx.int64) + mx.arange(L, dtype=mx.int64))[None, None, :]
        pos = mx.broadcast_to(pos, (B, H, L))
        new_scores = self._score(keys, pos) if self.scoring_ready else None  # full-precision keys
        hold = self._needs_filter and not self.evicted and not self.scoring_ready
        keys, values = self.storage.store(keys, values, n, hold)
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

    def _score(self, keys, positions):
        c = self.config
        return insertion_scores(
            c.method, keys, positions, filters=self.filter, sign=c.score_sign,
            seed=c.qfilters_seed, layer=self.layer_idx, backend=self.backend,
        )

    def _calibrate(self) -> None:
        """Freeze the filter from exactly the first ``calib_tokens`` keys (and, for
        query-based configs, queries; :func:`.calibration.estimate_filter`) and score all
        live rows. Called only before any eviction, when rows ``[0, calib_tokens)`` are
        the first ``calib_tokens`` tokens ever fed."""
        n = self._n
        keys = self.storage.full_keys(self.keys, n)  # full precision (quantized: held apart)
        self.filter = estimate_filter(self.config, keys, self._queries)
        # (queries are kept until the first eviction: trim may undo this)
        self.scores[:, :, :n] = self._score(keys, self.positions[:, :, :n])
        self.storage.calibrated(n, self.config.qfilters_calib_tokens)

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
        self.storage.evicted()

    # --------------------------------------------------------------- slot mode
    # Once full, the cache holds ``budget + 1`` slots per (batch row, KV head), all attended
    # to, one of which (``_free [B, H]`` int32) the next token overwrites (attention does not
    # depend on key order; the kept set is the one ``reference.select_keep`` gives, see
    # ``reference.decode_select``). A step scores one key (``B * H_kv * D`` multiply-adds),
    # writes its K/V row into the free slot (``write_slot``, in place in the cpp backend:
    # ``2 * B * H_kv * D * itemsize`` bytes), and finds the next slot to free with one
    # ``O(budget)`` scan of the scores per (row, head), copying the float32 scores and int64
    # positions (``12 * B * H_kv * (budget + 1)`` bytes). No K/V compaction, no sort.
    #
    # The free slot's content is never read (the next step overwrites it first; a multi-token
    # call drops it). With a rewind journal a step also gathers the rows of the slot it just
    # freed (K/V, score, position: for the journal's record of the next step), evaluated
    # together with the returned keys through ``mx.depends``: the gathers then never hold the
    # buffers when the next ``write_slot`` runs, so that write stays in place.
    #
    # Any multi-token call, ``kept_positions()`` or a window mask first puts the rows back in
    # temporal order (``_leave_slots``: one argsort + gather, ``O(budget log budget)``;
    # outside a call the journal records the switch so that rewinds stay exact); ``state``
    # reads a temporal view (``_temporal``) without changing the layout.
    def _decode_step(self, keys, values):
        """Single-token update once the cache is full: write the token into the free
        slot (``backend.write_slot``, in place in the cpp backend), score it and pick
        the next slot to free (``backend.decode_select_keys`` for Q-Filters: one
        primitive in the cpp backend; ``decode_select`` of the method's score otherwise)."""
        c = self.config
        _, n_sink, recent = self._limits_now()  # (compress-once growth limit)
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
        stored_k, stored_v = self.storage.store(keys, values)  # (packed when quantized)
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

    # ------------------------------------------------------------ compress once
    # (qfilters_mode="compress_once"; the rule and when it applies: qfilters_mlx.cache.compression)
    @property
    def compressed(self) -> bool:
        """Whether the cache has been compressed (compress-once mode)."""
        return self._compressed is not None

    def _budget_now(self):
        """Rows kept per (row, head) after a call: the streaming budget; in compress-once
        mode ``inf`` before the compression and ``K + growth`` (or ``inf``) after it."""
        c = self.config
        if not c.compress_once:
            return c.qfilters_budget
        if self._compressed is None or c.mode.growth is None:
            return math.inf
        return max(1, self._compressed[0] + c.mode.growth)

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
        if not c.compress_once or self._compressed is not None or c.mode.at != "prompt_end":
            return
        if tokens > 1:
            self._saw_chunk = True
        elif self._saw_chunk:
            self.compress()

    def check_compress(self, ratio: float | None = None, budget: int | None = None) -> None:
        """Raise the error :meth:`compress` would raise, changing nothing.

        Raises:
            ValueError: the cache is not in compress-once mode, holds nothing, its
                filter is not estimated yet, or a bad ``ratio``/``budget``.
        """
        c = self.config
        if not c.compress_once:
            raise ValueError(f"layer {self.layer_idx}: compression needs mode=CompressOnce(...) "
                             f"(qfilters_mode='compress_once'; this cache has mode={c.mode!r})")
        check_target(ratio, budget)
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
        """Compress the stored tokens once (:mod:`.compression`); returns ``K``, the rows
        kept per (batch row, KV head).

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
            ratio = c.mode.ratio
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

    def _grown_exact(self) -> int:
        """Tokens appended since the compression, all still stored (none evicted since)."""
        if self._compressed is None or self._free is not None:
            return 0
        k, offset = self._compressed
        grown = self._n - k
        return grown if grown == self.offset - offset else 0

    # ------------------------------------------------------- queries (calibration)
    def observe_queries(self, queries: mx.array) -> None:
        """Receive this call's post-RoPE queries ``[B, H_q, L, D]`` (from ``observe_queries``).

        Called after ``update_and_fetch`` of the same call (attention runs after
        the cache returns keys). Keeps the first ``calib_tokens`` queries; once
        they are all there, freezes the filter, scores the stored tokens and
        evicts down to the budget, exactly as a key-based cache does at the end
        of the call that crosses ``calib_tokens``.

        Raises:
            ValueError: ``queries`` not a 4-D array, no update before it, or a shape that
                does not fit the cache (the message names both), before anything changes.
        """
        if not self.needs_queries:
            self._queries_pending = False
            return
        layout = None if self.keys is None else self.storage.layout(self.keys, self.values)
        check_queries(queries, layout, self.offset)
        self._queries_pending = False
        record = self._journal.last() if self._journal.active else None
        if isinstance(record, CallRecord) and record.offset + record.tokens == self.offset:
            record.observed = queries  # (re-applied on a partial rewind)
        c = self.config.qfilters_calib_tokens
        self._queries = first_queries(self._queries, queries, c, self.offset)
        if self._queries is not None and self._queries.shape[2] >= c:
            self._calibrate()
            if self._n > self._budget_now():
                self._evict()
            mx.async_eval(self.positions, self.scores)

    # ----------------------------------------------------------------- rewinds
    def is_trimmable(self) -> bool:
        """Whether every rewind mlx-lm may ask of this cache is exact, now and later.

        mlx-lm trims only through ``trim_prompt_cache``, which skips (silently, returning 0) a
        cache that says False; its speculative decoding asks once, before the prompt, and
        its server asks before trimming a stored cache to a shared prefix. So this says True
        only when no such rewind can fail: ``method="full"`` (never evicts), or
        ``max_rewind > 0`` (the journal makes rewinds exact after an eviction; a
        deeper one raises ``ValueError`` naming the field before changing anything). An
        evicting cache with ``max_rewind=0`` says False from the
        start, even before its first eviction: speculative decoding is then refused by
        mlx-lm's start check before the prompt is fed (never rejected drafts left in the
        cache), and mlx-lm's server reuses stored prefixes without trimming them. ``trim``
        itself stays exact where it can be (see :meth:`trim`).

        With ``max_rewind="auto"`` (the default) asking turns the journal on: before the
        first eviction (nothing is lost yet) the cache starts journaling its last
        :data:`~qfilters_mlx.config.AUTO_REWIND` tokens and says True, so speculative
        decoding works with the default cache and costs nothing where nobody asks; after
        an eviction it had no journal for, or with quantized storage (no journal), False.
        """
        if self.method == "full":
            return True
        if self.max_rewind != AUTO:
            return self.max_rewind > 0
        if not self._journal.active:
            if self.quantized or self.evicted:
                return False
            self._journal = RewindJournal(AUTO_REWIND)
        return True

    def _depth_now(self) -> int:
        """The journal depth a new or reloaded cache starts with (``"auto"``: none yet)."""
        return 0 if self.method == "full" or self.max_rewind == AUTO else self.max_rewind

    @property
    def rewindable_tokens(self) -> int:
        """How many tokens ``trim`` can remove now: ``size()`` before any eviction;
        after it, the journal's reach: the last ``max_rewind`` tokens fed
        (fewer right after a rewind, which uses up the journal it replays, or
        after a reload; new tokens refill it); after a compression without a journal,
        the tokens appended since it while none was evicted."""
        journal = self._n if not self.evicted else self._journal.rewindable
        return max(journal, 0 if self._journal.active else self._grown_exact())

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
            f"{can} (qfilters_max_rewind={self.max_rewind!r}; a cache loaded "
            "from a file restores only what it saw since; 'auto' journals "
            f"{AUTO_REWIND} tokens once is_trimmable() is asked before the first eviction); for "
            "speculative decoding set max_rewind >= num_draft_tokens (qfilters-mlx: --max-rewind)"
        )

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens; returns the number removed (``n <= 0``: 0).

        Before any eviction: at most ``size()`` tokens, as a plain trim (a trim
        back into the calibration keys drops the filter, re-estimated once
        ``calib_tokens`` tokens are present again). After an eviction: exactly
        ``n`` tokens, restoring what the removed calls overwrote or evicted
        (the journal, :mod:`.journal`). After a compression (no journal): also the
        tokens appended since it, while none was evicted (a plain drop of the newest rows).

        Raises:
            ValueError: after an eviction, ``n`` exceeds what the journal can
                restore (``max_rewind``, or fewer tokens seen since the
                cache was built or loaded); nothing is changed.
        """
        n = int(n)
        if n > 0 and self.evicted and not self._journal.active and n <= self._grown_exact():
            self._last_kv = None
            self._n -= n
            self.offset -= n
            return n
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
                rows, self._free, self._victim_rows = undo_step(self._rows(), rec, self.backend.write_slot)
                self._set_rows(rows)
                self.offset -= 1
                left -= 1
                continue
            if isinstance(rec, LayoutRecord):
                self._undo_layout(rec.slots)
                continue
            redo = None
            if rec.tokens > left:  # the rewind ends inside this call: re-apply its head
                m = rec.tokens - left
                redo = call_head_rows(self._rows(), self._n, rec, m)
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

    def _undo_layout(self, slots: tuple) -> None:
        rows, self._free, self._victim_rows = undo_layout(self._rows(), self._n, slots)
        self._set_rows(rows)

    def _undo_call(self, rec: CallRecord) -> None:
        """Undo the newest multi-token call (the cache is in its post-call state)."""
        self._set_rows(undo_call_rows(self._rows(), self._n, rec))
        if self._needs_filter and rec.filter is None and self.filter is not None:
            self.scores = mx.zeros_like(self.scores)  # the old rows were never scored
        self.filter = rec.filter
        self._queries = rec.queries
        self.evicted = rec.evicted
        self.offset = rec.offset
        self._n = rec.n
        if rec.slots is not None:  # the call started in slot mode
            self._undo_layout(rec.slots)

    # -------------------------------------------------------------- the rest
    def keys_and_values(self):
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
        if not self.keep_last_kv:
            raise ValueError(
                f"layer {self.layer_idx}: keys_and_values() needs keep_last_kv=True (another layer "
                "reads this layer's K/V; KVCacheBuilder.for_model sets it for such models)")
        if self._last_kv is None:
            raise ValueError(f"layer {self.layer_idx}: keys_and_values() before any update_and_fetch "
                             "since the cache was built, loaded or trimmed")
        return self._last_kv

    def size(self) -> int:
        """Number of tokens stored per (batch row, KV head)."""
        return self._n

    def empty(self) -> bool:
        return self.keys is None

    def kept_positions(self) -> mx.array:
        """``[B, H_kv, size()]`` int64 absolute positions of the stored tokens, ascending."""
        self._to_temporal()
        return self.positions[:, :, : self._n]

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

    # ---------------------------------------------------------------- bytes
    def shrink_to_fit(self, journal_rows: int | None = None) -> None:
        """Hold only what the cache needs from now on, as buffers of its own: the K/V,
        score and position buffers cut to the live rows (``size()``; in slot mode the
        ``budget + 1`` slots), the rewind journal cut to at most ``journal_rows`` K/V rows
        (oldest records dropped first: :attr:`rewindable_tokens` shrinks to what the rest
        cover; ``None``: kept whole), and every array that is a view of a larger buffer
        copied out of it (``mx.contiguous``), then evaluated. What it holds afterwards is
        what :attr:`nbytes` counts. Outputs, kept sets and every rewind still within reach
        are unchanged (the spare rows of a step block hold nothing; a buffer grows again
        on the next append).

        For a cache kept at rest (a stored prompt cache): mlx-lm's ``copy.deepcopy`` of an
        array keeps the whole buffer it is a view of, and buffers grow in ``step`` blocks.

        Raises:
            ValueError: ``journal_rows < 0``.
        """
        if journal_rows is not None:
            self._journal.keep_rows(journal_rows)
        rows = self._n if self._free is None else self.scores.shape[2]

        def fit(a, cut=True):
            if a is None:
                return None
            if isinstance(a, tuple):
                return tuple(fit(x, cut) for x in a)
            return mx.contiguous(a[:, :, :rows] if cut else a)

        if self.keys is not None:
            self.keys, self.values = fit(self.keys), fit(self.values)
            self.scores, self.positions = fit(self.scores), fit(self.positions)
        self.filter, self._queries = fit(self.filter, False), fit(self._queries, False)
        self._victim_rows, self._free = fit(self._victim_rows, False), fit(self._free, False)
        self._journal.map_arrays(mx.contiguous)
        self.storage.map_arrays(mx.contiguous)
        self._last_kv = None
        mx.eval([a for a in (self.keys, self.values, self.scores, self.positions, self.filter,
                             self._queries, self._victim_rows, self._free) if a is not None]
                + self._journal.arrays() + self.storage.arrays())

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds: buffers at capacity, scores, positions,
        filter, the rewind journal (:attr:`journal_nbytes`) and what the storage holds
        besides the rows (quantized: the full-precision keys kept until the first eviction)."""
        return (arrays_nbytes(self.keys, self.values, self.scores, self.positions, self.filter)
                + self.journal_nbytes + self.storage.nbytes)

    @property
    def journal_nbytes(self) -> int:
        """Bytes held only to make rewinds exact (``max_rewind``): per decode step
        recorded, the slot and the rows it held (``B H (4 + (D_k + D_v) itemsize + 12)``;
        the step entering slot mode: the scores/positions buffers before it, ``12 B H capacity``);
        per multi-token call, the rows its eviction dropped; plus the free slot's rows."""
        return self._journal.nbytes + arrays_nbytes(self._victim_rows)

    @property
    def tokens_seen(self) -> int:
        """Tokens fed so far (equals ``offset``)."""
        return self.offset

    @property
    def tokens_kept(self) -> int:
        """Tokens stored per (batch row, KV head)."""
        return self._n

    @property
    def kept_kv_bytes(self) -> int:
        """Bytes of the kept K/V rows alone (``size()`` rows as stored: packed words, scales
        and biases when quantized), without buffer slack, scores or filter."""
        return kv_bytes(self.keys, self.values, self._n)

    @property
    def full_seq_bytes(self) -> int:
        """K/V bytes a full cache would hold for ``tokens_seen`` tokens, stored as this cache
        stores rows (quantized: a full ``QuantizedKVCache`` of the same bits)."""
        return kv_bytes(self.keys, self.values, self.offset)

    @property
    def qfilters_kept_bytes(self) -> int:
        """Bytes the method needs: kept K/V, their float32 scores (when ranked by
        score) and the frozen filter in full (``H_kv * D * 4`` bytes)."""
        return method_bytes(self.method, self.keys, self.values, self._n, self.filter)

    @property
    def compression_ratio(self) -> float:
        """``full_seq_bytes / qfilters_kept_bytes`` (1.0 when empty)."""
        kept = self.qfilters_kept_bytes
        return self.full_seq_bytes / kept if kept else 1.0

    # ----------------------------------------------------- save, load, copies
    @property
    def state(self):
        """``(keys, values, scores, positions, filter, queries, meta)`` (a quantized cache
        adds its storage's entries): the live rows in temporal order, the filter, the kept
        calibration queries and a JSON string (:mod:`.persistence`), so that mlx-lm's
        ``save_prompt_cache`` / ``load_prompt_cache`` round-trip the cache exactly. Arrays
        are ``None`` while the cache is empty. Reading it changes nothing."""
        return encode(Snapshot(
            self.config, self._build_options(), self.layer_idx, self.offset, self.evicted,
            self.filter_fixed, self._temporal(), self.filter, self._queries, self._compressed,
            self._saw_chunk, self.keep_last_kv,
            slot_order=None if self._free is None else self._slot_order(),
            free=self._free, storage=self.storage if self.quantized else None))

    @state.setter
    def state(self, v):
        s = decode(v, self.quantized, type(self).__name__)  # checks all first
        backend_name, max_rewind, bits, group_size = s.build
        self.config, self.layer_idx = s.config, s.layer_idx
        self.backend, self._backend_name, self.max_rewind = get_backend(backend_name), backend_name, max_rewind
        if self.quantized:
            self.bits, self.group_size, self.storage = bits, group_size, s.storage
        else:
            self.storage = DenseRows()
        self.offset, self.evicted, self.filter_fixed = s.offset, s.evicted, s.filter_fixed
        self.queries_observed = False
        self._queries_pending = False
        self._queries = s.queries
        self._set_rows(s.rows)
        self._n = 0 if s.rows[0] is None else s.rows[0].shape[2] - (s.free is not None)
        self._free, self._victim_rows = s.free, None
        self.filter = s.filter
        self._journal = RewindJournal(self._depth_now())
        self._compressed, self._saw_chunk = s.compressed, s.saw_chunk
        self.keep_last_kv, self._last_kv = s.keep_last_kv, None

    def _build_options(self) -> tuple:
        """``(backend name, max_rewind, bits, group_size)`` as saved (``None``: the config's)."""
        if self.quantized:
            return self._backend_name, self.max_rewind, self.bits, self.group_size
        return self._backend_name, self.max_rewind, None, None

    def __getstate__(self) -> dict:
        """Everything but the resolved backend, which is stored by name."""
        return for_pickle(self.__dict__, self.backend.name)

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(from_pickle(d))


def _check_quantization(bits, group_size, max_rewind, head_dim) -> None:
    """``kv_bits`` / ``kv_group_size`` checks of ``KVCacheConfig``, for the values a
    quantized cache is built with (``ValueError`` naming the value)."""
    check_build("auto", max_rewind, bits, group_size, head_dim,
                names={"backend": "backend", "max_rewind": "qfilters_max_rewind", "kv_bits": "kv_bits",
                       "kv_group_size": "kv_group_size"})


class QuantizedQFiltersKVCache(QFiltersKVCache):
    """``QFiltersKVCache`` storing the kept K/V quantized, as mlx-lm's ``QuantizedKVCache``
    stores them (:class:`~qfilters_mlx.cache.quantized.QuantizedRows`); every method is the
    parent's, the storage differs. ``update_and_fetch`` returns ``(packed, scales,
    biases)`` for keys and values, which mlx-lm's attention takes because the cache has
    ``bits``.

    Args:
        config, layer_idx, filters, backend, max_rewind: as :class:`QFiltersKVCache`
            (``max_rewind`` must be 0: a quantized cache cannot rewind after an eviction).
        bits: 2, 4 or 8; ``None``: ``config.kv_bits``. group_size: 32, 64 or 128 (the head
            dimension must be a multiple); ``None``: ``config.kv_group_size``.

    Attributes:
        bits, group_size: the quantization (mlx-lm's attention reads them).

    Raises:
        ValueError: no ``bits`` (neither given nor in the config), or values
            ``KVCacheConfig`` would refuse for ``kv_bits`` / ``kv_group_size``.
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
        if cache.quantized:
            if (cache.bits, cache.group_size) == (bits, group_size):
                return cache
            raise ValueError(f"cache is quantized with kv_bits={cache.bits}, kv_group_size="
                             f"{cache.group_size}; cannot requantize to {bits}, {group_size}")
        if cache.needs_queries:
            raise ValueError(
                f"layer {cache.layer_idx}: cannot quantize the cache before its filter is estimated "
                f"from queries (offset {cache.offset} < qfilters_calib_tokens "
                f"{cache.config.qfilters_calib_tokens}): use quantized_kv_start >= calib_tokens, "
                "or KVCacheConfig(kv_bits=...) to quantize from the first token")
        config = cache.config
        _check_quantization(bits, group_size, cache.max_rewind, config.head_dim)
        held = None
        if cache.keys is not None and cache._needs_filter and not cache.evicted:
            m = min(cache._n, config.qfilters_calib_tokens) if cache.scoring_ready else cache._n
            held = cache.keys[:, :, :m]
        storage, keys, values = QuantizedRows.converted(cache.keys, cache.values, held, bits, group_size)
        new = cls.__new__(cls)
        new.__dict__.update(cache.__dict__)
        new.config, new.storage, new.bits, new.group_size = config, storage, bits, group_size
        new._journal = RewindJournal(0)
        if cache.keys is not None:
            new.keys, new.values = keys, values
        return new


def build_cache(config: KVCacheConfig, layer_idx: int = 0, filters: mx.array | None = None, *,
                bits: int | None = None, group_size: int | None = None, backend: str | None = None,
                max_rewind: int | None = None) -> QFiltersKVCache:
    """One layer's eviction cache of the class the storage asks for: a
    :class:`QuantizedQFiltersKVCache` when ``bits`` (else ``config.kv_bits``) is set, else a
    :class:`QFiltersKVCache` (arguments as theirs; ``KVCacheBuilder`` builds with it).

    Raises:
        TypeError, ValueError: as the class's constructor.
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if bits is not None or config.kv_bits is not None:
        return QuantizedQFiltersKVCache(config, layer_idx, filters, bits=bits, group_size=group_size,
                                        backend=backend, max_rewind=max_rewind)
    return QFiltersKVCache(config, layer_idx, filters, backend=backend, max_rewind=max_rewind)


# mlx-lm's load_prompt_cache resolves cache classes by name in its own module:
# make ours resolvable there (adds a name; changes nothing else in mlx-lm).
mlx_cache.QFiltersKVCache = QFiltersKVCache
mlx_cache.QuantizedQFiltersKVCache = QuantizedQFiltersKVCache
