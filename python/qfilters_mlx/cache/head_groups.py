"""``HeadGroupsKVCache``: one attention layer's KV heads split into groups, each group stored
at its own budget as its own arrays (one :class:`~qfilters_mlx.cache.kv_cache.QFiltersKVCache`
per group, over that group's heads).

The layout is DuoAttention's (Xiao et al., arXiv:2410.10819): the groups hold disjoint KV
heads, so attention runs once per group over that group's keys and the outputs go back in head
order; no log-sum-exp merge is needed. The tokens held are the sum of the groups' budgets
(each group holds ``budget + 1`` slots per head in slot mode, as the one-budget cache does),
with no padding kept between steps.

Attention: ``update_and_fetch`` returns one ``(keys, values)`` array pair per group
(:class:`GroupedKV`), which no plain attention call can take. mlx-lm's layers call
``scaled_dot_product_attention`` from their module's globals; :func:`install_grouped_attention`
(run when the first head-group cache is built or loaded, once per process) wraps it in every
loaded ``mlx_lm.models`` module and in ``mlx_lm.models.base`` (so modules imported later take
the wrapper too). The wrapper passes every other cache to mlx-lm's function unchanged; for a
head-group cache it runs :meth:`HeadGroupsKVCache.attend`. Masks: ``None`` (one new token) and
``"causal"`` (bottom-right aligned, so it fits each group's own length); an array mask or a
sliding window raises ``ValueError`` naming the layer.

Paths that refuse head groups with a ``ValueError`` naming the cause: batch generation
(``merge``, mlx-lm's ``BatchGenerator``), ``keys_and_values`` (layers whose K/V another layer
reads). Everything else is delegated to the groups' caches: trim/rewind (all groups or none),
``to_quantized`` (``kv_bits``), ``state`` (mlx-lm's ``save_prompt_cache`` /
``load_prompt_cache``), byte counts (sums).
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import _BaseCache

from qfilters_mlx.cache.inputs import check_update
from qfilters_mlx.cache.rewind import trim_count
from qfilters_mlx.config import FORMAT

__all__ = ["GroupedKV", "HeadGroupsKVCache", "install_grouped_attention"]

_KIND = "head_groups"


def _group_classes() -> dict:
    """The classes a group's cache may have, by name (imported here: this module is imported
    while ``mlx_lm.models.cache`` loads, possibly from inside :mod:`.kv_cache`'s own import)."""
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache, QuantizedQFiltersKVCache

    return {c.__name__: c for c in (QFiltersKVCache, QuantizedQFiltersKVCache)}


class GroupedKV(tuple):
    """What ``HeadGroupsKVCache.update_and_fetch`` returns for keys (and for values): one entry
    per group, ``[B, H_g, S_g + L, D]`` each (``(packed, scales, biases)`` when quantized)."""


def _runs(heads: list[int]):
    """``slice`` when ``heads`` are consecutive ascending, else an ``mx.array`` index."""
    if heads == list(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0], heads[0] + len(heads))
    return mx.array(heads, dtype=mx.int32)


class HeadGroupsKVCache(_BaseCache):
    """One attention layer's KV heads in groups, each its own eviction cache at its own budget.

    Args:
        groups: ``[(heads, cache), ...]``: each group's KV-head indices (ascending ints) and
            the :class:`QFiltersKVCache` (or quantized sibling) holding them, built for
            ``len(heads)`` heads; the heads of all groups are ``0 .. H_kv - 1``, each once.

    Attributes:
        heads: each group's KV heads (tuples). caches: each group's cache.
        n_kv_heads: ``H_kv`` of the layer.

    Raises:
        TypeError: a group's cache is not a ``QFiltersKVCache``.
        ValueError: no groups; the heads are not a partition of ``0 .. H_kv - 1``; a group's
            heads are not ascending; caches of different layers or offsets.
    """

    def __init__(self, groups):
        groups = list(groups)
        self._set([tuple(int(h) for h in hs) for hs, _ in groups], [c for _, c in groups])

    def _set(self, heads: list[tuple], caches: list) -> None:
        if not heads:
            raise ValueError("HeadGroupsKVCache needs at least one group")
        base = _group_classes()["QFiltersKVCache"]
        for c in caches:
            if not isinstance(c, base):
                raise TypeError(f"a head group's cache must be a QFiltersKVCache, got {type(c).__name__}")
        flat = sorted(h for hs in heads for h in hs)
        if flat != list(range(len(flat))) or any(list(hs) != sorted(hs) or not hs for hs in heads):
            raise ValueError(f"head groups must split the KV heads 0..H_kv-1 into non-empty ascending "
                             f"groups, each head once; got {heads}")
        if len({(c.layer_idx, c.offset) for c in caches}) != 1:
            raise ValueError("the caches of a layer's head groups must share layer_idx and offset, got "
                             f"{[(c.layer_idx, c.offset) for c in caches]}")
        self.heads, self.caches, self.n_kv_heads = tuple(heads), list(caches), len(flat)
        order = [h for hs in heads for h in hs]
        # concatenated group outputs -> head order (None: already in order)
        self._order = None if order == flat else [order.index(h) for h in flat]
        self._kv_index = [_runs(list(hs)) for hs in heads]
        self._plans = {}  # query heads per group, by query heads per KV head
        install_grouped_attention()

    # ------------------------------------------------------------ cache protocol
    @property
    def offset(self) -> int:
        """Absolute number of tokens fed (every group's)."""
        return self.caches[0].offset

    @property
    def layer_idx(self) -> int:
        return self.caches[0].layer_idx

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Insert ``L`` new tokens into every group and return what each group attends to.

        Args:
            keys, values: ``[B, H_kv, L, D]`` (RoPE applied).

        Returns:
            ``(GroupedKV, GroupedKV)``: per group ``[B, H_g, S_g + L, D]`` keys and values,
            in the order of :attr:`heads`; only the grouped attention
            (:func:`install_grouped_attention`) takes them.

        Raises:
            TypeError, ValueError: a bad input (as ``QFiltersKVCache.update_and_fetch``) or a
                head count other than ``n_kv_heads``; raised before any group changes.
        """
        if not isinstance(keys, mx.array) or keys.ndim != 4 or keys.shape[1] != self.n_kv_heads:
            raise ValueError(f"layer {self.layer_idx}: keys must be [B, {self.n_kv_heads}, L, D] "
                             f"(the layer's KV heads), got {getattr(keys, 'shape', type(keys).__name__)}")
        parts = [(keys[:, i], values[:, i]) for i in self._kv_index]
        for c, (k, v) in zip(self.caches, parts):
            check_update(c, k, v)  # every group checked before any changes
        out = [c._fetch(k, v) for c, (k, v) in zip(self.caches, parts)]
        return GroupedKV(o[0] for o in out), GroupedKV(o[1] for o in out)

    def attend(self, queries, keys, values, scale, mask, sinks=None, sdpa=None):
        """Attention of ``queries [B, H_q, L, D]`` over each group's keys and values (what
        :meth:`update_and_fetch` returned), once per group with that group's query heads
        (GQA: query head ``j`` reads KV head ``j // (H_q / H_kv)``), outputs back in head
        order: ``[B, H_q, L, D_v]``. ``sdpa``: mlx-lm's ``scaled_dot_product_attention``
        (each group's cache decides dense or quantized attention).

        Raises:
            ValueError: a mask other than ``None`` / ``"causal"``; ``keys`` not from this cache.
        """
        if mask is not None and not (isinstance(mask, str) and mask == "causal"):
            raise ValueError(f"layer {self.layer_idx}: head groups attend with the causal mask only "
                             "(an array mask or sliding window needs one length for every head)")
        if not isinstance(keys, GroupedKV) or len(keys) != len(self.caches):
            raise ValueError(f"layer {self.layer_idx}: head-group attention needs the keys this "
                             "cache's update_and_fetch returned")
        q_index, q_order = self._query_plan(queries.shape[1] // self.n_kv_heads)
        outs = []
        for i, c, k, v in zip(q_index, self.caches, keys, values):
            s = None if sinks is None else sinks[i]
            outs.append(sdpa(queries[:, i], k, v, cache=c, scale=scale, mask=mask, sinks=s))
        out = mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
        return out if q_order is None else out[:, q_order]

    def _query_plan(self, rep: int):
        """Per group the query heads (``rep`` per KV head), and the order putting the groups'
        concatenated outputs back in head order (``None``: already in order); made once per ``rep``."""
        if rep not in self._plans:
            q_index = [_runs([h * rep + j for h in hs for j in range(rep)]) for hs in self.heads]
            order = None if self._order is None else mx.array(
                [g * rep + j for g in self._order for j in range(rep)], dtype=mx.int32)
            self._plans[rep] = (q_index, order)
        return self._plans[rep]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """``None`` for one new token, else ``"causal"``.

        Raises:
            ValueError: ``return_array`` or ``window_size`` (groups differ in length).
        """
        if return_array or window_size is not None:
            raise ValueError(f"layer {self.layer_idx}: head groups have no one mask array (groups "
                             "hold different numbers of tokens); use the causal mask")
        return None if N == 1 else "causal"

    def size(self) -> int:
        """The most tokens any group stores per KV head."""
        return max(c.size() for c in self.caches)

    def empty(self) -> bool:
        return self.caches[0].empty()

    def kept_positions(self) -> tuple:
        """Per group ``[B, H_g, size_g]`` int64 absolute positions, ascending."""
        return tuple(c.kept_positions() for c in self.caches)

    # ------------------------------------------------------------------ rewinds
    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    @property
    def rewindable_tokens(self) -> int:
        return min(c.rewindable_tokens for c in self.caches)

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens of every group; returns the number removed.

        Raises:
            ValueError: a group cannot rewind ``n`` (nothing changes).
        """
        counts = {trim_count(c, n) for c in self.caches}  # raises before any change
        if len(counts) != 1:
            raise ValueError(f"layer {self.layer_idx}: head groups would trim {sorted(counts)} tokens")
        return [c.trim(n) for c in self.caches][0]

    # --------------------------------------------------------- batches, reuse
    @classmethod
    def merge(cls, caches):
        raise ValueError("head-group caches do not batch (mlx-lm's BatchGenerator / batch_generate): "
                         "build the caches without heads= for batch generation")

    def keys_and_values(self):
        raise ValueError(f"layer {self.layer_idx}: another layer reads this layer's K/V, which "
                         "head groups do not return as one array")

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """The same groups with their K/V stored quantized (mlx-lm's ``kv_bits``; see
        ``QFiltersKVCache.to_quantized``, whose errors it raises before anything changes)."""
        caches = [c.to_quantized(group_size=group_size, bits=bits) for c in self.caches]
        return HeadGroupsKVCache(zip(self.heads, caches))

    # ------------------------------------------------------------------ bytes
    def _sum(name):  # noqa: N805 - builds properties below
        return property(lambda self: sum(getattr(c, name) for c in self.caches),
                        doc=f"The groups' ``{name}``, summed.")

    nbytes = _sum("nbytes")
    journal_nbytes = _sum("journal_nbytes")
    kept_kv_bytes = _sum("kept_kv_bytes")
    full_seq_bytes = _sum("full_seq_bytes")
    qfilters_kept_bytes = _sum("qfilters_kept_bytes")
    del _sum

    @property
    def compression_ratio(self) -> float:
        kept = self.qfilters_kept_bytes
        return self.full_seq_bytes / kept if kept else 1.0

    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def evicted(self) -> bool:
        """Whether any group has evicted a token."""
        return any(c.evicted for c in self.caches)

    @property
    def tokens_kept(self) -> int:
        """Tokens stored per KV head, averaged over the heads (rounded down)."""
        return sum(c.tokens_kept * len(hs) for hs, c in zip(self.heads, self.caches)) // self.n_kv_heads

    def shrink_to_fit(self, journal_rows: int | None = None) -> None:
        for c in self.caches:
            c.shrink_to_fit(journal_rows)

    # ------------------------------------------------------------ save, load
    @property
    def state(self):
        """``[meta, state of group 0, state of group 1, ...]``: ``meta`` a JSON string
        (``"format"``, ``"kind": "head_groups"``, each group's heads and cache class), each
        group's the ``QFiltersKVCache.state`` of its cache."""
        meta = {"format": FORMAT, "kind": _KIND, "heads": [list(hs) for hs in self.heads],
                "classes": [type(c).__name__ for c in self.caches]}
        return [json.dumps(meta), *[c.state for c in self.caches]]

    @state.setter
    def state(self, v) -> None:
        if not isinstance(v, (list, tuple)) or len(v) < 2 or not isinstance(v[0], str):
            raise ValueError("a saved head-group cache is [meta, group states...]")
        try:
            meta = json.loads(v[0])
        except json.JSONDecodeError as err:
            raise ValueError(f"saved head-group meta is not JSON: {err}") from err
        if meta.get("format") != FORMAT or meta.get("kind") != _KIND:
            raise ValueError(f"saved head-group cache of format {meta.get('format')!r} / kind "
                             f"{meta.get('kind')!r}; this version reads format {FORMAT}, kind {_KIND!r}")
        heads, classes, known = meta.get("heads"), meta.get("classes"), _group_classes()
        if not isinstance(heads, list) or not isinstance(classes, list) or not (
                len(heads) == len(classes) == len(v) - 1) or any(c not in known for c in classes):
            raise ValueError(f"saved head-group meta names {classes!r} for {len(v) - 1} groups")
        caches = [known[name].from_state(s) for name, s in zip(classes, v[1:])]
        self._set([tuple(hs) for hs in heads], caches)


def install_grouped_attention() -> None:
    """Route mlx-lm's ``scaled_dot_product_attention`` of head-group caches through
    :meth:`HeadGroupsKVCache.attend` (module docstring); once per process, other caches
    unchanged (:func:`qfilters_mlx.filters.attention_route.routed` and ``rebind``)."""
    from mlx_lm.models import base

    from qfilters_mlx.filters.attention_route import rebind, routed

    if getattr(base.scaled_dot_product_attention, "_routes_head_groups", False):
        return
    original = base.scaled_dot_product_attention
    sdpa = routed(HeadGroupsKVCache, lambda q, k, v, cache, scale, mask, sinks:
                  cache.attend(q, k, v, scale, mask, sinks, original), original)
    sdpa._routes_head_groups = True
    rebind(original, sdpa)


# mlx-lm's load_prompt_cache resolves cache classes by name in its own module
mlx_cache.HeadGroupsKVCache = HeadGroupsKVCache
