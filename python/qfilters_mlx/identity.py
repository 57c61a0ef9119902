"""Model identity for filters files: what defines the model, not how mlx-lm parsed its config.

Not ``vars(model.args)``, which changes with the installed mlx-lm's
``ModelArgs`` (fields added, defaults filled in) although the model is the
same, so that a file calibrated on one install is accepted on another. The
identity comes from the model's parameters:

* ``model_type``: the architecture name (``model.model_type``, else the
  ``model_type`` of ``model.args`` / ``model.config``);
* ``n_parameters``: total number of stored parameter elements;
* ``parameters``: hash of every parameter's name, shape and dtype;
* ``weights``: hash of 16 evenly spaced elements of every parameter (float32),
  which tells apart two checkpoints of the same architecture.

:func:`model_identity` is a hash of these fields; files store both, so that a
mismatch can say which fields differ (:func:`identity_mismatch`).
"""

from __future__ import annotations

import hashlib
import json

SAMPLES_PER_PARAMETER = 16


def _model_type(model) -> str:
    for src in (model, getattr(model, "args", None), getattr(model, "config", None)):
        mt = getattr(src, "model_type", None)
        if isinstance(mt, str):
            return mt
    return type(model).__module__


def identity_fields(model) -> dict[str, str]:
    """The fields the identity is made of (see the module doc); all values are strings.

    For a tensor-parallel model (:mod:`qfilters_mlx.sharding`) the fields are the
    whole model's: the split parameters count with their whole shapes, and their
    sampled elements are gathered from the ranks (one ``mx.distributed.all_sum``), so
    every rank gets what one process gets for the unsharded model. A collective then:
    every rank must call it.
    """
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from qfilters_mlx.sharding import parameter_sharding, tensor_group

    split = parameter_sharding(model)
    group = tensor_group(model) if split else None
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    layout = hashlib.sha256()
    samples, gathered = [], []
    total = 0
    for name, p in params:
        shape = list(p.shape)
        if name in split:
            axis, n = split[name]
            shape[axis] *= n
        size = int(np.prod(shape)) if shape else 1
        layout.update(f"{name}:{tuple(shape)}:{p.dtype}\n".encode())
        total += size
        k = min(SAMPLES_PER_PARAMETER, size)
        full = np.linspace(0, size - 1, k).round().astype(np.int64)
        if name not in split:
            samples.append(p.reshape(-1)[mx.array(full)].astype(mx.float32) if k
                           else mx.zeros((0,), mx.float32))
            continue
        idx = list(np.unravel_index(full, shape))  # whole-model index -> owner and local index
        owner, idx[axis] = np.divmod(idx[axis], p.shape[axis])
        local = np.ravel_multi_index(idx, p.shape)
        mine = mx.array(owner == group.rank())
        vals = mx.where(mine, p.reshape(-1)[mx.array(local)].astype(mx.float32), 0.0)
        samples.append(mx.zeros((k,), mx.float32))
        gathered.append((len(samples) - 1, vals))
    if gathered:
        summed = mx.distributed.all_sum(mx.concatenate([v for _, v in gathered]), group=group,
                                        stream=mx.cpu)
        start = 0
        for i, v in gathered:
            samples[i] = summed[start:start + v.size]
            start += v.size
    values = np.array(mx.concatenate(samples)) if samples else np.zeros(0, np.float32)
    return {
        "model_type": _model_type(model),
        "n_parameters": str(total),
        "parameters": layout.hexdigest()[:16],
        "weights": hashlib.sha256(values.astype("<f4").tobytes()).hexdigest()[:16],
    }


def identity_of_fields(fields: dict[str, str]) -> str:
    """16 hex chars: hash of the identity fields."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def model_identity(model) -> str:
    """A stable hash (16 hex chars) of :func:`identity_fields`."""
    return identity_of_fields(identity_fields(model))


def identity_mismatch(stored: dict[str, str], model) -> list[str]:
    """``"field: stored != model's"`` for every identity field that differs (empty if none)."""
    mine = identity_fields(model)
    return [f"{k}: {stored.get(k)!r} (file) != {mine.get(k)!r} (model)"
            for k in sorted(set(stored) | set(mine)) if stored.get(k) != mine.get(k)]
