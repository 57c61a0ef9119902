"""How a cache holds its budget: the two modes a :class:`~qfilters_mlx.config.KVCacheConfig`
takes as ``mode``.

* :class:`Streaming` (the default): evict down to ``qfilters_budget`` after every update call.
* :class:`CompressOnce`: kvpress's and the paper's protocol: keep every token until the cache
  is compressed once, then append (see :mod:`qfilters_mlx.cache.compression`).

Both are small frozen dataclasses, checked at construction (``ValueError`` / ``TypeError``
naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qfilters_mlx.config.checks import check_choice, check_int

MODES = ("streaming", "compress_once")
"""The modes' names (:attr:`Streaming.name`, :attr:`CompressOnce.name`)."""

COMPRESS_AT = ("prompt_end", "manual")
"""When a compress-once cache compresses (:attr:`CompressOnce.at`)."""


def check_compress_once(ratio, growth, at, names: dict) -> None:
    """The checks of :class:`CompressOnce`'s fields; errors name ``names[field]``.

    Raises:
        TypeError: ``ratio`` is not a float (or int), ``growth`` not an int.
        ValueError: ``ratio`` outside ``[0, 1)``, ``growth < 0``, ``at`` not in
            :data:`COMPRESS_AT`.
    """
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"{names['ratio']} must be a float, got {type(ratio).__name__} ({ratio!r})")
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"{names['ratio']} (the fraction of tokens removed, as kvpress's "
                             f"compression_ratio) must be in [0, 1), got {ratio!r}")
    if growth is not None:
        check_int(names["growth"], growth, 0)
    check_choice(names["at"], at, COMPRESS_AT)


@dataclass(frozen=True)
class Streaming:
    """Evict down to ``qfilters_budget`` after every update call (no fields)."""

    name: ClassVar[str] = "streaming"


@dataclass(frozen=True)
class CompressOnce:
    """Keep every token until one compression, then append (kvpress's protocol).

    Attributes:
        ratio: the fraction of the tokens seen that the compression removes (kvpress's
            ``compression_ratio``, in ``[0, 1)``): each (batch row, KV head) keeps
            ``max(1, int(T * (1 - ratio)))`` of its ``T`` tokens. ``None`` (default): keep
            the config's absolute ``qfilters_budget`` instead.
        growth: tokens the cache may grow by after the compression before it evicts again
            (back to compressed size + growth, with the streaming rule); ``None`` (default)
            grows without limit.
        at: ``"prompt_end"`` (default: the first single-token call after a multi-token call,
            where mlx-lm's ``generate_step`` has prefilled the prompt but its last token) or
            ``"manual"`` (only :func:`qfilters_mlx.compress_caches`).

    Raises:
        TypeError: ``ratio`` not a float, ``growth`` not an int.
        ValueError: ``ratio`` outside ``[0, 1)``, ``growth < 0``, ``at`` not in
            :data:`COMPRESS_AT`.
    """

    name: ClassVar[str] = "compress_once"
    ratio: float | None = None
    growth: int | None = None
    at: str = "prompt_end"

    def __post_init__(self) -> None:
        check_compress_once(self.ratio, self.growth, self.at,
                            {f: f"CompressOnce.{f}" for f in ("ratio", "growth", "at")})


STREAMING = Streaming()
"""The default mode."""
