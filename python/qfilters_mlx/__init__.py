"""Q-Filters KV-cache eviction for MLX and mlx-lm.

Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
Compression", arXiv:2503.02812. Importing this package builds and loads no
kernel; backends are resolved when a cache is constructed.
"""

from .builder import KVCacheBuilder
from .cache import QFiltersKVCache
from .config import METHODS, KVCacheConfig

__version__ = "0.1.0"

__all__ = ["KVCacheBuilder", "KVCacheConfig", "QFiltersKVCache", "METHODS", "__version__"]
