"""How caches are built, apart from the eviction method: the kernel backend, the rewind depth
and the K/V storage. Keyword arguments of ``KVCacheBuilder(...)``, ``KVCacheBuilder.for_model``,
``KVCacheBuilder.install`` and the cache constructors; :class:`BuildOptions` holds one checked
set of them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from qfilters_mlx.backends.dispatch import BACKENDS
from qfilters_mlx.config.checks import check_choice, check_int

DEFAULT_BACKEND = "auto"
"""The fastest backend available (see :mod:`qfilters_mlx.backends.dispatch`)."""
AUTO = "auto"
DEFAULT_MAX_REWIND = AUTO
"""Rewinds on demand: no rewind journal (no cost) until mlx-lm asks ``is_trimmable()`` before
the cache's first eviction (its speculative decoding asks before the prompt, ``trim_prompt_cache``
before each trim); the cache then journals its last :data:`AUTO_REWIND` tokens and answers
True. Asked after an eviction it had no journal for, it answers False (mlx-lm then refuses
speculative decoding up front). docs/mlx-lm.md, "Where it works in mlx-lm" (speculative decoding)."""
AUTO_REWIND = 16
"""The rewind depth ``max_rewind="auto"`` turns on: above the draft lengths mlx-lm uses
(``--num-draft-tokens`` 3 in ``mlx_lm.generate``, 2 in ``speculative_generate_step``); a deeper
rewind raises ``ValueError`` naming ``max_rewind`` before changing anything."""


def rewind_depth(max_rewind) -> int:
    """The journal depth a ``max_rewind`` value can reach: :data:`AUTO_REWIND` for ``"auto"``."""
    return AUTO_REWIND if max_rewind == AUTO else max_rewind
KV_BITS = (2, 4, 8)
"""``kv_bits`` values: the widths whose packed rows fill whole uint32 words (mlx-lm's
``QuantizedKVCache`` allocates ``head_dim * bits / 32`` words per row)."""
KV_GROUP_SIZES = (32, 64, 128)
"""``kv_group_size`` values ``mx.quantize`` supports."""
DEFAULT_KV_GROUP_SIZE = 64
"""mlx-lm's ``--kv-group-size`` default."""

NAMES = ("backend", "max_rewind", "kv_bits", "kv_group_size")
"""The options' keyword names."""


def check_build(backend, max_rewind, kv_bits, kv_group_size, head_dim=None) -> None:
    """The checks of one set of build options; errors name the keyword.

    Raises:
        TypeError: ``max_rewind`` (other than ``"auto"``), ``kv_bits`` or ``kv_group_size`` is
            not an int.
        ValueError: ``backend`` not in :data:`BACKENDS`, ``max_rewind < 0``, ``kv_bits`` not
            in :data:`KV_BITS`, ``kv_group_size`` not in :data:`KV_GROUP_SIZES`, ``kv_bits``
            with ``max_rewind > 0`` (rewinds replay stored rows at full precision, which a
            quantized cache no longer has), or ``head_dim`` not a multiple of
            ``kv_group_size`` with ``kv_bits``.
    """
    check_choice("backend", backend, BACKENDS)
    if max_rewind != AUTO:
        check_int("max_rewind", max_rewind, 0)
    if kv_bits is not None:
        check_int("kv_bits", kv_bits, 1)
        if kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be None or one of {KV_BITS}, got {kv_bits}")
    check_int("kv_group_size", kv_group_size, 1)
    if kv_group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES} (mx.quantize), "
                         f"got {kv_group_size}")
    if kv_bits is None:
        return
    if max_rewind != AUTO and max_rewind > 0:
        raise ValueError(f"kv_bits={kv_bits} needs max_rewind=0, got "
                         f"{max_rewind}: a quantized cache cannot rewind after an eviction "
                         "(speculative decoding with kv_bits is not supported)")
    if head_dim is not None and head_dim % kv_group_size:
        raise ValueError(f"head_dim ({head_dim}) must be a multiple of kv_group_size "
                         f"({kv_group_size}) with kv_bits={kv_bits}")


@dataclass(frozen=True)
class BuildOptions:
    """One checked set of build options (the defaults: :data:`DEFAULT_BACKEND`,
    :data:`DEFAULT_MAX_REWIND`, full-precision storage, :data:`DEFAULT_KV_GROUP_SIZE`).

    Attributes:
        backend: kernel backend, one of ``"auto"``, ``"reference"``, ``"cpp"``, ``"metal"``;
            resolved when a cache is built (``get_backend``).
        max_rewind: tokens ``trim`` can rewind exactly after an eviction (speculative
            decoding's rejected drafts, prompt-cache prefixes); ``"auto"`` (default,
            :data:`DEFAULT_MAX_REWIND`): :data:`AUTO_REWIND` once mlx-lm asks
            ``is_trimmable()`` before the first eviction, else none; ``0`` keeps nothing
            (``is_trimmable()`` is then False). The journal is counted in ``nbytes``.
        kv_bits: ``None`` (K/V in the model's dtype) or 2, 4, 8: the kept K/V stored
            quantized as mlx-lm's ``QuantizedKVCache`` stores them; needs ``max_rewind`` 0
            or ``"auto"`` (which then never turns a journal on).
        kv_group_size: quantization group size along the head dimension (32, 64, 128).

    Raises:
        TypeError, ValueError: see :func:`check_build`.
    """

    backend: str = DEFAULT_BACKEND
    max_rewind: int | str = DEFAULT_MAX_REWIND
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE

    def __post_init__(self) -> None:
        check_build(self.backend, self.max_rewind, self.kv_bits, self.kv_group_size)

    def given(self) -> dict:
        """The options that differ from the defaults, by name."""
        default = BuildOptions()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def merge_options(*layers: dict) -> BuildOptions:
    """The options a cache is built with: for each option the first value that is not ``None``
    in ``layers`` (``{option: value or None}``, the most specific first: a call's keywords,
    then its builder's), else the default.

    Raises:
        TypeError, ValueError: a value :func:`check_build` refuses (named).
    """
    values = {}
    for name in NAMES:
        given = [layer[name] for layer in layers if layer.get(name) is not None]
        if given:
            values[name] = given[0]
    return BuildOptions(**values)
