"""A configuration and its build options as JSON objects: the form saved prompt caches store
(``QFiltersKVCache.state``, :mod:`qfilters_mlx.cache.persistence`).

Format 2 (:data:`FORMAT`, written since 0.3.0): the saved meta holds ``"format": 2``,
``"config"`` (the fields of :class:`KVCacheConfig` by their names, the mode as
``{"name": "streaming"}`` or ``{"name": "compress_once", "ratio", "growth", "at"}``) and
``"build"`` (the :class:`BuildOptions` the cache uses). Format 1 (no ``"format"``; written by
0.2.x and earlier) kept one flat ``"config"`` object with the mode and the build options under their 0.1 names;
:func:`from_format1`, the one translator, turns such a meta into format 2.
"""

from __future__ import annotations

import dataclasses

from qfilters_mlx.config.build import NAMES, BuildOptions
from qfilters_mlx.config.method import KVCacheConfig
from qfilters_mlx.config.modes import STREAMING, CompressOnce
from qfilters_mlx.config.removed import BUILD, MODE, REMOVED

FORMAT = 2
"""The saved format written now."""
FORMATS = (1, 2)
"""The saved formats read: 1 (no ``"format"`` entry; through :func:`from_format1`) and
:data:`FORMAT` (``"format": 2``, the int)."""

_METHOD_FIELDS = ("method", "head_dim", "qfilters_budget", "qfilters_n_sink", "qfilters_recent",
                  "qfilters_calib_tokens", "qfilters_sign", "qfilters_seed",
                  "qfilters_filter_source", "qfilters_filters")


def config_to_state(config: KVCacheConfig) -> dict:
    """``{field: value}`` of ``config``, the mode as ``{"name": ..., its fields}``;
    JSON-serialisable but for an array in ``qfilters_filters``."""
    state = {name: getattr(config, name) for name in _METHOD_FIELDS}
    state["mode"] = {"name": config.mode.name, **dataclasses.asdict(config.mode)}
    return state


def config_from_state(state: dict) -> KVCacheConfig:
    """The configuration :func:`config_to_state` saved as ``state``.

    Raises:
        ValueError, TypeError: a value :class:`KVCacheConfig` refuses, or a mode that is not
            ``{"name": "streaming"}`` / ``{"name": "compress_once", ...}``.
    """
    values = dict(state)
    mode = dict(values.get("mode") or {})
    name = mode.pop("name", None)
    if name == STREAMING.name and not mode:
        values["mode"] = STREAMING
    elif name == CompressOnce.name:
        values["mode"] = CompressOnce(**mode)
    else:
        raise ValueError(f"saved mode must be {{'name': 'streaming'}} or {{'name': 'compress_once', "
                         f"...}}, got {state.get('mode')!r}")
    return KVCacheConfig(**values)


def build_to_state(options: BuildOptions) -> dict:
    """``{option: value}`` of ``options``."""
    return dataclasses.asdict(options)


def build_from_state(state: dict) -> BuildOptions:
    """The build options :func:`build_to_state` saved as ``state``.

    Raises:
        ValueError: ``state`` is not a ``{option: value}`` object, or names an option not in
            :data:`~qfilters_mlx.config.build.NAMES` (each named).
        TypeError, ValueError: a value :class:`BuildOptions` refuses.
    """
    if not isinstance(state, dict):
        raise ValueError(f"saved build options must be an object {{option: value}}, got {state!r}")
    unknown = sorted(set(state) - set(NAMES))
    if unknown:
        raise ValueError(f"saved build options {unknown} are not options (known: {list(NAMES)})")
    return BuildOptions(**state)


def from_format1(meta: dict) -> dict:
    """The format-2 meta of a format-1 saved meta ``meta`` (not changed): its flat ``"config"``
    split into the configuration's fields, the ``"mode"`` and the ``"build"`` options
    (:data:`~qfilters_mlx.config.removed.REMOVED` says where each 0.1 field went; a
    streaming configuration's ``qfilters_compress_at``, which streaming ignores, is dropped),
    ``"format": 2``; every other entry as it was.

    Raises:
        ValueError: ``meta`` is not format 1: it has a ``"format"`` or ``"build"`` entry, or its
            ``"config"`` is not an object, has a ``"mode"`` or lacks ``"qfilters_mode"``; or a
            streaming configuration sets ``qfilters_compression_ratio`` / ``qfilters_growth``
            (0.2 refused that too).
    """
    flat = meta.get("config")
    if not isinstance(flat, dict):
        raise ValueError(f"state: format-1 meta without a 'config' object (got {flat!r})")
    given = [k for k in ("format", "build") if k in meta] + ["config.mode"] * ("mode" in flat)
    if given or "qfilters_mode" not in flat:
        raise ValueError(f"state: not a format-1 meta (format 1 has no 'format', 'build' or "
                         f"'config.mode' entry and a 'config.qfilters_mode'; got "
                         f"{given or 'no qfilters_mode'})")
    config = {k: v for k, v in flat.items() if k not in REMOVED}
    mode = {new: flat[old] for old, (part, new) in REMOVED.items() if part == MODE and old in flat}
    if mode["name"] == STREAMING.name:
        unused = [old for old, (part, new) in REMOVED.items()
                  if new in ("ratio", "growth") and flat.get(old) is not None]
        if unused:
            raise ValueError(f"state: format-1 config sets {unused} with qfilters_mode='streaming' "
                             "(only used with 'compress_once')")
        mode = {"name": STREAMING.name}
    config["mode"] = mode
    build = {new: flat[old] for old, (part, new) in REMOVED.items()
             if part == BUILD and flat.get(old) is not None}
    return {**meta, "format": FORMAT, "config": config, "build": build}
