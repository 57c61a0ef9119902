"""The earlier spellings of :class:`~qfilters_mlx.config.KVCacheConfig`: mode fields and build
options given to the configuration itself. They keep working (one ``DeprecationWarning`` per
construction names the new spelling); errors in them name the old field.

:func:`translate_old_spellings` is the one entry: ``KVCacheConfig``'s keyword parsing calls it
(with a warning), and so does the loader of saved states (:mod:`.state`, without one: saved
states are written in this flat form).
"""

from __future__ import annotations

import warnings

from qfilters_mlx.config.build import BuildOptions, check_build
from qfilters_mlx.config.checks import check_choice
from qfilters_mlx.config.modes import STREAMING, MODES, CompressOnce, Streaming, check_compress_once

MODE_FIELDS = {"qfilters_compression_ratio": "ratio", "qfilters_growth": "growth",
               "qfilters_compress_at": "at"}
"""Old compress-once field -> :class:`CompressOnce` field (``qfilters_mode`` picks the class)."""

BUILD_FIELDS = {"qfilters_backend": "backend", "qfilters_max_rewind": "max_rewind",
                "kv_bits": "kv_bits", "kv_group_size": "kv_group_size"}
"""Old configuration field -> build option (keyword of ``KVCacheBuilder`` and the caches)."""

OLD_BUILD_NAMES = {new: old for old, new in BUILD_FIELDS.items()}


def translate_old_spellings(values: dict, warn_stacklevel: int | None) -> dict:
    """``values`` (keyword -> value of a ``KVCacheConfig`` construction, changed in place) with
    the old spellings taken out: the compress-once fields folded into ``values["mode"]``, the
    build options into ``values["_build_options"]`` (on top of those already there; ``None``
    when all are the defaults). ``values`` without an old spelling is returned untouched.

    Args:
        values: the keywords as given.
        warn_stacklevel: one ``DeprecationWarning`` naming the old spellings and their new
            form, at this stack level seen from the caller (``warnings.warn``'s count: 2 is
            the caller's caller); ``None``: no warning.

    Raises:
        ValueError, TypeError: a bad old value, naming the old field (see :func:`_fold_mode`,
            :func:`_fold_build`).
    """
    old_mode = {k: values.pop(k) for k in ("qfilters_mode", *MODE_FIELDS) if k in values}
    old_build = {k: values.pop(k) for k in BUILD_FIELDS if k in values}
    if not (old_mode or old_build):
        return values
    if warn_stacklevel is not None:
        _warn(old_mode, old_build, warn_stacklevel + 2)
    mode = values.get("mode", STREAMING)
    if old_mode and isinstance(mode, (Streaming, CompressOnce)):  # (another type: refused later)
        values["mode"] = _fold_mode(mode, old_mode)
    if old_build:
        values["_build_options"] = _fold_build(values.get("_build_options"), old_build)
    return values


def _warn(old_mode: dict, old_build: dict, stacklevel: int) -> None:
    """One ``DeprecationWarning`` naming the old spellings given and how to write them now."""
    given = ", ".join(f"{k}={v!r}" for k, v in {**old_mode, **old_build}.items())
    use = []
    if old_mode.get("qfilters_mode", "compress_once") == "streaming":
        use.append("mode=Streaming() (the default)")
    elif old_mode:
        fields = ", ".join(f"{MODE_FIELDS[k]}={v!r}" for k, v in old_mode.items() if k in MODE_FIELDS)
        use.append(f"mode=CompressOnce({fields})")
    if old_build:
        keywords = ", ".join(f"{BUILD_FIELDS[k]}={v!r}" for k, v in old_build.items())
        use.append(f"the keywords {keywords} where the caches are built (KVCacheBuilder(...), "
                   "KVCacheBuilder.for_model, KVCacheBuilder.install, the cache constructors)")
    warnings.warn(f"KVCacheConfig({given}) is deprecated: use {'; and '.join(use)}",
                  DeprecationWarning, stacklevel=stacklevel)


def _fold_mode(mode, old: dict):
    """``mode`` with the old compress-once fields ``old`` applied on top (what
    ``dataclasses.replace(config, qfilters_growth=...)`` did). Errors name the old fields.

    Raises:
        ValueError: ``qfilters_mode`` not in :data:`MODES`, a bad compress-once value, or
            ``qfilters_compression_ratio`` / ``qfilters_growth`` with the streaming mode
            (``qfilters_compress_at`` is ignored there, as it always was).
        TypeError: a compress-once value of the wrong type.
    """
    if not old:
        return mode
    name = old.get("qfilters_mode", getattr(mode, "name", None))
    check_choice("qfilters_mode", name, MODES)
    values = {f: getattr(mode, f, None) for f in MODE_FIELDS.values()}
    values["at"] = values["at"] or "prompt_end"
    values.update({MODE_FIELDS[k]: v for k, v in old.items() if k in MODE_FIELDS})
    check_compress_once(values["ratio"], values["growth"], values["at"],
                        {new: old_name for old_name, new in MODE_FIELDS.items()})
    if name == "compress_once":
        return CompressOnce(**values)
    for old_name in ("qfilters_compression_ratio", "qfilters_growth"):  # (compress_at: ignored)
        if values[MODE_FIELDS[old_name]] is not None:
            raise ValueError(f"{old_name} is only used with qfilters_mode='compress_once' "
                             "(got qfilters_mode='streaming')")
    return STREAMING


def _fold_build(carried: BuildOptions | None, old: dict) -> BuildOptions | None:
    """The build options a configuration carries: ``carried`` with the old fields ``old``
    applied on top, ``None`` when all are the defaults. Errors name the old fields (the
    configuration checks them against its ``head_dim``).

    Raises:
        TypeError, ValueError: see :func:`qfilters_mlx.config.build.check_build`.
    """
    if carried is not None and not isinstance(carried, BuildOptions):
        raise TypeError(f"_build_options must be a BuildOptions, got {carried!r}")
    values = {f: getattr(carried or BuildOptions(), f) for f in OLD_BUILD_NAMES}
    values.update({BUILD_FIELDS[k]: v for k, v in old.items()})
    check_build(**values, names=OLD_BUILD_NAMES)
    options = BuildOptions(**values)
    return options if options.given() else None
