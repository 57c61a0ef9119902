"""``BatchStorageMixin``: the storage side of :class:`~qfilters_mlx.cache.batch.BatchQFiltersCache`.

Quantized rows (``bits``, ``group_size``, ``to_quantized``: mlx-lm's attention takes
the quantized path when a cache has ``bits``) and save/load (``state``: every row's
state, in row order, 7 entries each, 8 for quantized rows; see
:mod:`qfilters_mlx.cache.persistence`). The mixin reads the batch's
``caches``, ``_skip`` and ``_remaining`` and rebuilds it with ``__init__(rows)``.
"""

from __future__ import annotations

from qfilters_mlx.cache.persistence import read_meta
from qfilters_mlx.config import build_from_state

__all__ = ["BatchStorageMixin"]

_META = 6  # index of the JSON meta in a row's state (7 entries; 8 with kv_bits: + fp_keys)


class BatchStorageMixin:
    """Quantized rows and ``state`` of a batch of per-sequence eviction caches (``self.caches``)."""

    # ------------------------------------------------------------ quantized rows (kv_bits)
    @property
    def bits(self) -> int:
        """The rows' ``kv_bits`` (mlx-lm's attention takes the quantized path when a cache has
        ``bits``); absent (``AttributeError``) when the rows store K/V unquantized."""
        bits = getattr(self.caches[0], "bits", None) if self.caches else None
        if bits is None:
            raise AttributeError("bits")
        return bits

    @property
    def group_size(self) -> int:
        """The rows' ``kv_group_size``; absent when the rows are unquantized (see :attr:`bits`)."""
        self.bits  # noqa: B018 - raises AttributeError for unquantized rows
        return self.caches[0].group_size

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "BatchStorageMixin":
        """The batch with every row converted by ``QFiltersKVCache.to_quantized`` (each row
        continues exactly as it would alone); pending padding carries over.

        The rows are converted into new caches; this batch is not changed.

        Raises:
            ValueError: what a row's ``to_quantized`` raises.
        """
        rows = [c.to_quantized(group_size=group_size, bits=bits) for c in self.caches]
        out = type(self)(rows)
        out._skip, out._remaining = list(self._skip), list(self._remaining)
        return out

    @property
    def state(self):
        """Every row's ``state`` (7 entries each; 8 for quantized rows), in row order."""
        return tuple(x for c in self.caches for x in c.state)

    @state.setter
    def state(self, v):
        # The row class as mlx-lm's loader resolves it (registered by qfilters_mlx.cache.kv_cache,
        # which mlx-lm's cache module imports through qfilters_mlx.prompt_cache_hook).
        rows, i = [], 0
        while i < len(v):
            if i + _META >= len(v) or not isinstance(v[i + _META], str):
                raise ValueError(f"state: row {len(rows)} has no meta string at entry {i + _META}")
            cls, n = _row_class(v[i + _META])
            if i + n > len(v):
                raise ValueError(f"state: row {len(rows)} needs {n} entries, {len(v) - i} left")
            rows.append(cls.from_state(tuple(v[i : i + n])))
            i += n
        self.__init__(rows)


def _row_class(meta: str) -> tuple:
    """``(class, state entries)`` of a saved row from its meta: quantized storage (8 entries)
    when its build options have ``kv_bits``, else 7 (the meta read as the row's loader reads
    it, :func:`~qfilters_mlx.cache.persistence.read_meta`; classes resolved in mlx-lm's cache module, where
    ``qfilters_mlx.cache.kv_cache`` registers both; imported here, not at module level: the
    startup hook registers our classes while ``mlx_lm.models.cache`` is first imported, which
    would re-enter this module half-initialized)."""
    try:
        quantized = build_from_state(read_meta(meta)["build"]).kv_bits is not None
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"state: bad row meta ({err})") from err
    import mlx_lm.models.cache as mlx_cache

    return (mlx_cache.QuantizedQFiltersKVCache, 8) if quantized else (mlx_cache.QFiltersKVCache, 7)
