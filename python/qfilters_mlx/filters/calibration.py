"""Offline Q-Filters from post-RoPE queries, and the filter file format.

The paper's estimator (Godey et al. 2025, arXiv:2503.02812, Sec. 3): run the
model over calibration text, collect post-RoPE query vectors of every attention
layer and query head, take the top right-singular vector of an uncentred sample
per query head, orient it so that the queries project positively on average,
average over each GQA group and renormalise. Result: ``[n_layers, n_kv_heads,
head_dim]`` float32, used as ``score = +<k, f>``.

File format (safetensors): one tensor ``"filters"`` and string metadata
``format``, ``model_id`` (hash of ``model_fields``), ``model_fields`` (JSON: the
identity fields of :mod:`qfilters_mlx.identity`), ``n_layers``,
``n_kv_heads``, ``head_dim``, ``sign_convention`` (``"score = +(k . f)"``),
``calibration_text``, ``calibration_tokens``, ``samples_per_head``,
``qfilters_mlx_version``; optionally per-head recent windows
(:mod:`qfilters_mlx.filters.windows`: tensor ``recent_windows``, metadata
``recent_budgets``, ``recent_n_sink``, ``recent_rule``, ``recent_summary``).
"""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
import numpy as np

from qfilters_mlx import __version__
from qfilters_mlx.backends import reference
from qfilters_mlx.filters.capture import QueriesNotCaptured, capture_attention, describe_layers
from qfilters_mlx.identity import identity_fields, identity_mismatch, identity_of_fields  # noqa: F401
from qfilters_mlx.model_info import (budgeted_slots, check_filters_shape, default_caches, filters_dims,
                                     model_dims, walk)
from qfilters_mlx.sharding import gather_heads, rank_of

FORMAT = "qfilters-mlx/filters-v1"
SIGN_CONVENTION = "score = +(k . f)"
PAPER_SIGN_CONVENTION = "score = -(k . f)"


def calibrate_filters(model, token_chunks, samples: int = 4096, seed: int = 0) -> mx.array:
    """Estimate query-derived filters for every layer.

    Args:
        model: an mlx-lm model; its budgeted attention layers (plain ``KVCache``
            slots, see :func:`qfilters_mlx.model_info.model_dims`) are calibrated.
        token_chunks: iterable of 1-D token sequences; each is run as one
            independent forward pass (fresh caches of the model's own kind),
            so RoPE positions restart.
        samples: at most this many query rows per query head (uniform sample of
            all tokens seen, seeded).
        seed: sampling seed.

    Returns:
        ``[n_layers, n_kv_heads, head_dim]`` float32 unit vectors. On one rank of a
        tensor-parallel model each rank estimates its own KV heads and the result
        gathers every rank's (``mx.distributed.all_gather``): the whole model's filters,
        on every rank. A collective then: every rank must call it.

    Raises:
        ValueError: ``samples < 1``, no tokens, or the budgeted layers differ in
            KV heads or width (see ``model_dims``).
        QueriesNotCaptured: some layers delivered no queries (named, with the
            function computing their attention); nothing is returned.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    n_layers, n_kv, _ = model_dims(model)
    paths = [s.path for s in budgeted_slots(model)]
    per_layer: list[list[mx.array]] = [[] for _ in range(n_layers)]
    missing: dict[int, str] = {}

    def grab(layer, queries, _keys):
        per_layer[layer].append(queries[0].astype(mx.float32))  # [H_q, L, D]

    seen = 0
    for chunk in token_chunks:
        caches = default_caches(model)  # the model's own caches; sliding/recurrent ones too
        slot = dict(walk(caches))
        with capture_attention(model, grab, caches=[slot[p] for p in paths],
                               on_missing=missing.setdefault):
            model(mx.array(chunk)[None], cache=caches)
        mx.eval(per_layer)
        seen += len(chunk)
    if seen == 0:
        raise ValueError("no calibration tokens")
    missing.update({i: "no update_and_fetch call" for i, qs in enumerate(per_layer)
                    if not qs and i not in missing})
    if missing:
        raise QueriesNotCaptured(
            f"calibrate: no post-RoPE queries were found for {describe_layers(missing)} (no "
            "scaled_dot_product_attention call and no mx.fast.rope call on the queries was seen for "
            "their keys): query filters cannot be calibrated for this model; use "
            "qfilters_filter_source='keys' with qfilters_sign=+1 or -1 (CLI: --filter-source keys "
            "--sign 1) instead", missing)
    rng = np.random.default_rng(seed)
    filters = []
    for qs in per_layer:
        q = mx.concatenate(qs, axis=1)  # [H_q, N, D]
        n = q.shape[1]
        if n > samples:
            idx = np.sort(rng.choice(n, samples, replace=False))
            q = q[:, mx.array(idx)]
        filters.append(reference.estimate_filter_from_queries(q[None], n_kv))
    return gather_heads(mx.stack(filters), model)  # a tensor-parallel rank: every rank's heads


def save_filters(path: str, filters: mx.array, model, windows=None, **info) -> None:
    """Write ``filters [n_layers, n_kv_heads, head_dim]`` with metadata (see module doc).

    ``windows``: optional ``(arrays, metadata)`` of per-head recent windows
    (:func:`qfilters_mlx.filters.windows.window_tensors`), stored alongside.
    ``info`` adds string metadata (e.g. ``calibration_text``, ``calibration_tokens``).
    On a tensor-parallel model ``filters`` are the whole model's (as
    :func:`calibrate_filters` returns them), every rank must call this (the identity
    gathers sampled weights from the ranks) and rank 0 writes the file.
    """
    check_filters_shape(filters, model)
    n_layers, n_kv, hd = filters_dims(model)
    fields = identity_fields(model)
    meta = {
        "format": FORMAT, "model_id": identity_of_fields(fields),
        "model_fields": json.dumps(fields, sort_keys=True), "n_layers": str(n_layers),
        "n_kv_heads": str(n_kv), "head_dim": str(hd), "sign_convention": SIGN_CONVENTION,
        "qfilters_mlx_version": __version__,
    }
    meta.update({k: str(v) for k, v in info.items()})
    arrays = {"filters": filters.astype(mx.float32)}
    if windows is not None:
        extra, extra_meta = windows
        arrays.update({k: mx.array(v) for k, v in extra.items()})
        meta.update(extra_meta)
    if rank_of(model)[0] != 0:
        return
    mx.save_safetensors(path, arrays, meta)


def load_filters(path: str, model=None) -> tuple[mx.array, dict]:
    """Read a filters file; with ``model``, check its identity and shapes.

    Returns:
        ``(filters [n_layers, n_kv_heads, head_dim] float32, metadata)``.

    Raises:
        ValueError: not a filters file, unknown sign convention, or (with
            ``model``) a different model or mismatched shape.
    """
    arrays, meta = mx.load(path, return_metadata=True)
    if meta.get("format") != FORMAT or "filters" not in arrays:
        raise ValueError(f"{path} is not a qfilters-mlx filters file (format {meta.get('format')!r})")
    if meta.get("sign_convention") != SIGN_CONVENTION:
        raise ValueError(f"{path}: unsupported sign convention {meta.get('sign_convention')!r}")
    filters = arrays["filters"].astype(mx.float32)
    if model is not None:
        _check_identity(path, meta, filters, model)
    return filters, meta


def _check_identity(path: str, meta: dict, filters: mx.array, model) -> None:
    """Raise unless the file was calibrated for ``model`` (see :mod:`qfilters_mlx.identity`).

    Files written by 0.1 carry only a hash of the installed mlx-lm's parsed
    ``ModelArgs`` (no ``model_fields``), which cannot be recomputed reliably:
    they are accepted when their shapes fit, with a warning.
    """
    if "model_fields" not in meta:
        check_filters_shape(filters, model)
        warnings.warn(f"{path} was written by qfilters-mlx 0.1 (model_id {meta.get('model_id')} "
                      "hashes mlx-lm's parsed ModelArgs and cannot be checked): its shapes fit "
                      "this model, its identity is not verified; re-save it with save_filters "
                      "to record the model's identity", UserWarning, stacklevel=3)
        return
    try:
        stored = json.loads(meta["model_fields"])
    except ValueError as err:
        raise ValueError(f"{path}: unreadable model_fields metadata ({err})") from err
    diff = identity_mismatch(stored, model)
    if diff:
        raise ValueError(f"{path} was calibrated for another model (model_id {meta.get('model_id')}); "
                         f"differing fields: {'; '.join(diff)}")
    check_filters_shape(filters, model)


def convert_paper_filters(src: str, dst: str, model, **info) -> mx.array:
    """Convert filters released with the paper's reference code.

    Those are a ``[n_layers, n_kv_heads, head_dim]`` tensor (the only tensor in
    a safetensors file, or a ``.npy`` array) scored as ``-(k . f)``; ours are
    scored as ``+(k . f)``, so the conversion negates them. Writes ``dst`` in
    this package's format and returns the converted filters.

    Raises:
        ValueError: the source holds more than one tensor or has the wrong shape.
    """
    if src.endswith(".npy"):
        f = mx.array(np.load(src))
    else:
        arrays = mx.load(src)
        if len(arrays) != 1:
            raise ValueError(f"{src}: expected one tensor, found {sorted(arrays)}")
        f = next(iter(arrays.values()))
    f = -f.astype(mx.float32)
    info.setdefault("converted_from", f"{src} ({PAPER_SIGN_CONVENTION})")
    save_filters(dst, f, model, **info)
    return f
