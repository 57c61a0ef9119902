"""What :class:`~qfilters_mlx.cache.builder.KVCacheBuilder` built: :class:`BuildReport` (which
cache slots got an eviction cache, what the others keep, the filter in use),
:class:`BudgetedCaches` (the cache list with its report) and :func:`describe`."""

from __future__ import annotations

from dataclasses import dataclass

from qfilters_mlx.cache.head_groups import HeadGroupsKVCache
from qfilters_mlx.cache.kv_cache import QFiltersKVCache
from qfilters_mlx.model_info import BOUNDED_CACHES, CacheSlot, walk

__all__ = ["BudgetedCaches", "BuildReport", "describe", "eviction_caches", "layer_names"]


def layer_names(slots) -> str:
    """The slots' names, comma-separated (``"0, 1, 5.0"``)."""
    return ", ".join(s.name for s in slots)


@dataclass(frozen=True)
class BuildReport:
    """Which cache slots got an eviction cache and what the others keep.

    Attributes:
        budgeted: slots replaced by :class:`QFiltersKVCache`.
        kept: slots that keep the model's own cache (with :attr:`CacheSlot.cache_type`).
        shard: on one rank of a tensor-parallel model, its rank, group size and KV heads
            (:class:`qfilters_mlx.sharding.ShardInfo`; the caches hold those heads); else ``None``.
        shared_kv: paths of the budgeted slots whose K/V other layers read with
            ``keys_and_values()`` (gemma3n, afm7); their caches keep what their last update
            returned (``QFiltersKVCache.keep_last_kv``).
        filters: the filter in use and where it came from (one line, e.g. ``"calibrated
            query filter PATH (found by model identity; 2048 tokens of ...)"``; see
            :mod:`qfilters_mlx.filters.default_filters`); ``""`` when not recorded.
    """

    budgeted: tuple[CacheSlot, ...]
    kept: tuple[CacheSlot, ...]
    shard: object = None
    shared_kv: tuple = ()
    filters: str = ""

    @property
    def partial(self) -> bool:
        """Some slots keep the model's own cache."""
        return bool(self.kept)

    def summary(self) -> str:
        """One line: ``"all 2 layers budgeted"`` or which layers keep which cache and why
        (then, on a tensor-parallel rank, ``"; rank r of N (tensor parallel): KV heads ..."``),
        then ``"; filter: "`` and :attr:`filters`."""
        text = self._layers_summary()
        text = text if self.shard is None else f"{text}; {self.shard.summary()}"
        return f"{text}; filter: {self.filters}" if self.filters else text

    def _layers_summary(self) -> str:
        n = len(self.budgeted)
        if not self.kept:
            return f"all {n} attention caches budgeted (layers {layer_names(self.budgeted)})"
        by_type: dict[str, list[CacheSlot]] = {}
        for s in self.kept:
            by_type.setdefault(s.cache_type, []).append(s)
        kept = "; ".join(
            f"{t} at {layer_names(v)}: {BOUNDED_CACHES.get(t, 'kept as the model built it')}"
            if t != "KVCache" else f"KVCache at {layer_names(v)}: never called in a forward pass (shared)"
            for t, v in by_type.items())
        return f"partial: {n} attention caches budgeted (layers {layer_names(self.budgeted)}); kept: {kept}"


class BudgetedCaches(list):
    """The list :meth:`KVCacheBuilder.for_model` returns: a plain ``list`` of per-layer
    caches (what mlx-lm takes as ``prompt_cache``) with a :attr:`report`.

    Concatenated with another model's caches (``+`` or ``+=``: how mlx-lm's speculative
    decoding takes the main model's caches followed by the draft model's, as a plain
    ``list``), every eviction cache of both is asked :meth:`~QFiltersKVCache.is_trimmable`
    first: mlx-lm asks only the main model's caches before the prompt and trims the draft's
    without asking, so a draft cache with ``max_rewind="auto"`` would otherwise have no journal
    when its rejected drafts are rewound (``trim_prompt_cache`` skips it silently, leaving
    rejected tokens at wrong positions). Asked now, before their first eviction, they journal
    and rewind exactly; a cache that already evicted without a journal stays untrimmable (mlx-lm
    then refuses a main cache like it before the prompt).
    """

    report: BuildReport

    def __add__(self, other):
        joined = list(self) + list(other)
        _ask_rewinds(joined)
        return joined

    def __iadd__(self, other):
        super().__iadd__(other)
        _ask_rewinds(self)
        return self

    def __repr__(self) -> str:
        return f"BudgetedCaches({len(self)} caches; {self.report.summary()})"


def eviction_caches(caches) -> list:
    """The eviction caches of a cache list, ``CacheList`` members too: every
    ``QFiltersKVCache`` (quantized or not) and ``HeadGroupsKVCache`` (a layer's head groups)."""
    return [c for _, c in walk(caches) if isinstance(c, (QFiltersKVCache, HeadGroupsKVCache))]


def _ask_rewinds(caches) -> None:
    """Ask every eviction cache of ``caches`` whether it can rewind (turns an ``"auto"``
    journal on before the first eviction; see :class:`BudgetedCaches`)."""
    for c in eviction_caches(caches):
        c.is_trimmable()


def describe(caches) -> str:
    """A one-line summary of a cache list: its :class:`BuildReport`, or the classes it holds."""
    report = getattr(caches, "report", None)
    if report is not None:
        return report.summary()
    return f"{len(eviction_caches(caches))} of {len(list(walk(caches)))} caches are eviction caches"
