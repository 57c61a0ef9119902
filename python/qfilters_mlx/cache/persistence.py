"""Saving, loading and copying ``QFiltersKVCache``: the format.

A cache (:mod:`qfilters_mlx.cache.kv_cache`) is described as a :class:`Snapshot`
(:func:`snapshot`) and restored from one (:func:`restore`; these two read and write the
cache's own underscore state, as its other component modules do); the rest are pure
functions: this module turns a snapshot into the ``state`` tuple
mlx-lm's ``save_prompt_cache`` stores (:func:`encode`) and back, checking everything
(:func:`decode`), and prepares the attribute dicts of pickling and ``copy.deepcopy``
(:func:`for_pickle`, :func:`from_pickle`).

* ``state`` = ``(keys, values, scores, positions, filter, queries, meta)`` plus, for
  ``QuantizedQFiltersKVCache``, the entries its storage adds
  (:meth:`~qfilters_mlx.cache.quantized.QuantizedRows.saved`). The rows are in temporal
  order; ``meta`` is a JSON string: ``"format": 2``, the configuration (``"config"``) and
  the build options the cache uses (``"build"``: backend, max_rewind, kv_bits,
  kv_group_size; :mod:`qfilters_mlx.config.state`), the scalar attributes and the slot
  layout. Files of format 1 (no ``"format"``, as 0.2.x wrote them; tested with 0.2.0's) are
  read through :func:`~qfilters_mlx.config.state.from_format1`; another format raises
  ``ValueError`` before the cache changes.
  A cache saved in the middle of a decode (slot mode) reloads in the same slot layout, so
  it continues bit for bit like an uninterrupted run. The rewind journal is not saved: a
  reloaded cache can rewind only what it has seen since (a deeper ``trim`` raises).
* copies: the resolved kernel backend (a table of compiled functions, not picklable) is
  stored by name and resolved again; everything else (arrays, journal, storage) is
  copied, so copies are independent.
"""

from __future__ import annotations

import dataclasses
import json
import os

import mlx.core as mx

from qfilters_mlx.backends.dispatch import get_backend
from qfilters_mlx.cache.dense import DenseRows
from qfilters_mlx.cache.journal import RewindJournal
from qfilters_mlx.cache.journal_rows import to_slots
from qfilters_mlx.cache.quantized import QuantizedRows
from qfilters_mlx.cache.rewind import depth_now
from qfilters_mlx.cache.rows import Rows
from qfilters_mlx.cache.speculative import guard_speculative
from qfilters_mlx.config import (DEFAULT_KV_GROUP_SIZE, FORMAT, FORMATS, BuildOptions,
                                 KVCacheConfig, build_from_state, build_to_state,
                                 config_from_state, config_to_state, from_format1)

__all__ = ["Snapshot", "decode", "encode", "for_pickle", "from_pickle", "read_meta", "restore",
           "saved_state", "snapshot"]

_ENTRIES = 7  # (keys, values, scores, positions, filter, queries, meta)


@dataclasses.dataclass
class Snapshot:
    """Everything a saved cache holds (the rewind journal excepted).

    ``rows``: ``(keys, values, scores, positions)``, in temporal order in :func:`encode`'s
    input, in the stored layout (slot layout when ``free`` is set) in :func:`decode`'s
    output; ``None`` each while empty. ``slot_order``: ``[B, H_kv, S-1]`` int32 slot of
    each temporal row, with ``free [B, H_kv]`` the free slot (slot mode), else ``None``.
    ``build``: the :class:`BuildOptions` the cache uses (the backend by the name asked for).
    ``storage``: the quantized storage (``None`` for dense rows). ``compressed``: ``(rows kept, offset)`` of a
    compress-once compression, or ``None``.
    """

    config: KVCacheConfig
    build: BuildOptions
    layer_idx: int
    offset: int
    evicted: bool
    filter_fixed: bool
    rows: tuple
    filter: mx.array | None
    queries: mx.array | None
    compressed: tuple | None = None
    saw_chunk: bool = False
    keep_last_kv: bool = False
    slot_order: mx.array | None = None
    free: mx.array | None = None
    storage: QuantizedRows | None = None


def encode(s: Snapshot) -> tuple:
    """The ``state`` tuple of a snapshot (rows in temporal order)."""
    cfg = config_to_state(s.config)
    if not isinstance(cfg["qfilters_filters"], str):
        cfg["qfilters_filters"] = None  # the layer's slice is saved as `filter`
    meta = {
        "format": FORMAT,
        "config": cfg,
        "build": build_to_state(s.build),
        "filter_fixed": s.filter_fixed,
        "offset": str(s.offset),
        "layer_idx": s.layer_idx,
        "evicted": s.evicted,
    }
    if s.compressed is not None:  # compress-once mode: (rows kept, offset then)
        meta["compressed"] = [s.compressed[0], str(s.compressed[1])]
    if s.saw_chunk:
        meta["saw_chunk"] = True
    if s.keep_last_kv:
        meta["keep_last_kv"] = True
    if s.free is not None:
        meta["slots"] = {"order": s.slot_order.tolist(), "free": s.free.tolist()}
    extra = ()
    if s.storage is not None:
        extra_meta, extra = s.storage.saved()
        meta.update(extra_meta)
    return (*s.rows, s.filter, s.queries, json.dumps(meta), *extra)


def _config(fields: dict) -> KVCacheConfig:
    """The saved configuration (a ``qfilters_filters`` path that no longer exists is dropped:
    the layer's slice is the saved ``filter``)."""
    path = fields.get("qfilters_filters")
    if isinstance(path, str) and not os.path.isfile(path):
        fields["qfilters_filters"] = None  # moved since saving
    return config_from_state(fields)


def read_meta(text) -> dict:
    """The JSON meta string ``text`` of a saved state, parsed, in format 2: as it is, or
    translated from format 1 (no ``"format"``) by :func:`~qfilters_mlx.config.from_format1`.

    Raises:
        ValueError: not a JSON object; a ``"format"`` other than the int 2, naming it; a meta
            without one that is not format 1 (:func:`~qfilters_mlx.config.from_format1`).
    """
    try:
        meta = json.loads(text)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (TypeError, ValueError) as err:
        raise ValueError(f"state: bad meta ({err})") from err
    if "format" not in meta:  # format 1 has no marker
        return from_format1(meta)
    fmt = meta["format"]
    if type(fmt) is not int or fmt != FORMAT:
        raise ValueError(f"state: saved cache format {fmt!r} is not a format this version reads "
                         f"(formats {' and '.join(map(str, FORMATS))}: format 1 has no 'format' "
                         f"entry, format {FORMAT} the int {FORMAT}): load it with the version that "
                         "wrote it, or build the prompt cache again")
    return meta


def decode(v, quantized: bool, cls_name: str) -> Snapshot:
    """The snapshot a saved ``state`` ``v`` describes, checked; rows in the stored layout.

    Args:
        quantized: whether the loading class stores quantized rows (8 entries, else 7);
            cls_name: its name, for the messages.

    Raises:
        ValueError: not a tuple of 7 entries (8 for a quantized class), bad meta, a saved
            format other than 1 and 2 (named), rows whose
            shapes disagree with each other or the offset, a slot layout that does not match
            the rows, a state saved by the other cache class (``kv_bits`` set or not), or
            ``evicted`` for a method that never evicts (``"full"``).
    """
    entries = _ENTRIES + 1 if quantized else _ENTRIES
    if not isinstance(v, (tuple, list)) or len(v) != entries:
        if quantized:
            raise ValueError("state must be (keys, values, scores, positions, filter, queries, meta, "
                             "fp_keys) for a QuantizedQFiltersKVCache")
        raise ValueError("state must be (keys, values, scores, positions, filter, queries, meta)")
    keys, values, scores, positions, filt, queries, meta = v[:_ENTRIES]
    meta = read_meta(meta)
    storage = QuantizedRows.loaded(meta, tuple(v[_ENTRIES:]), keys, values) if quantized else None
    try:
        config = _config(dict(meta["config"]))
        build = build_from_state(meta["build"])
        scalars = (int(meta["layer_idx"]), int(meta["offset"]), bool(meta["evicted"]),
                   bool(meta["filter_fixed"]))
        compressed = meta.get("compressed")
        if compressed is not None:
            compressed = (int(compressed[0]), int(compressed[1]))
        saw_chunk = bool(meta.get("saw_chunk", False))
        keep_last_kv = bool(meta.get("keep_last_kv", False))
        slots = meta.get("slots")
        if slots is not None:
            order = mx.array(slots["order"], dtype=mx.int32)
            free = mx.array(slots["free"], dtype=mx.int32)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"state: bad meta ({err})") from err
    rows = (keys, values, scores, positions)
    if any(a is None for a in rows) and not all(a is None for a in rows):
        raise ValueError("state: keys, values, scores and positions must all be set or all None")
    if keys is not None:
        n = keys.shape[2]
        if (keys.ndim != 4 or values.shape[:3] != keys.shape[:3] or scores.shape != keys.shape[:3]
                or positions.shape != keys.shape[:3] or scalars[1] < n):
            raise ValueError("state: keys/values/scores/positions shapes disagree with each other "
                             "or with the offset")
    if slots is not None and (keys is None or order.shape != keys.shape[:3]
                              or free.shape != keys.shape[:2]):
        raise ValueError("state: meta 'slots' does not match the rows")
    if (build.kv_bits is not None) != quantized:
        raise ValueError(f"state: kv_bits={build.kv_bits} was saved by another cache class than "
                         f"{cls_name} (QuantizedQFiltersKVCache stores kv_bits caches)")
    if not config.scorer.evicts and scalars[2]:
        raise ValueError(f"state: meta says evicted=True for method={config.method!r}, which "
                         "never evicts")
    get_backend(build.backend)  # raises when the saved backend is not available here
    snap = Snapshot(config, build, *scalars, rows, filt, queries, compressed, saw_chunk, keep_last_kv,
                    storage=storage)
    if slots is not None:
        snap.rows, snap.slot_order, snap.free = to_slots(rows, order), order, free
    return snap


def snapshot(cache) -> Snapshot:
    """What ``cache.state`` saves: its rows in temporal order (the layout left as it is),
    filter, kept queries, build options and scalars."""
    build = BuildOptions(cache._backend_name, cache.max_rewind, getattr(cache, "bits", None),
                         getattr(cache, "group_size", DEFAULT_KV_GROUP_SIZE))
    return Snapshot(
        cache.config, build, cache.layer_idx, cache.offset, cache.evicted, cache.filter_fixed,
        cache._temporal(), cache.filter, cache._queries, cache._compressed, cache._saw_chunk,
        cache.keep_last_kv, slot_order=None if cache._free is None else cache._slot_order(),
        free=cache._free, storage=cache.storage if cache.quantized else None)


def saved_state(cache) -> tuple:
    """``(keys, values, scores, positions, filter, queries, meta)`` (a quantized cache adds
    its storage's entries): the live rows in temporal order, the filter, the kept
    calibration queries and a JSON string (:func:`encode`), so that mlx-lm's
    ``save_prompt_cache`` / ``load_prompt_cache`` round-trip the cache exactly. Arrays are
    ``None`` while the cache is empty. Reading it changes nothing; setting it
    (:func:`restore`) checks everything first."""
    return encode(snapshot(cache))


def restore(cache, v) -> None:
    """Set ``cache`` to the saved ``state`` ``v`` (checked first by :func:`decode`; nothing
    changes when it raises). The rewind journal starts empty."""
    s = decode(v, cache.quantized, type(cache).__name__)
    guard_speculative()  # (a loaded cache may be a draft model's)
    backend_name, max_rewind, bits, group_size = (s.build.backend, s.build.max_rewind,
                                                  s.build.kv_bits, s.build.kv_group_size)
    cache.config, cache.layer_idx = s.config, s.layer_idx
    cache.scorer = s.config.scorer.from_config(s.config, s.layer_idx)
    cache.backend, cache._backend_name = get_backend(backend_name), backend_name
    cache.max_rewind = max_rewind
    if cache.quantized:
        cache.bits, cache.group_size, cache.storage = bits, group_size, s.storage
    else:
        cache.storage = DenseRows()
    cache.offset, cache.evicted, cache.filter_fixed = s.offset, s.evicted, s.filter_fixed
    cache.queries_observed = cache._queries_pending = False
    cache._queries = s.queries
    cache.rows = Rows(*s.rows)
    cache._n = 0 if s.rows[0] is None else s.rows[0].shape[2] - (s.free is not None)
    cache._free, cache._victim_rows = s.free, None
    cache.filter = s.filter
    cache._journal = RewindJournal(depth_now(cache))
    cache._compressed, cache._saw_chunk = s.compressed, s.saw_chunk
    cache.resolve_limits()
    cache.keep_last_kv, cache._last_kv = s.keep_last_kv, None


def for_pickle(d: dict, backend_name: str) -> dict:
    """``__getstate__``: a cache's attribute dict ``d`` with the backend stored by name."""
    d = dict(d)
    d["backend"] = backend_name
    return d


def from_pickle(d: dict) -> dict:
    """``__setstate__``: the attribute dict of a copy, the backend resolved again by name.
    A copy is not the cache an ``observe_queries`` block registered: it must be observed on
    its own before it may grow (never a silently unobserved copy)."""
    d = dict(d)
    d["backend"] = get_backend(d["backend"])  # stored by name (for_pickle)
    d["queries_observed"] = False
    d["_queries_pending"] = False
    return d
