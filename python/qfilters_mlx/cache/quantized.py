"""Quantized storage of the kept keys/values (``KVCacheConfig.kv_bits``): the mixin of
``QuantizedQFiltersKVCache`` (:mod:`qfilters_mlx.cache.kv_cache`).

Rows are quantized exactly as mlx-lm's ``QuantizedKVCache`` quantizes them:
``mx.quantize(x, group_size, bits)`` along the head dimension of each ``[B, H_kv, L, D]``
row gives packed ``uint32 [..., D * bits / 32]`` words plus ``scales`` and ``biases``
``[..., D / group_size]`` in the input dtype (affine: ``x ~ scale * q + bias`` per group).
The cache keeps the three side by side in ONE ``uint32`` row of :func:`row_words` words
(packed words, then the bytes of ``concat(scales, biases)`` viewed as ``uint32``), so
every row operation of the eviction engine (append, the eviction gather, the slot-mode
write into the free slot, the temporal reorder, save/load, copies) moves packed rows,
scales and biases together with one operation per array, unchanged.
``update_and_fetch`` returns what mlx-lm's quantized attention
(``mlx_lm.models.base.quantized_scaled_dot_product_attention``, chosen because the
cache has ``bits``) expects: ``((k_packed, k_scales, k_biases), (v_packed, v_scales,
v_biases))``, each ``[B, H_kv, S, .]``.

Scores come from the full-precision keys at insertion, before quantization (the
engine scores the input keys; only storage is quantized), so the kept set is the one
the unquantized cache keeps. The online filter and the scores of rows stored before
it exists need full-precision keys too: until the first eviction the cache also keeps
``_fp_keys`` (the full-precision keys of the rows not scored yet, then of the first
``calib_tokens`` rows, for a trim back into calibration), counted in ``nbytes``.
"""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx

from qfilters_mlx.cache.journal import RewindJournal
from qfilters_mlx.cache.persistence import PersistenceMixin

__all__ = ["QuantizedStorageMixin", "pack_rows", "row_words", "unpack_rows"]

_DTYPES = ("float16", "bfloat16", "float32")


def row_words(dim: int, dtype, group_size: int, bits: int) -> int:
    """``uint32`` words of one stored row of ``dim`` elements: ``dim * bits / 32`` packed
    words plus the ``2 * dim / group_size`` scales and biases of ``dtype``."""
    return dim * bits // 32 + 2 * (dim // group_size) * dtype.size // 4


def pack_rows(x: mx.array, group_size: int, bits: int) -> mx.array:
    """``x [..., D]`` floating -> ``uint32 [..., row_words(D)]``: ``mx.quantize``'s packed
    words, then its scales and biases (their bytes)."""
    w, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return mx.concatenate([w, mx.concatenate([scales, biases], axis=-1).view(mx.uint32)], axis=-1)


def unpack_rows(buf: mx.array, dim: int, dtype, group_size: int, bits: int) -> tuple:
    """``(packed, scales, biases)`` of stored rows ``buf [..., row_words(D)]`` (the inverse
    of :func:`pack_rows`: ``mx.dequantize(*unpack_rows(...), group_size, bits)``)."""
    p, g = dim * bits // 32, dim // group_size
    sb = buf[..., p:].view(dtype)
    return buf[..., :p], sb[..., :g], sb[..., g:]


class QuantizedStorageMixin:
    """Quantized K/V storage on top of ``QFiltersKVCache`` (see the module docstring).

    Attributes:
        bits, group_size: ``config.kv_bits`` / ``config.kv_group_size`` (mlx-lm's attention
            reads them; their presence selects the quantized attention path).
    """

    def __init__(self, config, layer_idx: int = 0, filters=None):
        super().__init__(config, layer_idx, filters)
        if config.kv_bits is None:
            raise ValueError(f"{type(self).__name__} needs config.kv_bits (2, 4 or 8), got None")
        self._kv_format = None  # (D_k, D_v, dtype name) of the input rows
        self._fp_keys = None  # [B, H, m, D_k] full-precision keys (see the module docstring)

    @property
    def bits(self) -> int:
        return self.config.kv_bits

    @property
    def group_size(self) -> int:
        return self.config.kv_group_size

    # ------------------------------------------------------------ storage
    def _pack(self, x: mx.array) -> mx.array:
        return pack_rows(x, self.group_size, self.bits)

    def _unpack(self, buf: mx.array, which: int) -> tuple:
        dim = self._kv_format[which]
        return unpack_rows(buf, dim, getattr(mx, self._kv_format[2]), self.group_size, self.bits)

    def _store_rows(self, keys, values):
        """Quantize the new rows; keep their full-precision keys while they cannot be scored yet."""
        if self._kv_format is None:
            self._kv_format = (keys.shape[3], values.shape[3], str(keys.dtype).rsplit(".", 1)[-1])
        if self._needs_filter and not self.evicted and not self.scoring_ready:
            n, old = self._n, self._fp_keys
            self._fp_keys = keys if old is None or n == 0 else mx.concatenate([old[:, :, :n], keys], axis=2)
        return self._pack(keys), self._pack(values)

    def _input_layout(self) -> tuple:
        B, H = self.keys.shape[:2]
        dk, dv, dtype = self._kv_format
        return B, H, dk, dv, getattr(mx, dtype)

    def _validate(self, keys, values) -> None:
        g = self.group_size
        for name, x in (("keys", keys), ("values", values)):
            if isinstance(x, mx.array) and x.ndim == 4 and x.shape[3] % g:
                raise ValueError(f"{name} head_dim {x.shape[3]} is not a multiple of kv_group_size "
                                 f"{g} (kv_bits={self.bits})")
        super()._validate(keys, values)

    # ------------------------------------------------------- engine hooks
    def _calibrate(self) -> None:
        """Calibrate and score from the full-precision keys (then keep only the first
        ``calib_tokens`` of them, for a trim back into calibration)."""
        n, c = self._n, self.config.qfilters_calib_tokens
        stored = self.keys
        self.keys = self._fp_keys[:, :, :n]
        try:
            super()._calibrate()
        finally:
            self.keys = stored
        self._fp_keys = self._fp_keys[:, :, : min(n, c)]

    def _evict(self) -> None:
        super()._evict()
        self._fp_keys = None  # no trim can reach calibration any more

    def _update(self, keys, values):
        k, v = super()._update(keys, values)
        return self._unpack(k, 0), self._unpack(v, 1)

    # ------------------------------------------------------- conversion
    @classmethod
    def from_cache(cls, cache, group_size: int = 64, bits: int = 4):
        """``cache`` (a ``QFiltersKVCache``) with its stored K/V quantized: the same kept
        rows, scores, positions, filter and slot layout, so it continues exactly as a cache
        built with ``kv_bits`` would from here (scores were computed at full precision).
        A cache already quantized with these ``bits`` / ``group_size`` is returned as is.

        Raises:
            ValueError: other bits/group size than a quantized ``cache`` already has; a
                cache still waiting for the queries of its filter (``offset <
                calib_tokens``: mlx-lm's ``quantized_kv_start`` below ``calib_tokens``);
                invalid ``bits`` / ``group_size`` or ``qfilters_max_rewind > 0`` (see
                ``KVCacheConfig``); a head dimension not a multiple of ``group_size``.
        """
        if hasattr(cache, "bits"):
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
        config = dataclasses.replace(cache.config, kv_bits=bits, kv_group_size=group_size)
        new = cls.__new__(cls)
        new.__dict__.update(cache.__dict__)
        new.config, new._kv_format, new._fp_keys = config, None, None
        new._journal = RewindJournal(0)
        if cache.keys is not None:
            d = (cache.keys.shape[3], cache.values.shape[3])
            if d[0] % group_size or d[1] % group_size:
                raise ValueError(f"head_dim {d} is not a multiple of kv_group_size {group_size}")
            new._kv_format = (*d, str(cache.keys.dtype).rsplit(".", 1)[-1])
            if cache._needs_filter and not cache.evicted:
                m = min(cache._n, config.qfilters_calib_tokens) if cache.scoring_ready else cache._n
                new._fp_keys = cache.keys[:, :, :m]
            new.keys, new.values = new._pack(cache.keys), new._pack(cache.values)
        return new

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Itself when already stored with these ``bits`` / ``group_size`` (mlx-lm calls
        this at every step past ``quantized_kv_start``), else ``ValueError``."""
        return type(self).from_cache(self, group_size=group_size, bits=bits)

    # ------------------------------------------------- bytes, save/load
    @property
    def nbytes(self) -> int:
        """Bytes held: packed rows, scales and biases (the stored ``uint32`` rows), scores,
        positions, filter, and the full-precision keys kept until the first eviction."""
        extra = 0 if self._fp_keys is None else self._fp_keys.nbytes
        return super().nbytes + extra

    @property
    def state(self):
        """The unquantized cache's 7 entries (keys/values: the stored ``uint32`` rows; meta
        adds ``kv_format``: ``[D_k, D_v, dtype]``) plus the full-precision keys kept until
        the first eviction (``None`` when none)."""
        *arrays, meta = PersistenceMixin.state.fget(self)
        meta = json.loads(meta)
        meta["kv_format"] = None if self._kv_format is None else list(self._kv_format)
        return (*arrays, json.dumps(meta), self._fp_keys)

    @state.setter
    def state(self, v):
        if not isinstance(v, (tuple, list)) or len(v) != 8:
            raise ValueError("state must be (keys, values, scores, positions, filter, queries, meta, "
                             "fp_keys) for a QuantizedQFiltersKVCache")
        try:
            meta = json.loads(v[6])
            fmt, cfg = meta.get("kv_format"), meta["config"]
            if fmt is not None:
                fmt = (int(fmt[0]), int(fmt[1]), str(fmt[2]))
                if fmt[2] not in _DTYPES:
                    raise ValueError(f"dtype {fmt[2]!r}")
        except (TypeError, ValueError, KeyError, IndexError) as err:
            raise ValueError(f"state: bad meta ({err})") from err
        keys, values = v[0], v[1]
        if (keys is None) != (fmt is None):
            raise ValueError("state: meta 'kv_format' must be given exactly when rows are")
        if keys is not None:
            bits, g = cfg.get("kv_bits"), cfg.get("kv_group_size")
            dtype = getattr(mx, fmt[2])
            if not (isinstance(bits, int) and isinstance(g, int) and g > 0) or (
                    keys.dtype != mx.uint32 or values.dtype != mx.uint32
                    or keys.shape[3] != row_words(fmt[0], dtype, g, bits)
                    or values.shape[3] != row_words(fmt[1], dtype, g, bits)):
                raise ValueError(f"state: stored rows {tuple(keys.shape)}, {tuple(values.shape)} do not "
                                 f"match kv_format {fmt} at kv_bits={bits}, kv_group_size={g}")
        PersistenceMixin.state.fset(self, v[:7])
        self._kv_format, self._fp_keys = fmt, v[7]
