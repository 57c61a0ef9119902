"""A configuration and its build options as one flat JSON object, the form saved prompt caches
store (``QFiltersKVCache.state``; the field names of the earlier flat configuration, so files
saved before and after read alike: :func:`config_from_state` reads them with
:func:`~qfilters_mlx.config.deprecated.translate_old_spellings`)."""

from __future__ import annotations

from qfilters_mlx.config.build import BuildOptions
from qfilters_mlx.config.deprecated import BUILD_FIELDS, translate_old_spellings
from qfilters_mlx.config.method import KVCacheConfig

_METHOD_FIELDS = ("method", "head_dim", "qfilters_budget", "qfilters_n_sink", "qfilters_recent",
                  "qfilters_calib_tokens", "qfilters_sign", "qfilters_seed",
                  "qfilters_filter_source", "qfilters_filters")
_MODE_FIELDS = ("qfilters_mode", "qfilters_compression_ratio", "qfilters_growth",
                "qfilters_compress_at")


def config_to_state(config: KVCacheConfig, options: BuildOptions | None = None) -> dict:
    """``{field: value}`` of ``config`` and the build ``options`` (``None``: those the
    config carries), JSON-serialisable but for an array in ``qfilters_filters``."""
    names = (*_METHOD_FIELDS, *_MODE_FIELDS)
    state = {name: getattr(config, name) for name in names}
    for old, new in BUILD_FIELDS.items():
        state[old] = getattr(options, new) if options is not None else getattr(config, old)
    return state


def config_from_state(state: dict) -> tuple[KVCacheConfig, BuildOptions]:
    """The configuration (carrying no build options) and the build options of
    :func:`config_to_state`'s ``state``, without deprecation warnings.

    Raises:
        ValueError, TypeError: a value :class:`KVCacheConfig` or :class:`BuildOptions` refuses.
    """
    values = translate_old_spellings(dict(state), warn_stacklevel=None)
    options = values.pop("_build_options", None) or BuildOptions()
    return KVCacheConfig(**values), options
