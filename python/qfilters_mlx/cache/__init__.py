"""The cache and how it is built: ``QFiltersKVCache`` (mlx-lm's cache protocol) and its
quantized sibling ``QuantizedQFiltersKVCache``, ``build_cache`` (one layer's cache of the
class ``kv_bits`` asks for), ``HeadGroupsKVCache`` (a layer's KV heads in groups stored at
their own budgets) and ``KVCacheBuilder`` (one cache per layer of a model).

The names are resolved on first use (PEP 562): importing a submodule (as
:mod:`qfilters_mlx.prompt_cache_hook` does while ``mlx_lm`` is being imported)
must not import :mod:`.builder`, whose :mod:`qfilters_mlx.model_info` may be the
module that started importing ``mlx_lm`` (an import cycle otherwise).
"""

__all__ = ["HeadGroupsKVCache", "KVCacheBuilder", "QFiltersKVCache", "QuantizedQFiltersKVCache", "build_cache"]


def __getattr__(name: str):
    if name == "KVCacheBuilder":
        from qfilters_mlx.cache.builder import KVCacheBuilder

        return KVCacheBuilder
    if name == "HeadGroupsKVCache":
        from qfilters_mlx.cache.head_groups import HeadGroupsKVCache

        return HeadGroupsKVCache
    if name in ("QFiltersKVCache", "QuantizedQFiltersKVCache", "build_cache"):
        from qfilters_mlx.cache import kv_cache

        return getattr(kv_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
