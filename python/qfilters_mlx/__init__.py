"""Q-Filters KV-cache eviction for MLX and mlx-lm.

Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
Compression", arXiv:2503.02812. Importing this package builds and loads no
kernel, and does not import MLX until a public name is used (so that
:func:`qfilters_mlx.blas.enable_fast_blas` can run first).
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "KVCacheBuilder": ".cache.builder",
    "KVCacheConfig": ".config",
    "METHODS": ".config",
    "QFiltersKVCache": ".cache.kv_cache",
    "observe_queries": ".filters.observe",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
