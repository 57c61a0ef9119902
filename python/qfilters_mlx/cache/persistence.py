"""Saving, loading and copying ``QFiltersKVCache`` (mixin).

* ``state`` / ``from_state``: what mlx-lm's ``save_prompt_cache`` /
  ``load_prompt_cache`` store; a cache saved in the middle of a decode (slot
  mode) reloads in the same slot layout, so it continues bit for bit like an
  uninterrupted run. The rewind journal is not saved: a reloaded cache can
  rewind only what it has seen since (a deeper ``trim`` raises).
* ``to_quantized``: :mod:`.quantized` (``QFiltersKVCache.to_quantized``).
* pickling and ``copy.deepcopy``: the resolved kernel backend (a table of
  compiled functions, not picklable) is stored by name and resolved again;
  everything else (arrays, journal) is copied, so copies are independent.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx

from qfilters_mlx.backends.dispatch import get_backend
from qfilters_mlx.cache.journal import RewindJournal, to_slots
from qfilters_mlx.config import config_from_state, config_to_state


class PersistenceMixin:
    """``state`` (getter/setter), ``__getstate__`` / ``__setstate__``."""

    @property
    def state(self):
        """``(keys, values, scores, positions, filter, queries, meta)``: the live rows
        in temporal order (``[B, H_kv, size(), D]``, scores float32 and positions
        int64 ``[B, H_kv, size()]``), the ``[H_kv, D]`` filter, the first queries kept
        for query-based calibration (until the first eviction) and a JSON string.

        ``meta`` carries the configuration, the scalar attributes (offset as a
        string: exact beyond 2**31, layer index, eviction flag) and, in slot mode,
        the slot of every row and the free slot (``"slots"``), and in compress-once
        mode the compression's kept rows and offset (``"compressed"``), so that mlx-lm's
        ``save_prompt_cache`` / ``load_prompt_cache`` round-trip the cache exactly.
        Arrays are ``None`` while the cache is empty. Reading it changes nothing.
        """
        keys, values, scores, positions = self._temporal()
        cfg = config_to_state(self.config)
        if not isinstance(cfg["qfilters_filters"], str):
            cfg["qfilters_filters"] = None  # the layer's slice is saved as `filter`
        meta = {
            "config": cfg,
            "filter_fixed": self.filter_fixed,
            "offset": str(self.offset),
            "layer_idx": self.layer_idx,
            "evicted": self.evicted,
        }
        if self._compressed is not None:  # compress-once mode: (rows kept, offset then)
            meta["compressed"] = [self._compressed[0], str(self._compressed[1])]
        if self._saw_chunk:
            meta["saw_chunk"] = True
        if self.keep_last_kv:
            meta["keep_last_kv"] = True
        if self._free is not None:
            meta["slots"] = {"order": self._slot_order().tolist(), "free": self._free.tolist()}
        return (keys, values, scores, positions, self.filter, self._queries, json.dumps(meta))

    @state.setter
    def state(self, v):
        # Parse and check everything before touching the cache.
        if not isinstance(v, (tuple, list)) or len(v) != 7:
            raise ValueError("state must be (keys, values, scores, positions, filter, queries, meta)")
        keys, values, scores, positions, filt, queries, meta = v
        try:
            meta = json.loads(meta)
            fields = dict(meta["config"])
            path = fields.get("qfilters_filters")
            if isinstance(path, str) and not os.path.isfile(path):
                fields["qfilters_filters"] = None  # moved since saving: the layer's slice is `filter`
            config, options = config_from_state(fields)
            config = config.with_build_options(options)
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
        arrays = (keys, values, scores, positions)
        if any(a is None for a in arrays) and not all(a is None for a in arrays):
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
        if (config.kv_bits is not None) != hasattr(type(self), "bits"):
            raise ValueError(f"state: kv_bits={config.kv_bits} was saved by another cache class than "
                             f"{type(self).__name__} (QuantizedQFiltersKVCache stores kv_bits caches)")
        if config.method == "full" and scalars[2]:
            raise ValueError("state: meta says evicted=True for method='full', which never evicts")
        backend = get_backend(config.qfilters_backend)
        self._free = None
        self._victim_rows = None
        self._journal = RewindJournal(0 if config.method == "full" else config.qfilters_max_rewind)
        self.config, self.backend = config, backend
        self.layer_idx, self.offset, self.evicted, self.filter_fixed = scalars
        self.queries_observed = False
        self._queries_pending = False
        self._queries = queries
        self._n = 0 if keys is None else keys.shape[2]
        if slots is not None:
            keys, values, scores, positions = to_slots(arrays, order)
            self._free = free
        self.keys, self.values, self.scores, self.positions = keys, values, scores, positions
        self.filter = filt
        self._compressed, self._saw_chunk = compressed, saw_chunk
        self.keep_last_kv, self._last_kv = keep_last_kv, None

    # ------------------------------------------------------------- copies
    def __getstate__(self) -> dict:
        """Everything but the resolved backend, which is stored by name."""
        d = dict(self.__dict__)
        d["backend"] = self.backend.name
        return d

    def __setstate__(self, d: dict) -> None:
        d = dict(d)
        d["backend"] = get_backend(d["backend"])  # stored by name (__getstate__)
        # A copy is not the cache an observe_queries block registered: it must be observed
        # on its own before it may grow (never a silently unobserved copy).
        d["queries_observed"] = False
        d["_queries_pending"] = False
        self.__dict__.update(d)
