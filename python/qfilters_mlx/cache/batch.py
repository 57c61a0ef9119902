"""``BatchQFiltersCache``: the batch side of mlx-lm's cache protocol for eviction caches.

mlx-lm 0.32 batches with ``BatchKVCache`` / ``BatchRotatingKVCache``: ``merge``
(per-sequence caches -> one batch cache), ``extract(idx)``, ``filter``,
``extend``, ``prepare`` / ``finalize`` (left and right padding), per-row
``offset`` and ``make_mask``; ``BatchGenerator`` (and so ``batch_generate`` and
``mlx_lm.server``) calls exactly these. Here every row is its own per-sequence
:class:`~qfilters_mlx.cache.kv_cache.QFiltersKVCache` (batch size 1), so a row's
kept set (tokens, scores, sinks = its first ``n_sink`` real tokens, recent
window, filter) is by construction the one it would have alone:

* ``update_and_fetch(keys [B, H_kv, N, D], values)`` hands row ``i`` only its
  real tokens (padding is dropped before the row cache sees it: never scored,
  kept, counted in ``tokens_seen`` or bytes), and returns the rows' keys/values
  left-padded with zeros to the longest row, ``[B, H_kv, S, D]``;
* ``make_mask`` (called before the update) hides the padding columns and is
  causal over each row's real keys (:func:`~.batch_rows.padded_mask`);
* ``offset`` is the ``[B]`` int array of the rows' RoPE positions.

Cost against one ``BatchRotatingKVCache``: the per-row updates are ``B`` small
graphs per layer, and the padded keys/values are one concatenation (a copy of
the kept rows, ``2 * B * H_kv * S * D * itemsize`` bytes) per layer and call.

Quantized rows and save/load come from
:class:`~qfilters_mlx.cache.batch_storage.BatchStorageMixin`: ``state`` is every
row's state, in row order (7 entries each, see
:mod:`~qfilters_mlx.cache.persistence`); mlx-lm's
``save_prompt_cache`` / ``load_prompt_cache`` round-trip it (pending padding of
an unfinished ``prepare`` is not saved).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import _BaseCache

from qfilters_mlx.cache.batch_rows import check_rows, padded_mask, plan_rows
from qfilters_mlx.cache.batch_storage import BatchStorageMixin

__all__ = ["BatchQFiltersCache"]


class BatchQFiltersCache(BatchStorageMixin, _BaseCache):
    """One layer's eviction caches of ``B`` sequences, served as the rows of one batch.

    Args:
        caches: per-sequence eviction caches (batch size 1, same configuration;
            see :func:`~.batch_rows.check_rows`). They are used as they are
            (not copied); :meth:`merge` copies.
        left_padding: per row, padding tokens at the start of the next call(s)
            (mlx-lm's ``BatchKVCache(left_padding)``), or ``None``.

    Raises:
        ValueError: the rows may not share a batch (see :func:`check_rows`).
    """


    def __init__(self, caches, left_padding=None):
        caches = list(caches)
        check_rows(caches, "BatchQFiltersCache")
        self.caches = caches
        self._skip = [0] * len(caches) if left_padding is None else [int(p) for p in left_padding]
        if len(self._skip) != len(caches):
            raise ValueError(f"left_padding has {len(self._skip)} entries for {len(caches)} rows")
        self._remaining = [None] * len(caches)
        self._last = None  # plan of the last update, for observe_queries
        self._last_kv = None  # what the last update returned (keys_and_values)

    # ------------------------------------------------------------ batch protocol
    @classmethod
    def merge(cls, caches) -> "BatchQFiltersCache":
        """One batch cache from per-sequence caches (copied: the inputs never change).

        Raises:
            ValueError: different cache kinds, configurations, layers or given
                filters, or an input holding more than one sequence.
        """
        caches = list(caches)
        check_rows(caches, "merge")
        return cls([copy.deepcopy(c) for c in caches])

    def extract(self, idx: int):
        """A copy of row ``idx`` as a per-sequence cache; it continues exactly as the row would.

        Raises:
            ValueError: the row still has padding pending (inside ``prepare``/``finalize``).
        """
        if self._skip[idx] or self._remaining[idx] is not None:
            raise ValueError(f"extract({idx}): the row is inside a padded prompt (prepare() "
                             "without finalize()); extract it after finalize()")
        return copy.deepcopy(self.caches[idx])

    def filter(self, batch_indices) -> None:
        """Keep only the rows ``batch_indices`` (list or ``mx.array``), in that order."""
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.caches = [self.caches[i] for i in idx]
        self._skip = [self._skip[i] for i in idx]
        self._remaining = [self._remaining[i] for i in idx]
        self._last = None
        self._last_kv = None

    def extend(self, other: "BatchQFiltersCache") -> None:
        """Append the rows of ``other`` (rows joining mid-generation).

        Raises:
            TypeError: ``other`` is not a :class:`BatchQFiltersCache`.
            ValueError: its rows differ in configuration (see :func:`check_rows`).
        """
        if not isinstance(other, BatchQFiltersCache):
            raise TypeError(f"extend: cannot add a {type(other).__name__} to a BatchQFiltersCache "
                            "(a batch never mixes cache kinds)")
        if self.caches and other.caches:
            check_rows([self.caches[0], *other.caches], "extend")
        self.caches += other.caches
        self._skip += other._skip
        self._remaining += other._remaining
        self._last = None
        self._last_kv = None

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Announce padding of the next call(s), as mlx-lm's batch caches take it.

        ``left_padding[i]`` tokens at the start of row ``i`` are dropped;
        with ``right_padding`` (any > 0), only ``lengths[i]`` tokens after them are real.
        """
        if left_padding is not None:
            self._skip = [s + int(p) for s, p in zip(self._skip, _ints(left_padding))]
        if right_padding is not None and max(_ints(right_padding)) > 0:
            if lengths is None:
                raise ValueError("prepare: right_padding needs lengths")
            self._remaining = _ints(lengths)

    def finalize(self) -> None:
        """End of a padded prompt: every announced real token must have arrived.

        Raises:
            RuntimeError: some row got fewer tokens than ``prepare`` announced.
        """
        short = [i for i, r in enumerate(self._remaining) if r]
        if short:
            raise RuntimeError(f"finalize: rows {short} did not receive all their announced tokens")
        self._remaining = [None] * len(self.caches)

    # ------------------------------------------------------------ cache protocol
    @property
    def offset(self) -> mx.array:
        """``[B]`` int32: each row's RoPE position of its next real token (the
        first token of the next call is at ``offset - left padding``)."""
        return mx.array([c.offset - s for c, s in zip(self.caches, self._skip)], dtype=mx.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Give each row its real tokens; return ``[B, H_kv, S, D]`` keys/values left-padded
        with zeros (``S`` = longest row; see :meth:`make_mask`).

        Raises:
            ValueError: ``keys`` has another batch size than the number of rows;
                a row returned an unexpected number of keys (layers out of step).
        """
        B, H, N = keys.shape[:3]
        if B != len(self.caches):
            raise ValueError(f"keys hold {B} sequences for {len(self.caches)} batch rows")
        if N == 0:
            raise ValueError("keys must hold at least one token (L >= 1)")
        self._last_kv = None
        plan = plan_rows(N, self._skip, self._remaining)
        sizes = self._sizes(plan)
        # Evaluate (or schedule) this layer's inputs once: each row then walks only its own graph.
        (mx.eval if N > 1 else mx.async_eval)(keys, values)
        outs = []
        for i, (c, (s, n)) in enumerate(zip(self.caches, plan)):
            outs.append(None if n == 0 else
                        c.update_and_fetch(keys[i : i + 1, :, s : s + n], values[i : i + 1, :, s : s + n]))
        for i, ((s, n), out) in enumerate(zip(plan, outs)):
            self._skip[i] -= s
            if self._remaining[i] is not None:
                self._remaining[i] -= n
            if out is not None and _rows(out[0]) != sizes[i] + n:
                raise ValueError(f"row {i} returned {_rows(out[0])} keys, expected {sizes[i] + n}")
        self._last = plan
        S = max(max(sizes[i] + n for i, (_, n) in enumerate(plan)), 1)
        out = _stack(outs, keys, values, S)
        if self.caches[0].keep_last_kv:
            self._last_kv = out
        return out

    def keys_and_values(self):
        """What the last :meth:`update_and_fetch` returned (``[B, H_kv, S, D]`` each, rows
        left-padded), as :meth:`QFiltersKVCache.keys_and_values` for a batch.

        Raises:
            ValueError: the rows do not keep it (``keep_last_kv``), or no update since the
                batch was built, filtered, extended or trimmed.
        """
        if not self.caches[0].keep_last_kv:
            self.caches[0].keys_and_values()  # raises, naming keep_last_kv
        if self._last_kv is None:
            raise ValueError("keys_and_values() before any update_and_fetch of this batch")
        return self._last_kv

    def _sizes(self, plan) -> list[int]:
        """Each row's stored tokens before this call, after the compress-once trigger of its
        ``n`` tokens (a compress-once row compresses at its first single-token call)."""
        for c, (_, n) in zip(self.caches, plan):
            if n:
                c.prepare_call(n)
        return [c.size() for c in self.caches]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for the next call of ``N`` tokens: the row cache's own mask when no row is
        padded, else a boolean ``[B, 1, N, S]`` array (:func:`padded_mask`).

        Raises:
            ValueError: ``window_size`` (sliding-window layers keep the model's own caches).
        """
        if window_size is not None:
            raise ValueError("BatchQFiltersCache does not support sliding-window masks")
        plan = plan_rows(N, self._skip, self._remaining)
        sizes = self._sizes(plan)
        if len(set(sizes)) == 1 and all(p == (0, N) for p in plan):
            return self.caches[0].make_mask(N, return_array=return_array)
        return padded_mask(N, sizes, plan)

    # ------------------------------------------------------------ queries
    @property
    def needs_queries(self) -> bool:
        return any(getattr(c, "needs_queries", False) for c in self.caches)

    @property
    def queries_observed(self) -> bool:
        return all(c.queries_observed for c in self.caches)

    @queries_observed.setter
    def queries_observed(self, value: bool) -> None:
        for c in self.caches:
            c.queries_observed = value

    def observe_queries(self, queries: mx.array) -> None:
        """Row ``i`` of this call's queries ``[B, H_q, N, D]``, its real tokens only, goes to row ``i``."""
        if self._last is None or queries.shape[0] != len(self.caches):
            raise ValueError("observe_queries: queries must follow an update of this batch "
                             f"(got {tuple(queries.shape)} for {len(self.caches)} rows)")
        for i, (c, (s, n)) in enumerate(zip(self.caches, self._last)):
            if n:
                c.observe_queries(queries[i : i + 1, :, s : s + n])

    # ------------------------------------------------------------ the rest
    def size(self) -> int:
        """Longest row (stored tokens per KV head)."""
        return max((c.size() for c in self.caches), default=0)

    def sizes(self) -> list[int]:
        return [c.size() for c in self.caches]

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    @property
    def nbytes(self) -> int:
        """Bytes held by the rows (no padding: padding is never stored)."""
        return sum(c.nbytes for c in self.caches)

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        """Trim ``n`` tokens from every row (as ``BatchKVCache.trim``); all rows or none.

        Raises:
            ValueError: some row cannot rewind ``n`` tokens, or the rows would trim
                different numbers of tokens; checked for every row before any changes.
        """
        counts = []
        for i, c in enumerate(self.caches):
            try:
                counts.append(c.trim_count(n))
            except ValueError as err:
                raise ValueError(f"trim({n}): row {i} cannot: {err}; no row was trimmed") from err
        if len(set(counts)) > 1:
            raise ValueError(f"trim({n}): the rows would trim {counts} tokens; no row was trimmed "
                             "(trim rows one by one)")
        self._last_kv = None
        done = [c.trim(n) for c in self.caches]
        return done[0] if done else 0


def _rows(k) -> int:
    """Rows of returned keys: an array, or a quantized ``(packed, scales, biases)`` triple."""
    return (k[0] if isinstance(k, tuple) else k).shape[2]


def _ints(x) -> list[int]:
    return [int(a) for a in (x.tolist() if isinstance(x, mx.array) else x)]


def _stack(outs, keys, values, S):
    """Concatenate per-row outputs along the batch, left-padding each to ``S`` with zeros.

    Quantized rows return ``(packed, scales, biases)`` triples: each part is padded and
    stacked (zero words, scales and biases dequantize to zeros, which the mask hides). A
    row that got no tokens this call (``None``) is all padding, shaped like the others."""
    template = next((out for out in outs if out is not None), None)

    def pad(x, like):
        n = S - (0 if x is None else x.shape[2])
        if n == 0:
            return x
        z = mx.zeros((1, like.shape[1], n, like.shape[3]), like.dtype)
        return z if x is None else mx.concatenate([z, x], axis=2)

    def part(j, fallback):
        like = fallback if template is None else template[j]
        if isinstance(like, tuple):
            res = [tuple(pad(None if out is None else out[j][m], like[m]) for m in range(len(like)))
                   for out in outs]
            return tuple(res[0][m] if len(res) == 1 else mx.concatenate([r[m] for r in res], axis=0)
                         for m in range(len(like)))
        res = [pad(None if out is None else out[j], like) for out in outs]
        return res[0] if len(res) == 1 else mx.concatenate(res, axis=0)

    return part(0, keys), part(1, values)


# mlx-lm's load_prompt_cache resolves cache classes by name in its own module.
mlx_cache.BatchQFiltersCache = BatchQFiltersCache
