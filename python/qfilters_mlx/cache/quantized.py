"""Quantized storage of the kept keys/values: :class:`QuantizedRows`, the storage component
of ``QuantizedQFiltersKVCache`` (:mod:`qfilters_mlx.cache.kv_cache`; ``QFiltersKVCache``
has the dense one, which stores rows as given), and the row format.

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
``fp_keys`` (the full-precision keys of the rows not scored yet, then of the first
``calib_tokens`` rows, for a trim back into calibration), counted in ``nbytes``.

A storage component has no view of the cache: the cache passes what each method needs
(the new rows, the stored buffers, the row count) and says when the filter is calibrated
and when rows are evicted.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.cache.journal import RewindJournal
from qfilters_mlx.config.build import check_build
from qfilters_mlx.config.state import build_from_state

__all__ = ["QuantizedRows", "check_quantization", "pack_rows", "quantized_copy", "row_words",
           "unpack_rows"]

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


class QuantizedRows:
    """K/V rows stored quantized (see the module docstring); the dense storage of
    ``QFiltersKVCache`` has the same methods.

    Attributes:
        bits, group_size: ``mx.quantize``'s ``bits`` / ``group_size``.
        kv_format: ``(D_k, D_v, dtype name)`` of the input rows (``None`` before the first).
        fp_keys: ``[B, H_kv, m, D_k]`` full-precision keys kept until the first eviction
            (see the module docstring), or ``None``.
    """

    def __init__(self, bits: int, group_size: int, kv_format: tuple | None = None, fp_keys=None):
        self.bits, self.group_size = bits, group_size
        self.kv_format = kv_format
        self.fp_keys = fp_keys

    def check(self, keys, values) -> None:
        """Raise ``ValueError`` when a head dimension of the new rows is not a multiple of
        ``group_size`` (before any other check of ``update_and_fetch``)."""
        g = self.group_size
        for name, x in (("keys", keys), ("values", values)):
            if isinstance(x, mx.array) and x.ndim == 4 and x.shape[3] % g:
                raise ValueError(f"{name} head_dim {x.shape[3]} is not a multiple of kv_group_size "
                                 f"{g} (kv_bits={self.bits})")

    def pack(self, x: mx.array) -> mx.array:
        """``x [..., D]`` as stored rows ``uint32 [..., row_words(D)]``."""
        return pack_rows(x, self.group_size, self.bits)

    def store(self, keys, values, n: int = 0, hold: bool = False) -> tuple:
        """The new rows as stored; with ``hold`` (the rows cannot be scored yet) their
        full-precision keys are kept after the first ``n`` held ones."""
        if self.kv_format is None:
            self.kv_format = (keys.shape[3], values.shape[3], str(keys.dtype).rsplit(".", 1)[-1])
        if hold:
            old = self.fp_keys
            self.fp_keys = keys if old is None or n == 0 else mx.concatenate([old[:, :, :n], keys], axis=2)
        return self.pack(keys), self.pack(values)

    def fetch(self, keys, values) -> tuple:
        """What attention reads from stored rows: ``(packed, scales, biases)`` of each."""
        return self.unpack(keys, 0), self.unpack(values, 1)

    def unpack(self, buf: mx.array, which: int) -> tuple:
        """``(packed, scales, biases)`` of stored rows ``buf`` (``which``: 0 keys, 1 values)."""
        dim = self.kv_format[which]
        return unpack_rows(buf, dim, getattr(mx, self.kv_format[2]), self.group_size, self.bits)

    def layout(self, keys, values) -> tuple:
        """``(B, H_kv, D_k, D_v, dtype)`` of the input rows (stored ``keys`` non-empty)."""
        B, H = keys.shape[:2]
        dk, dv, dtype = self.kv_format
        return B, H, dk, dv, getattr(mx, dtype)

    def full_keys(self, keys, n: int) -> mx.array:
        """The full-precision keys of the first ``n`` rows (held since they were stored)."""
        return self.fp_keys[:, :, :n]

    def calibrated(self, n: int, calib_tokens: int) -> None:
        """The filter is frozen: keep only the first ``calib_tokens`` held keys (a trim back
        into calibration needs them again)."""
        self.fp_keys = self.fp_keys[:, :, : min(n, calib_tokens)]

    def evicted(self) -> None:
        """Rows were evicted: no trim can reach calibration any more."""
        self.fp_keys = None

    def arrays(self) -> list:
        """The arrays held besides the stored rows: the full-precision keys, if any."""
        return [] if self.fp_keys is None else [self.fp_keys]

    def map_arrays(self, fn) -> None:
        """Replace the held full-precision keys by ``fn(keys)``."""
        if self.fp_keys is not None:
            self.fp_keys = fn(self.fp_keys)

    @property
    def nbytes(self) -> int:
        """Bytes held besides the stored rows: the full-precision keys."""
        return 0 if self.fp_keys is None else self.fp_keys.nbytes

    # ------------------------------------------------------------- save / load
    def saved(self) -> tuple:
        """``(meta entries, extra state entries)``: ``kv_format`` and the held keys."""
        return {"kv_format": None if self.kv_format is None else list(self.kv_format)}, (self.fp_keys,)

    @staticmethod
    def loaded(meta: dict, extra: tuple, keys, values) -> "QuantizedRows":
        """The storage a saved state describes (``meta``: the parsed JSON meta, format 2; ``extra``: the
        entries after it; ``keys``/``values``: the stored rows).

        Raises:
            ValueError: a bad ``kv_format``, build options that
                :func:`~qfilters_mlx.config.build_from_state` refuses (or no ``kv_bits`` with
                stored rows), or stored rows that do not match the format at those values.
        """
        try:
            fmt, build = meta.get("kv_format"), build_from_state(meta["build"])
            if fmt is not None:
                fmt = (int(fmt[0]), int(fmt[1]), str(fmt[2]))
                if fmt[2] not in _DTYPES:
                    raise ValueError(f"dtype {fmt[2]!r}")
        except (TypeError, ValueError, KeyError, IndexError) as err:
            raise ValueError(f"state: bad meta ({err})") from err
        if (keys is None) != (fmt is None):
            raise ValueError("state: meta 'kv_format' must be given exactly when rows are")
        bits, g = build.kv_bits, build.kv_group_size
        if keys is not None:
            if bits is None:
                raise ValueError("state: stored rows without kv_bits in the meta's build options")
            dtype = getattr(mx, fmt[2])
            if (keys.dtype != mx.uint32 or values.dtype != mx.uint32
                    or keys.shape[3] != row_words(fmt[0], dtype, g, bits)
                    or values.shape[3] != row_words(fmt[1], dtype, g, bits)):
                raise ValueError(f"state: stored rows {tuple(keys.shape)}, {tuple(values.shape)} do not "
                                 f"match kv_format {fmt} at kv_bits={bits}, kv_group_size={g}")
        return QuantizedRows(bits, g, fmt, extra[0])

    @staticmethod
    def converted(keys, values, held_keys, bits: int, group_size: int) -> tuple:
        """``(storage, stored keys, stored values)`` of dense rows ``keys``/``values``
        (``None`` while empty) quantized; ``held_keys``: the full-precision keys the
        quantized cache must hold (see the module docstring), or ``None``.

        Raises:
            ValueError: a head dimension not a multiple of ``group_size``.
        """
        new = QuantizedRows(bits, group_size)
        if keys is None:
            return new, None, None
        d = (keys.shape[3], values.shape[3])
        if d[0] % group_size or d[1] % group_size:
            raise ValueError(f"head_dim {d} is not a multiple of kv_group_size {group_size}")
        new.kv_format = (*d, str(keys.dtype).rsplit(".", 1)[-1])
        new.fp_keys = held_keys
        return new, new.pack(keys), new.pack(values)


def check_quantization(bits, group_size, max_rewind, head_dim) -> None:
    """The ``kv_bits`` / ``kv_group_size`` checks of the build options
    (:func:`~qfilters_mlx.config.build.check_build`), for the values a quantized cache is built
    with (``ValueError`` naming the value)."""
    check_build("auto", max_rewind, bits, group_size, head_dim)


def quantized_copy(cache, cls, bits: int, group_size: int):
    """``cache`` (a ``QFiltersKVCache``) as a ``cls`` (its quantized sibling) storing its K/V
    quantized: the same kept rows, scores, positions, filter and slot layout
    (``QuantizedQFiltersKVCache.from_cache`` documents the contract and the errors); a cache
    already quantized with these ``bits`` / ``group_size`` is returned as is. Reads the
    cache's own (underscore) state, as the cache's other component modules do."""
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
            "or build the caches with kv_bits= (KVCacheBuilder) to quantize from the first token")
    config = cache.config
    check_quantization(bits, group_size, cache.max_rewind, config.head_dim)
    held = None
    if cache.keys is not None and cache._needs_filter and not cache.evicted:
        m = min(cache._n, config.qfilters_calib_tokens) if cache.scoring_ready else cache._n
        held = cache.keys[:, :, :m]
    storage, keys, values = QuantizedRows.converted(cache.keys, cache.values, held, bits, group_size)
    new = cls.__new__(cls)
    new.__dict__.update(cache.__dict__)
    new.config, new.storage, new.bits, new.group_size = config, storage, bits, group_size
    new._journal = RewindJournal(0)
    if cache.rows.keys is not None:
        new.rows = cache.rows._replace(keys=keys, values=values)
    return new

