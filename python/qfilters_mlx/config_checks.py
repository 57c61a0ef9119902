"""Field checks of :class:`qfilters_mlx.config.KVCacheConfig` that stand alone: int ranges,
the compress-once fields and the quantized-storage fields (each error names the field).
Imported by :mod:`qfilters_mlx.config` (which re-exports the constants); imports nothing of
the package."""

from __future__ import annotations

INT32_MAX = 2**31 - 1
"""Largest budget/sink/window the kernels index with int32."""

MODES = ("streaming", "compress_once")
"""How the cache holds its budget: evict at every call, or compress once then grow
(see :mod:`qfilters_mlx.cache.compression`)."""

COMPRESS_AT = ("prompt_end", "manual")
"""When a ``compress_once`` cache compresses: at the end of a chunked prefill, or only
when :func:`qfilters_mlx.compress_caches` is called."""


KV_BITS = (2, 4, 8)
"""``kv_bits`` values: the widths whose packed rows fill whole uint32 words (mlx-lm's
``QuantizedKVCache`` allocates ``head_dim * bits / 32`` words per row)."""
KV_GROUP_SIZES = (32, 64, 128)
"""``kv_group_size`` values ``mx.quantize`` supports."""
DEFAULT_KV_GROUP_SIZE = 64
"""mlx-lm's ``--kv-group-size`` default."""


def check_int(name: str, value, minimum: int, maximum: int = INT32_MAX) -> None:
    """Raise unless ``value`` is an int in ``[minimum, maximum]`` (errors name the field ``name``)."""
    if value is None:
        raise ValueError(f"{name} must be an int >= {minimum}, got None")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum} (int32 kernels), got {value}")


def check_kv_quantization(config) -> None:
    """Checks of ``kv_bits`` / ``kv_group_size`` (see :class:`KVCacheConfig`).

    Raises:
        TypeError: a field that must be an int is not one.
        ValueError: ``kv_bits`` not in :data:`KV_BITS`, ``kv_group_size`` not in
            :data:`KV_GROUP_SIZES`, ``head_dim`` not a multiple of ``kv_group_size``, or
            ``kv_bits`` with ``qfilters_max_rewind > 0`` (rewinds replay stored rows at full
            precision, which a quantized cache no longer has).
    """
    if config.kv_bits is not None:
        check_int("kv_bits", config.kv_bits, 1)
        if config.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be None or one of {KV_BITS}, got {config.kv_bits}")
    check_int("kv_group_size", config.kv_group_size, 1)
    if config.kv_group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES} (mx.quantize), "
                         f"got {config.kv_group_size}")
    if config.kv_bits is None:
        return
    if config.qfilters_max_rewind > 0:
        raise ValueError(f"kv_bits={config.kv_bits} needs qfilters_max_rewind=0, got "
                         f"{config.qfilters_max_rewind}: a quantized cache cannot rewind after an "
                         "eviction (speculative decoding with kv_bits is not supported)")
    if config.head_dim is not None and config.head_dim % config.kv_group_size:
        raise ValueError(f"head_dim ({config.head_dim}) must be a multiple of kv_group_size "
                         f"({config.kv_group_size}) with kv_bits={config.kv_bits}")


def check_compression(c) -> None:
    """Validate the compress-once fields (ValueError/TypeError naming the field)."""
    if c.qfilters_mode not in MODES:
        raise ValueError(f"qfilters_mode must be one of {MODES}, got {c.qfilters_mode!r}")
    if c.qfilters_compress_at not in COMPRESS_AT:
        raise ValueError(f"qfilters_compress_at must be one of {COMPRESS_AT}, "
                         f"got {c.qfilters_compress_at!r}")
    r = c.qfilters_compression_ratio
    if r is not None:
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"qfilters_compression_ratio must be a float, got {type(r).__name__} ({r!r})")
        if not 0.0 <= r < 1.0:
            raise ValueError("qfilters_compression_ratio (the fraction of tokens removed, as kvpress "
                             f"names it) must be in [0, 1), got {r!r}")
    if c.qfilters_growth is not None:
        check_int("qfilters_growth", c.qfilters_growth, 0)
    if c.qfilters_mode == "streaming":
        for name in ("qfilters_compression_ratio", "qfilters_growth"):
            if getattr(c, name) is not None:
                raise ValueError(f"{name} is only used with qfilters_mode='compress_once' "
                                 f"(got qfilters_mode='streaming')")
    elif c.method == "full":
        raise ValueError("qfilters_mode='compress_once' needs an eviction method; method='full' "
                         "keeps every token")
