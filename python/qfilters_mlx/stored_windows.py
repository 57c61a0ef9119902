"""The per-head recent windows a filters file stores, read back.

``qfilters-mlx calibrate`` writes them (:func:`qfilters_mlx.filters.windows.window_tensors`:
tensor ``"recent_windows"`` ``[n_budgets, n_layers, n_kv_heads]`` int32, metadata
``recent_budgets`` and ``recent_n_sink``); the builder reads them once per build through
:func:`load_windows` for a ``KVCacheConfig(qfilters_recent="calibrated")``
(:func:`qfilters_mlx.config.with_stored_windows`; a top-level module: the configuration imports
nothing of ``filters``).
"""

from __future__ import annotations

import json
import os

import numpy as np


def load_windows(path: str, budget: int, n_sink: int) -> tuple:
    """The ``[n_layers, n_kv_heads]`` windows stored in ``path`` for ``budget`` and
    ``n_sink``, as nested tuples of ints.

    Raises:
        ValueError: no such file, not a filters file, a file without windows (written before
            they existed: rerun ``qfilters-mlx calibrate``), or none for this budget / n_sink
            (names what it has).
    """
    if not os.path.isfile(path):
        raise ValueError(f"qfilters_filters: no such file: {path!r}")
    import mlx.core as mx

    arrays, meta = mx.load(path, return_metadata=True)
    if "filters" not in arrays:
        raise ValueError(f"{path} is not a qfilters-mlx filters file")
    if "recent_windows" not in arrays or "recent_budgets" not in meta:
        raise ValueError(f"{path} holds no per-head recent windows (written before they existed): "
                         "rerun `qfilters-mlx calibrate`, or pass an int qfilters_recent")
    budgets = json.loads(meta["recent_budgets"])
    stored_sink = int(meta.get("recent_n_sink", -1))
    if budget not in budgets or stored_sink != n_sink:
        raise ValueError(f"{path} has per-head windows for budgets {budgets} with n_sink {stored_sink}, "
                         f"not budget {budget} with n_sink {n_sink}")
    w = np.array(arrays["recent_windows"].astype(mx.int32))[budgets.index(budget)]
    return tuple(tuple(int(v) for v in row) for row in w)
