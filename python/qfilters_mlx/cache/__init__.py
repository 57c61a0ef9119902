"""The cache and how it is built: ``QFiltersKVCache`` (mlx-lm's cache protocol),
``KVCacheBuilder`` (one cache per layer of a model) and the per-method insertion scores."""

from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.cache.kv_cache import QFiltersKVCache

__all__ = ["KVCacheBuilder", "QFiltersKVCache"]
