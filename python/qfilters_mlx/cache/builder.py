"""``KVCacheBuilder``: one eviction cache per plain-attention layer of an mlx-lm model."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from qfilters_mlx.cache.kv_cache import QFiltersKVCache
from qfilters_mlx.config import KVCacheConfig
from qfilters_mlx.model_info import model_head_dim


def _layer_filters(model, config: KVCacheConfig):
    """``[n_layers, n_kv_heads, head_dim]`` filters from ``config.qfilters_filters``
    (a path is loaded and checked against the model), or ``None``."""
    import mlx.core as mx
    import numpy as np

    from qfilters_mlx.filters.calibration import load_filters
    from qfilters_mlx.model_info import check_filters_shape

    f = config.qfilters_filters
    if f is None or config.method != "qfilters":
        return None
    if isinstance(f, str):
        return load_filters(f, model)[0]
    f = mx.array(np.asarray(f)) if not isinstance(f, mx.array) else f
    check_filters_shape(f, model)
    return f.astype(mx.float32)


def default_caches(model) -> list:
    """The caches the model builds for itself (its class's ``make_cache``, else ``KVCache`` per layer).

    The class method is used so that an instance attribute ``model.make_cache``
    set by a previous ``for_model`` call is not picked up.
    """
    make = getattr(type(model), "make_cache", None)
    if make is not None:
        return list(make(model))
    return [KVCache() for _ in model.layers]


class KVCacheBuilder:
    """Builds eviction caches for a model (see :meth:`for_model`)."""

    @staticmethod
    def for_model(model, config: KVCacheConfig) -> list:
        """One :class:`QFiltersKVCache` per plain-attention layer.

        Layers whose default cache is not mlx-lm's plain ``KVCache`` (sliding
        window, SSM, ...) keep the model's own cache. Use as
        ``model.make_cache = lambda *_a, **_k: caches``.

        Args:
            model: an mlx-lm model (``model.layers``, ``model.args``).
            config: the eviction configuration; ``head_dim=None`` takes the model's.

        Returns:
            A list with one cache per layer.

        With ``config.qfilters_filters`` (a path or an array ``[n_layers,
        n_kv_heads, head_dim]``), layer ``i`` gets ``filters[i]`` and evicts from
        its first call.

        Raises:
            TypeError: ``config`` is not a ``KVCacheConfig``.
            ValueError: ``config.head_dim`` does not match the model's head_dim,
                the filters do not fit the model, or the configured backend is
                unavailable.
        """
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        hd = model_head_dim(model)
        if config.head_dim is None:
            config = config.with_head_dim(hd)
        elif config.head_dim != hd:
            raise ValueError(f"config.head_dim={config.head_dim} does not match the model's head_dim={hd}")
        filters = _layer_filters(model, config)
        return [
            QFiltersKVCache(config, layer_idx=i, filters=None if filters is None else filters[i])
            if type(c) is KVCache else c
            for i, c in enumerate(default_caches(model))
        ]

    @staticmethod
    def install(model, config: KVCacheConfig) -> None:
        """Make ``model.make_cache()`` build *fresh* eviction caches on every call.

        Unlike the seed's ``model.make_cache = lambda *_a, **_k: caches``, which
        hands the same (already used) cache objects to every later generation,
        this is safe for repeated ``mlx_lm.generate`` calls and for servers that
        build a cache per request. Validates like :meth:`for_model` (errors are
        raised here, not at the first generation).
        """
        KVCacheBuilder.for_model(model, config)  # validate now
        model.make_cache = lambda *_a, **_k: KVCacheBuilder.for_model(model, config)
