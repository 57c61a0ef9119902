"""The validated configuration of the eviction method, and the options of how caches are built.

* :class:`KVCacheConfig` (:mod:`.method`): what the eviction method is; its mode is
  :class:`Streaming` or :class:`CompressOnce` (:mod:`.modes`); per-head recent windows:
  :mod:`.recent`; the defaults: :mod:`.defaults`.
* :class:`BuildOptions` (:mod:`.build`): kernel backend, rewind depth, quantized K/V storage
  (keywords of ``KVCacheBuilder`` and the cache constructors; :data:`DEFAULT_MAX_REWIND`).
* :class:`HeadBudgets` (:mod:`.heads`): per-head budgets and windows (head groups stored
  at their own sizes).
* :mod:`.state`: the form saved prompt caches store (format 2, and the translator of
  format 1); :mod:`.removed`: the 0.1 spellings removed in 0.3.0 (``TypeError`` naming
  the new spelling).

Every check raises ``ValueError`` (``TypeError`` for a wrong type) naming the field, before
any cache exists. One frozen configuration is passed down to every cache; never global.
"""

from qfilters_mlx.config.build import (AUTO_REWIND, DEFAULT_BACKEND, DEFAULT_KV_GROUP_SIZE,
                                           DEFAULT_MAX_REWIND, KV_BITS, KV_GROUP_SIZES,
                                           BuildOptions, merge_options)
from qfilters_mlx.config.checks import INT32_MAX, check_int
from qfilters_mlx.config.defaults import (DEFAULT_BUDGET, DEFAULT_CALIB_TOKENS,
                                              DEFAULT_FILTER_SOURCE, DEFAULT_KEY_SIGN,
                                              DEFAULT_METHOD, DEFAULT_N_SINK,
                                              DEFAULT_RECENT_FRACTION, DEFAULT_SEED, DEFAULT_SIGN,
                                              FILTER_SOURCES, METHODS, default_recent,
                                              default_sign)
from qfilters_mlx.config.heads import HeadBudgets, HeadGroup
from qfilters_mlx.config.method import KVCacheConfig
from qfilters_mlx.config.modes import COMPRESS_AT, MODES, CompressOnce, Streaming
from qfilters_mlx.config.recent import (layer_recent, per_layer_table, resolve_recent,
                                       with_stored_windows)
from qfilters_mlx.config.state import (FORMAT, FORMATS, build_from_state, build_to_state,
                                      config_from_state, config_to_state, from_format1)

__all__ = [
    "AUTO_REWIND", "COMPRESS_AT", "DEFAULT_BACKEND", "DEFAULT_BUDGET", "DEFAULT_CALIB_TOKENS",
    "DEFAULT_FILTER_SOURCE", "DEFAULT_KEY_SIGN", "DEFAULT_KV_GROUP_SIZE", "DEFAULT_MAX_REWIND",
    "DEFAULT_METHOD", "DEFAULT_N_SINK", "DEFAULT_RECENT_FRACTION", "DEFAULT_SEED", "DEFAULT_SIGN",
    "FILTER_SOURCES", "INT32_MAX", "KV_BITS", "KV_GROUP_SIZES", "METHODS", "MODES",
    "FORMAT", "FORMATS", "BuildOptions", "HeadBudgets", "HeadGroup", "CompressOnce", "KVCacheConfig", "Streaming", "build_from_state",
    "build_to_state", "check_int", "config_from_state", "config_to_state", "default_recent",
    "default_sign", "from_format1",
    "layer_recent", "merge_options", "per_layer_table", "resolve_recent", "with_stored_windows",
]
