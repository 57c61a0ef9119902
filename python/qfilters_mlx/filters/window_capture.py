"""Keys, queries and values of every budgeted layer over calibration text, for
:func:`qfilters_mlx.filters.windows.calibrate_windows` (one forward pass per chunk,
fresh caches of the model's own kind, so RoPE positions restart per chunk)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from qfilters_mlx.filters.capture import QueriesNotCaptured, capture_attention, describe_layers
from qfilters_mlx.model_info import budgeted_slots, default_caches, model_dims, walk


def keys_and_queries(model, token_chunks):
    """Yield, per chunk, a list over budgeted layers of ``(keys [H_kv, T, D],
    queries [H_q, T, D], values [H_kv, T, D_v])`` float32 numpy arrays (post-RoPE keys and
    queries, batch row 0; the values are what the layer's cache holds after the pass).

    Raises:
        QueriesNotCaptured: some layer delivered no queries (named).
    """
    n_layers, _, _ = model_dims(model)
    paths = [s.path for s in budgeted_slots(model)]
    for chunk in token_chunks:
        got: list = [None] * n_layers
        missing: dict = {}

        def grab(layer, queries, keys):
            got[layer] = (keys[0].astype(mx.float32), queries[0].astype(mx.float32))

        caches = default_caches(model)
        slot = dict(walk(caches))
        with capture_attention(model, grab, caches=[slot[p] for p in paths], on_missing=missing.setdefault):
            model(mx.array(chunk)[None], cache=caches)
        missing.update({i: "no update_and_fetch call" for i, g in enumerate(got) if g is None and i not in missing})
        if missing:
            raise QueriesNotCaptured(f"calibrate: no post-RoPE queries for {describe_layers(missing)}", missing)
        values = [slot[p].state[1][0, :, : len(chunk)].astype(mx.float32) for p in paths]
        yield [(np.array(k), np.array(q), np.array(v)) for (k, q), v in zip(got, values)]
