"""``KVCacheBuilder``: one eviction cache per plain-attention cache slot of an mlx-lm model.

What each slot stores is read from the model (:func:`qfilters_mlx.model_info.probe_layout`),
not guessed from its args. Plain ``KVCache`` slots, also inside a ``CacheList``
(falcon_h1, baichuan_m1, ...), become :class:`QFiltersKVCache` with that slot's
own key width; other caches (sliding window, recurrent state, ...) are kept and
reported (:mod:`.build_report`); multi-head latent attention is refused. Build options
(kernel backend, rewind depth, quantized storage) are keywords of the builder and its methods.
"""

from __future__ import annotations

import types

from qfilters_mlx.cache.build_report import BudgetedCaches, BuildReport, describe, layer_names
from qfilters_mlx.cache.head_group_build import check_heads, check_heads_use, layer_cache, resolve_heads
from qfilters_mlx.cache.kv_cache import QFiltersKVCache, build_cache
from qfilters_mlx.config import (BuildOptions, KVCacheConfig, merge_options, per_layer_table,
                                 with_stored_windows)
from qfilters_mlx.model_info import CacheSlot, default_caches, probe_layout, replace_at, walk
from qfilters_mlx.scorers import FullScorer

__all__ = ["BuildReport", "BudgetedCaches", "KVCacheBuilder", "default_caches", "describe"]


def _layer_filters(model, config: KVCacheConfig, tokenizer=None, model_path=None):
    """``(filters, config, origin)``: the ``[n_budgeted, n_kv_heads, head_dim]`` filters
    ``config`` asks for (``None`` for the online filters), the configuration to build with and
    the line naming them (:func:`qfilters_mlx.filters.default_filters.resolve_filters`: a given
    file or array, else the calibrated filter found or made for the model). Files and arrays
    hold the whole model's heads; on a tensor-parallel rank the result holds the rank's
    (:func:`qfilters_mlx.sharding.local_filters`)."""
    import mlx.core as mx
    import numpy as np

    from qfilters_mlx.filters.default_filters import resolve_filters
    from qfilters_mlx.model_info import check_filters_shape, model_dims
    from qfilters_mlx.sharding import local_filters, shard_info

    resolved = resolve_filters(model, config, tokenizer, model_path)
    f = resolved.filters
    if f is None:
        return None, resolved.config, resolved.origin
    f = mx.array(np.asarray(f)) if not isinstance(f, mx.array) else f
    check_filters_shape(f, model)
    f = local_filters(f.astype(mx.float32), shard_info(model, {model_dims(model)[1]}))
    return f, resolved.config, resolved.origin


def _check_layout(slots: list[CacheSlot], config: KVCacheConfig, model) -> list[CacheSlot]:
    """The budgeted slots; raises before anything is built (see :meth:`KVCacheBuilder.for_model`)."""
    mla = [s for s in slots if s.mla]
    if mla:
        raise ValueError(
            f"{type(model).__module__}: layers {layer_names(mla)} use multi-head latent attention "
            f"(MLA): the cache stores a compressed latent of width {mla[0].key_dim}, not per-head "
            "keys, so Q-Filters cannot score them; this architecture is not supported")
    budgeted = [s for s in slots if s.plain]
    if not budgeted:
        kinds = sorted({s.cache_type for s in slots})
        raise ValueError(
            f"{type(model).__module__}: no layer stores per-head keys in a plain KVCache "
            f"(the model's caches: {', '.join(kinds) or 'none'}); nothing to budget")
    if config.head_dim is not None:
        widths = sorted({s.key_dim for s in budgeted})
        if widths != [config.head_dim]:
            per = {w: layer_names([s for s in budgeted if s.key_dim == w]) for w in widths}
            raise ValueError(
                f"config.head_dim={config.head_dim} does not match the model's key head width "
                + (f"{widths[0]}" if len(widths) == 1 else
                   "(layers differ: " + "; ".join(f"{w} at layers {v}" for w, v in per.items()) + ")")
                + "; pass head_dim=None to take each layer's own")
    return budgeted


class _TrialCache(QFiltersKVCache):
    """A throwaway cache of :func:`_trial_forward` that notes ``keys_and_values()`` reads."""

    read = False

    def keys_and_values(self):
        self.read = True
        return super().keys_and_values()


def _trial_forward(model, budgeted: list[CacheSlot]) -> tuple:
    """A lazy 1-token forward with throwaway eviction caches (method ``full``): a model
    that uses its cache beyond mlx-lm's cache protocol is refused here, not at the first
    generation. Returns the paths of the slots whose K/V other layers read with
    ``keys_and_values()`` (gemma3n's KV-shared layers, afm7's KV-reuse blocks)."""
    import mlx.core as mx

    trial = default_caches(model)
    full, options = KVCacheConfig(method=FullScorer.name), BuildOptions(backend="reference")
    for s in budgeted:
        c = _new_cache(_TrialCache, full.with_head_dim(s.key_dim), s.layer, None, options)
        c.keep_last_kv = True
        replace_at(trial, s.path, c)
    try:
        model(mx.array([[0]], dtype=mx.int32), cache=trial)
    except Exception as err:
        raise ValueError(
            f"{type(model).__module__}: the model uses its attention caches (layers "
            f"{layer_names(budgeted)}) beyond mlx-lm's cache protocol, which QFiltersKVCache does not "
            f"provide ({type(err).__name__}: {err}); this architecture is not supported") from err
    return tuple(p for p, c in walk(trial) if isinstance(c, _TrialCache) and c.read)


def _new_cache(cls, config: KVCacheConfig, layer_idx: int, filters, options: BuildOptions):
    """One eviction cache built with ``options``: of class ``cls``, or for
    :class:`QFiltersKVCache` of the class the storage asks for (:func:`build_cache`)."""
    if cls is QFiltersKVCache:
        return build_cache(config, layer_idx, filters, bits=options.kv_bits,
                           group_size=options.kv_group_size, backend=options.backend,
                           max_rewind=options.max_rewind)
    return cls(config, layer_idx=layer_idx, filters=filters, backend=options.backend,
               max_rewind=options.max_rewind)


class _BuilderMethod:
    """A method of :class:`KVCacheBuilder` called on the class (the default options) or on
    an instance (its options): ``KVCacheBuilder.for_model(...)`` and
    ``KVCacheBuilder(backend="cpp").for_model(...)``."""

    def __init__(self, func):
        self.__func__ = func
        self.__doc__, self.__name__, self.__wrapped__ = func.__doc__, func.__name__, func

    def __get__(self, builder, cls=None):
        return types.MethodType(self.__func__, builder if builder is not None else cls())


class KVCacheBuilder:
    """Builds eviction caches for a model (see :meth:`for_model`).

    ``KVCacheBuilder(backend=None, max_rewind=None, kv_bits=None, kv_group_size=None)`` holds
    build options (:class:`qfilters_mlx.config.BuildOptions`: kernel backend, rewind depth,
    quantized K/V storage) for its :meth:`for_model` and :meth:`install`, which take the same
    keywords (a keyword given there wins over the builder's; ``None``: the default). Called
    on the class, ``KVCacheBuilder.for_model(...)`` uses a builder without options.

    Raises:
        TypeError, ValueError: a given option of the wrong type or out of range (named).
    """

    def __init__(self, *, backend: str | None = None, max_rewind: int | None = None,
                 kv_bits: int | None = None, kv_group_size: int | None = None):
        self.backend, self.max_rewind = backend, max_rewind
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        merge_options(self._given())  # checks the given ones now

    def _given(self) -> dict:
        return {"backend": self.backend, "max_rewind": self.max_rewind, "kv_bits": self.kv_bits,
                "kv_group_size": self.kv_group_size}

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self._given().items() if v is not None)
        return f"KVCacheBuilder({given})"

    def options_for(self, config: KVCacheConfig | None = None, *, backend: str | None = None,
                    max_rewind: int | None = None, kv_bits: int | None = None,
                    kv_group_size: int | None = None) -> BuildOptions:
        """The build options :meth:`for_model` uses for ``config`` (``None``: the default
        configuration): each keyword not ``None``, else this builder's, else the default.

        Raises:
            TypeError: ``config`` is not a ``KVCacheConfig``.
            TypeError, ValueError: an option out of range (named).
        """
        _checked(config)
        keywords = dict(backend=backend, max_rewind=max_rewind, kv_bits=kv_bits,
                        kv_group_size=kv_group_size)
        return merge_options(keywords, self._given())

    @_BuilderMethod
    def for_model(self, model, config: KVCacheConfig | None = None, *, tokenizer=None,
                  model_path=None, backend: str | None = None, max_rewind: int | None = None,
                  kv_bits: int | None = None, kv_group_size: int | None = None,
                  heads=None) -> BudgetedCaches:
        """The model's own caches with every plain ``KVCache`` replaced by a
        :class:`QFiltersKVCache` (inside ``CacheList`` too).

        The filter: with the default ``qfilters_filter_source="calibrated"`` (``config=None``
        means ``KVCacheConfig()``) every budgeted slot gets the model's calibrated query filter
        (the paper's offline estimator) and evicts from its first call, so generation needs
        keys and values only (no ``observe_queries``). It is found or made here, in this
        order (:mod:`qfilters_mlx.filters.default_filters`): the file ``qfilters_filters``
        names; ``<model_path>/qfilters_filters.safetensors``; the user-cache file for the
        model's identity (``$QFILTERS_MLX_HOME/filters/<model id>.safetensors``); else it
        calibrates now, once (2,048 tokens of text that ships with Python, a progress bar and
        one line on stderr; 130 s for SmolLM2-135M on a shared 2-core CPU), and stores the
        file there, so the next build loads it (0.10-0.11 s for the whole build on SmolLM2). ``tokenizer`` (else
        the one in ``model_path``) tokenizes the calibration text; without either the model
        samples its own calibration text. If the model's queries cannot be captured, the
        caches use the online key-SVD filter and one stderr line says so. ``report.filters``
        (in :func:`describe` and ``repr``) names the filter in use and where it came from.
        Online filters are opt-in: ``qfilters_filter_source="queries"`` (inside
        ``observe_queries``) or ``"keys"``.

        Each budgeted slot gets its own key width (``config.head_dim=None``, the
        usual case, works for every plain-attention model, including models whose
        layers differ in width). An explicit ``config.head_dim`` must equal the
        key width of every budgeted layer. Other caches (sliding window, recurrent
        state, chunked) are kept; ``result.report`` / ``repr(result)`` /
        :func:`describe` say which. Use as ``model.make_cache = lambda *_a, **_k:
        caches`` or, for fresh caches per generation, :meth:`install`.

        Build options (see :class:`KVCacheBuilder`): ``backend`` (``"auto"``, ``"reference"``,
        ``"cpp"``, ``"metal"``), ``max_rewind`` (tokens ``trim`` can rewind after an eviction,
        default :data:`qfilters_mlx.config.DEFAULT_MAX_REWIND`; at least ``num_draft_tokens``
        for speculative decoding), ``kv_bits`` (2, 4, 8: quantized K/V storage, needs
        ``max_rewind=0``) and ``kv_group_size`` (32, 64, 128).

        Bring your own filters with ``config.qfilters_filters`` (a path written by
        ``qfilters-mlx calibrate`` or an array ``[n_layers, n_kv_heads, head_dim]`` over the
        budgeted layers, see :func:`qfilters_mlx.model_info.model_dims`): budgeted slot
        ``i`` gets ``filters[i]`` and evicts from its first call.

        Head groups: ``heads`` (a :class:`qfilters_mlx.config.HeadBudgets`: a budget and
        recent window per budgeted layer and KV head, or ``"calibrated"``: the model's
        retrieval heads, ranked once on calibration needles and stored beside its filter,
        :func:`qfilters_mlx.filters.head_store.resolve_head_ranking`, turned into budgets at
        ``config.qfilters_budget`` by :func:`qfilters_mlx.filters.head_budgets.head_budgets`;
        docs/head-groups.md) replaces the configuration's budget and windows per head; a layer whose heads differ in budget gets a
        :class:`~qfilters_mlx.cache.head_groups.HeadGroupsKVCache` (one cache per budget,
        each stored at its own size), a layer of one budget a plain cache at it. Streaming
        mode only; not for layers whose K/V another layer reads, or for batch generation
        (each refused with a ``ValueError``).

        On one rank of a tensor-parallel model (``mlx_lm.utils.sharded_load`` /
        ``model.shard(group)`` under ``mlx.launch``) the caches hold the rank's KV heads
        (read from the sharded model by the shape probe), a filters file or array
        (whole model; also the calibrated one, found or made by all ranks together, written
        by rank 0) is sliced to them, and ``report.shard`` says which
        (:mod:`qfilters_mlx.sharding`). ``heads`` are the whole model's too and are sliced
        the same way (``"calibrated"`` needs the ranking stored by a whole-model run), so a
        rank holds the sum of its own heads' budgets.

        Raises:
            TypeError: ``config`` is not a ``KVCacheConfig``; a build option of the wrong type.
            ValueError: a build option out of range (named); ``heads`` that cannot be used
                or do not fit (see :func:`~qfilters_mlx.cache.head_group_build.check_heads_use`
                and ``check_heads``); layers use multi-head latent attention (MLA, named with
                the layers); no layer has a plain attention cache; ``config.head_dim``
                differs from a layer's key width (both numbers named); the model
                uses its caches beyond mlx-lm's cache protocol; the filters
                do not fit the model (a found file for another model is named, not
                replaced); the backend is unavailable; the model cannot
                be probed; a tensor-parallel rank holds part of a KV head (the KV
                heads are not divisible by the group size).
        """
        options = dict(backend=backend, max_rewind=max_rewind, kv_bits=kv_bits,
                       kv_group_size=kv_group_size)
        return self._prepare(model, _checked(config), tokenizer, model_path, options, heads)[0]

    def _prepare(self, model, config, tokenizer, model_path, keywords, heads=None):
        """``(caches, build)``: :meth:`for_model`'s caches and a function building fresh ones."""
        options = self.options_for(config, **keywords)
        config = with_stored_windows(config)  # (recent="calibrated": the file read once, here)
        from qfilters_mlx.sharding import check_shards, shard_info

        check_shards(model)  # a tensor-parallel rank holds whole KV heads
        slots = probe_layout(model)
        budgeted = _check_layout(slots, config, model)
        shared_kv = _trial_forward(model, budgeted)
        shard = shard_info(model, {s.n_kv_heads for s in budgeted})
        if heads is not None:
            check_heads_use(heads, config, shared_kv=bool(shared_kv))  # before a ranking is measured
            heads = resolve_heads(heads, model, config, tokenizer, model_path)
            heads = check_heads(heads, config, [s.n_kv_heads for s in budgeted], shard=shard)
        filters, config, origin = _layer_filters(model, config, tokenizer, model_path)

        def build():
            return KVCacheBuilder._build(config, options, slots, budgeted, filters, model, shard,
                                         shared_kv, origin, heads)

        return build(), build

    @staticmethod
    def _build(config: KVCacheConfig, options: BuildOptions, slots, budgeted, filters, model,
               shard=None, shared_kv: tuple = (), origin: str = "", heads=None) -> BudgetedCaches:
        """Fresh caches for an already probed and checked layout (``filters`` loaded)."""
        caches = BudgetedCaches(default_caches(model))
        table = per_layer_table(config, len(budgeted))
        for i, s in enumerate(budgeted):
            # per-head windows: budgeted slot i's row (rows follow the filters' order)
            cfg = config.for_layer(i, s.key_dim) if table else config.with_head_dim(s.key_dim)
            f = None if filters is None else filters[i]
            if heads is None:
                c = _new_cache(QFiltersKVCache, cfg, s.layer, f, options)
            else:
                c = layer_cache(cfg, heads.groups(i), s.layer, f, lambda gc, gf, _l=s.layer:
                                _new_cache(QFiltersKVCache, gc, _l, gf, options))
            c.keep_last_kv = s.path in shared_kv
            replace_at(caches, s.path, c)
        keys = {s.path for s in budgeted}
        caches.report = BuildReport(tuple(budgeted), tuple(s for s in slots if s.path not in keys),
                                    shard, tuple(shared_kv), origin)
        return caches

    @_BuilderMethod
    def install(self, model, config: KVCacheConfig | None = None, *, tokenizer=None,
                model_path=None, backend: str | None = None, max_rewind: int | None = None,
                kv_bits: int | None = None, kv_group_size: int | None = None,
                heads=None) -> BuildReport:
        """Make ``model.make_cache()`` build *fresh* eviction caches on every call.

        Unlike ``model.make_cache = lambda *_a, **_k: caches``, which hands the
        same (already used) cache objects to every later generation, this is safe
        for repeated ``mlx_lm.generate`` calls and for servers that build a cache
        per request. Validates like :meth:`for_model` (errors are raised here, not
        at the first generation); the model is probed and its filter found or made
        (the default: the calibrated query filter, see :meth:`for_model`; ``tokenizer``,
        ``model_path``, ``heads`` and the build options as there) once, here. Returns the :class:`BuildReport`
        (``report.filters`` names the filter).

        mlx-lm builds these caches inside ``generate`` or its server, where no
        ``observe_queries`` can wrap them, so the opt-in online configurations that need
        observed queries (``qfilters_filter_source="queries"``, ``sign="auto"``) are
        refused here; the default needs none. For ``mlx_lm.server``'s prompt-cache reuse see
        docs/mlx-lm.md ("mlx-lm's server prompt cache": ``max_rewind``).

        Raises:
            TypeError, ValueError: what :meth:`for_model` raises, or ``config.needs_queries``.
        """
        config = _checked(config)
        if config.needs_queries:
            raise ValueError(
                "install: this configuration estimates its filter from observed queries "
                f"(qfilters_filter_source={config.qfilters_filter_source!r}, qfilters_sign="
                f"{config.qfilters_sign!r}), but caches that mlx-lm builds itself (model.make_cache "
                "in generate or mlx_lm.server) run outside observe_queries: use "
                "the default qfilters_filter_source='calibrated' (the calibrated query filter), "
                "qfilters_filters=FILE from `qfilters-mlx calibrate`, or 'keys' (sign -1 by default), "
                "or build caches with for_model and generate inside observe_queries")
        options = dict(backend=backend, max_rewind=max_rewind, kv_bits=kv_bits,
                       kv_group_size=kv_group_size)
        caches, build = self._prepare(model, config, tokenizer, model_path, options, heads)  # validate now
        model.make_cache = lambda *_a, **_k: build()
        return caches.report


def _checked(config) -> KVCacheConfig:
    """``config`` (``None``: ``KVCacheConfig()``), or ``TypeError`` when it is no ``KVCacheConfig``."""
    config = KVCacheConfig() if config is None else config
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    return config
