"""Per-head recent windows of :class:`qfilters_mlx.config.KVCacheConfig`.

``qfilters_recent`` is one int (every layer and KV head), a per-head table
``[n_layers, n_kv_heads]`` or one row ``[n_kv_heads]`` shared by every layer (nested
sequences or an array of ints), or ``"calibrated"``: the table stored for this budget
and sink count in the filters file ``qfilters_filters`` (written by
``qfilters-mlx calibrate``, see :mod:`qfilters_mlx.filters.windows`), read when the caches
are built (:func:`with_stored_windows`, called once by ``KVCacheBuilder``): the configuration
reads no file. Tables are normalised to tuples of Python ints at construction, so configs stay
hashable and JSON round-trips (``state``) rebuild the same config.
"""

from __future__ import annotations

import numbers

CALIBRATED = "calibrated"


def _as_nested_ints(value) -> tuple:
    """Nested sequence / array of ints -> nested tuples of Python ints (1-D or 2-D)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"qfilters_recent must be an int, 'calibrated' or a per-head table, got "
                        f"{type(value).__name__} ({value!r})")
    if not value:
        raise ValueError("qfilters_recent: a per-head table must not be empty")
    rows = [list(r) if isinstance(r, (list, tuple)) else r for r in value]
    two_d = all(isinstance(r, list) for r in rows)
    if not two_d and any(isinstance(r, list) for r in rows):
        raise ValueError("qfilters_recent: a per-head table must be [n_kv_heads] or [n_layers, n_kv_heads]")
    flat = [v for r in rows for v in r] if two_d else rows
    for v in flat:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"qfilters_recent: windows must be ints, got {type(v).__name__} ({v!r})")
    if two_d:
        if len({len(r) for r in rows}) != 1 or not rows[0]:
            raise ValueError("qfilters_recent: every layer needs the same number (>= 1) of KV-head windows")
        return tuple(tuple(int(v) for v in r) for r in rows)
    return tuple(int(v) for v in rows)


def resolve_recent(recent, budget: int, n_sink: int, ranks: bool, filters):
    """The normalised ``qfilters_recent`` (int, or a tuple table), checked.

    Args:
        recent: the field as given (``None`` is resolved by the caller).
        budget, n_sink: the config's (per-head windows need ``n_sink + w <= budget``:
            a head may keep only sinks and recent tokens; the scalar rule of the config,
            ``n_sink + recent < budget``, is unchanged).
        ranks: the method's scorer ranks by score (:attr:`Scorer.ranks`); one that keeps by
            position only ignores the windows, which are then not checked.
        filters: ``qfilters_filters`` (a path for ``"calibrated"``, which stays
            ``"calibrated"``: :func:`with_stored_windows` reads the table).

    Raises:
        ValueError: ``"calibrated"`` without a filters path; a window < 0 or above
            ``budget - n_sink`` (names layer and head); a ragged table.
        TypeError: a window that is not an int, or a value of another type.
    """
    if isinstance(recent, str):
        if recent != CALIBRATED:
            raise ValueError(f"qfilters_recent must be an int, a per-head table or 'calibrated', "
                             f"got {recent!r}")
        if not isinstance(filters, str):
            raise ValueError("qfilters_recent='calibrated' reads the per-head windows of a filters "
                             "file: set qfilters_filters to the path written by `qfilters-mlx calibrate`")
        return CALIBRATED
    if isinstance(recent, numbers.Integral) and not isinstance(recent, bool):
        return int(recent)
    if isinstance(recent, bool):
        raise TypeError(f"qfilters_recent must be an int, got bool ({recent!r})")
    table = _as_nested_ints(recent)
    if ranks:
        rows = table if isinstance(table[0], tuple) else (table,)
        for layer, row in enumerate(rows):
            for head, w in enumerate(row):
                if w < 0 or n_sink + w > budget:
                    raise ValueError(f"qfilters_recent: window {w} of layer {layer}, KV head {head} must "
                                     f"be in [0, budget - n_sink] = [0, {budget - n_sink}]")
    return table


def with_stored_windows(config):
    """``config``, or for ``qfilters_recent="calibrated"`` a copy holding the table its filters
    file stores for its budget and ``n_sink`` (the file read here; ``KVCacheBuilder`` calls this
    once per build, before any cache exists).

    Raises:
        ValueError: the file holds no windows, or none for this budget and ``n_sink`` (named),
            or a table :class:`~qfilters_mlx.config.KVCacheConfig` refuses.
    """
    if config.qfilters_recent != CALIBRATED:
        return config
    import dataclasses

    from qfilters_mlx.stored_windows import load_windows

    table = load_windows(config.qfilters_filters, config.qfilters_budget, config.qfilters_n_sink)
    return dataclasses.replace(config, qfilters_recent=table)


def layer_recent(recent, layer: int):
    """The window argument of one layer's cache: the int, the shared row, or row ``layer``
    of a ``[n_layers, n_kv_heads]`` table (a tuple of ``n_kv_heads`` ints).

    Raises:
        ValueError: ``layer`` is outside the table; ``"calibrated"`` windows not read yet
            (:func:`with_stored_windows`).
    """
    if recent == CALIBRATED:
        raise ValueError("qfilters_recent='calibrated': the per-head windows of the filters file are "
                         "read when KVCacheBuilder.for_model / install build the caches; for a cache "
                         "built alone pass the table (qfilters_mlx.config.with_stored_windows(config))")
    if isinstance(recent, int) or not isinstance(recent[0], tuple):
        return recent
    if not 0 <= layer < len(recent):
        raise ValueError(f"qfilters_recent has windows for {len(recent)} layers; layer {layer} has none")
    return recent[layer]


def per_layer_table(config, n_layers: int) -> bool:
    """Whether ``config.qfilters_recent`` is a ``[n_layers, n_kv_heads]`` table (then checked
    to have exactly ``n_layers`` rows, the model's budgeted layers).

    Raises:
        ValueError: the table has another number of rows.
    """
    r = config.protected_recent
    if isinstance(r, (int, str)) or not isinstance(r[0], tuple):
        return False
    if len(r) != n_layers:
        raise ValueError(f"qfilters_recent has per-head windows for {len(r)} layers, the model has "
                         f"{n_layers} budgeted layers")
    return True
