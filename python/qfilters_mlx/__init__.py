"""Q-Filters KV-cache eviction for MLX and mlx-lm.

Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
Compression", arXiv:2503.02812. Importing this package builds and loads no
kernel, and does not import MLX until a public name is used (so that
:func:`qfilters_mlx.blas.enable_fast_blas` can run first). It registers
``QFiltersKVCache`` with mlx-lm's ``load_prompt_cache`` when (or, if already
imported, as soon as) ``mlx_lm.models.cache`` is imported
(:mod:`qfilters_mlx.prompt_cache_hook`).
"""

from importlib import import_module

__version__ = "0.3.0"

_EXPORTS = {
    "CompressOnce": ".config",
    "HeadBudgets": ".config",
    "HeadGroupsKVCache": ".cache.head_groups",
    "KVCacheBuilder": ".cache.builder",
    "KVCacheConfig": ".config",
    "METHODS": ".config",
    "QFiltersKVCache": ".cache.kv_cache",
    "Streaming": ".config",
    "compress_caches": ".cache.compression",
    "observe_queries": ".filters.observe",
}

__all__ = [*_EXPORTS, "__version__"]

# mlx-lm's load_prompt_cache must find our cache class without `import qfilters_mlx.cache`
# (imports nothing now unless mlx_lm.models.cache already is).
from qfilters_mlx.prompt_cache_hook import install as _install_prompt_cache_hook  # noqa: E402

_install_prompt_cache_hook()


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
