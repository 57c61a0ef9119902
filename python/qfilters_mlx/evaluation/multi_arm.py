"""Many cache configurations in one batch: one row per arm.

:class:`MultiArmCache` holds, for one layer, one cache per arm (each with
batch size 1) and serves them as the rows of one batch. Rows may store
different numbers of tokens (different budgets): the returned keys and values
are left-padded with zeros to the longest row and
:meth:`MultiArmCache.make_mask` masks the padding out, so one model call
advances every arm by the same tokens. Each arm's cache sees exactly the
keys/values of its own row, so its eviction is the one it would make alone
(checked in ``tests/evaluation/test_evaluation.py``). Quantized caches (``kv_bits``) batch
through :class:`QuantizedMultiArmCache` (one ``bits`` per batch).

:func:`batch_caches` turns per-arm cache lists into the per-layer list a model
call takes (the arm's own list when there is one arm).
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

__all__ = ["MultiArmCache", "QuantizedMultiArmCache", "batch_caches"]


class MultiArmCache:
    """One layer's caches of several arms, served as the rows of one batch.

    Args:
        caches: one cache per arm (mlx-lm protocol, batch size 1 each), e.g.
            ``QFiltersKVCache`` objects with different configurations.

    ``update_and_fetch`` gives row ``i`` of the keys/values to ``caches[i]``
    and returns the rows left-padded with zeros to the longest one;
    ``make_mask`` (called by the model *before* ``update_and_fetch``) returns
    a boolean ``[B, 1, N, S_max + N]`` mask that hides the padding and is
    causal (bottom-right aligned) over the real keys. When all rows hold the
    same number of tokens it returns the first cache's own mask.
    """

    def __init__(self, caches):
        self.caches = list(caches)
        if not self.caches:
            raise ValueError("MultiArmCache needs at least one cache")

    def __len__(self) -> int:  # mlx-lm tests `if cache`: keep it truthy
        return len(self.caches)

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def size(self) -> int:
        return max(c.size() for c in self.caches)

    def sizes(self) -> list[int]:
        return [c.size() for c in self.caches]

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.caches):
            raise ValueError(f"batch has {keys.shape[0]} rows for {len(self.caches)} arms")
        # One evaluation of this layer's inputs: each cache then schedules
        # (``async_eval``) only its own small graph instead of walking the
        # whole unevaluated model graph once per row.
        mx.eval(keys, values)
        outs = [c.update_and_fetch(keys[i : i + 1], values[i : i + 1]) for i, c in enumerate(self.caches)]
        S = max(_rows(k) for k, _ in outs)

        def pad(x):
            n = S - x.shape[2]
            if n == 0:
                return x
            return mx.concatenate([mx.zeros((*x.shape[:2], n, x.shape[3]), x.dtype), x], axis=2)

        # Quantized caches return (packed, scales, biases) triples: pad and stack each part.
        return tuple(tree_map(lambda *xs: mx.concatenate([pad(x) for x in xs], axis=0),
                              *[out[j] for out in outs]) for j in (0, 1))

    @property
    def queries_observed(self) -> bool:
        return all(getattr(c, "queries_observed", False) for c in self.caches)

    @queries_observed.setter
    def queries_observed(self, value: bool) -> None:
        for c in self.caches:
            if hasattr(c, "observe_queries"):
                c.queries_observed = value

    def observe_queries(self, queries: mx.array) -> None:
        """Row ``i`` of this layer's queries goes to ``caches[i]`` (query-based filters)."""
        for i, c in enumerate(self.caches):
            fn = getattr(c, "observe_queries", None)
            if fn is not None:
                fn(queries[i : i + 1])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("MultiArmCache does not support sliding-window masks")
        sizes = self.sizes()
        if len(set(sizes)) == 1:
            return self.caches[0].make_mask(N, return_array=return_array)
        S = max(sizes)
        j = mx.arange(S + N)
        causal = j[None, :] <= (S + mx.arange(N))[:, None]  # [N, S + N]
        valid = j[None, :] >= (S - mx.array(sizes))[:, None]  # [B, S + N]
        return valid[:, None, None, :] & causal[None, None]


def _rows(k) -> int:
    return (k[0] if isinstance(k, tuple) else k).shape[2]


class QuantizedMultiArmCache(MultiArmCache):
    """:class:`MultiArmCache` of quantized caches (``kv_bits``), all with the same ``bits``
    and ``group_size`` (mlx-lm's quantized attention reads them from the batch cache):
    rows are ``(packed, scales, biases)`` triples, zero-padded like the plain ones.

    Raises:
        ValueError: the caches differ in ``bits`` / ``group_size``.
    """

    def __init__(self, caches):
        super().__init__(caches)
        kinds = {(c.bits, c.group_size) for c in self.caches}
        if len(kinds) != 1:
            raise ValueError(f"one batch needs one kv_bits/kv_group_size, got {sorted(kinds)}")
        self.bits, self.group_size = kinds.pop()


def batch_caches(rows: list[list]) -> list:
    """Per-layer caches for a batch of arms.

    Args:
        rows: per arm, one cache per layer (batch size 1 each).

    Returns:
        ``rows[0]`` itself for one arm, else one :class:`MultiArmCache` per layer
        (row ``i`` of the batch is arm ``i``).

    Raises:
        ValueError: no rows, or rows with different numbers of layers.
    """
    if not rows:
        raise ValueError("batch_caches needs at least one row")
    if len(rows) == 1:
        return rows[0]
    n_layers = len(rows[0])
    if any(len(r) != n_layers for r in rows):
        raise ValueError("every row needs one cache per layer")
    out = []
    for i in range(n_layers):
        layer = [r[i] for r in rows]
        quantized = [hasattr(c, "bits") for c in layer]
        if any(quantized) and not all(quantized):
            raise ValueError("quantized (kv_bits) and unquantized arms cannot share a batch")
        out.append((QuantizedMultiArmCache if all(quantized) else MultiArmCache)(layer))
    return out
