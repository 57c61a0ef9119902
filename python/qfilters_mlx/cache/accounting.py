"""Byte accounting of ``QFiltersKVCache`` (mixin): what it holds and what the method needs."""

from __future__ import annotations

FILTER_BYTES_PER_ELEMENT = 4  # filters are float32


class ByteAccountingMixin:
    """``nbytes``, ``tokens_seen``/``tokens_kept``, ``full_seq_bytes``,
    ``qfilters_kept_bytes`` and ``compression_ratio``."""

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds: buffers at capacity, scores, positions,
        filter, and the rewind journal (:attr:`journal_nbytes`)."""
        arrays = [self.keys, self.values, self.scores, self.positions, self.filter]
        return sum(a.nbytes for a in arrays if a is not None) + self.journal_nbytes

    @property
    def journal_nbytes(self) -> int:
        """Bytes held only to make rewinds exact (``qfilters_max_rewind``): per decode step
        recorded, the slot and the rows it held (``B H (4 + (D_k + D_v) itemsize + 12)``;
        the step entering slot mode: the scores/positions buffers before it, ``12 B H capacity``);
        per multi-token call, the rows its eviction dropped; plus the free slot's rows."""
        rows = self._victim_rows
        pending = 0 if rows is None else sum(a.nbytes for a in rows)
        return self._journal.nbytes + pending

    @property
    def tokens_seen(self) -> int:
        """Tokens fed so far (equals ``offset``)."""
        return self.offset

    @property
    def tokens_kept(self) -> int:
        """Tokens stored per (batch row, KV head)."""
        return self._n

    def _kv_bytes(self, tokens: int) -> int:
        if self.keys is None:
            return 0
        B, H, _, Dk = self.keys.shape
        Dv = self.values.shape[3]
        return B * H * tokens * (Dk * self.keys.dtype.size + Dv * self.values.dtype.size)

    @property
    def kept_kv_bytes(self) -> int:
        """Bytes of the kept K/V rows alone (``size()`` rows as stored: packed words, scales
        and biases when quantized), without buffer slack, scores or filter."""
        return self._kv_bytes(self._n)

    @property
    def full_seq_bytes(self) -> int:
        """K/V bytes a full cache would hold for ``tokens_seen`` tokens, stored as this cache
        stores rows (with ``kv_bits``: a full ``QuantizedKVCache`` of the same bits)."""
        return self._kv_bytes(self.offset)

    @property
    def qfilters_kept_bytes(self) -> int:
        """Bytes the method needs: kept K/V, their float32 scores (when ranked by
        score) and the frozen filter in full (``H_kv * D * 4`` bytes)."""
        if self.keys is None:
            return 0
        B, H = self.keys.shape[:2]
        total = self._kv_bytes(self._n)
        if self.method in ("qfilters", "l2norm", "random"):
            total += B * H * self._n * 4
        if self.filter is not None:
            total += self.filter.size * FILTER_BYTES_PER_ELEMENT
        return total

    @property
    def compression_ratio(self) -> float:
        """``full_seq_bytes / qfilters_kept_bytes`` (1.0 when empty)."""
        kept = self.qfilters_kept_bytes
        return self.full_seq_bytes / kept if kept else 1.0
