"""``DenseRows``: the row storage of ``QFiltersKVCache``, K/V stored as given (the quantized
one, :class:`~qfilters_mlx.cache.quantized.QuantizedRows`, has the same methods)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx

__all__ = ["DenseRows"]


@dataclasses.dataclass
class DenseRows:
    """K/V rows stored as given; it holds nothing, so any two are equal."""

    nbytes = 0  # bytes held besides the stored rows

    def check(self, keys, values) -> None:
        """Nothing to check beyond the cache's own input checks."""

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
