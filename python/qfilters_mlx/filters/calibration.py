"""Offline Q-Filters from post-RoPE queries, and the filter file format.

The paper's estimator (Godey et al. 2025, arXiv:2503.02812, Sec. 3): run the
model over calibration text, collect post-RoPE query vectors of every attention
layer and query head, take the top right-singular vector of an uncentred sample
per query head, orient it so that the queries project positively on average,
average over each GQA group and renormalise. Result: ``[n_layers, n_kv_heads,
head_dim]`` float32, used as ``score = +<k, f>``.

File format (safetensors): one tensor ``"filters"`` and string metadata
``format``, ``model_id`` (hash of the model's config), ``n_layers``,
``n_kv_heads``, ``head_dim``, ``sign_convention`` (``"score = +(k . f)"``),
``calibration_text``, ``calibration_tokens``, ``samples_per_head``,
``qfilters_mlx_version``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from qfilters_mlx import __version__
from qfilters_mlx.backends import reference
from qfilters_mlx.filters.capture import QueriesNotCaptured, capture_attention, describe_layers
from qfilters_mlx.model_info import check_filters_shape, model_dims, model_identity

FORMAT = "qfilters-mlx/filters-v1"
SIGN_CONVENTION = "score = +(k . f)"
PAPER_SIGN_CONVENTION = "score = -(k . f)"


def calibrate_filters(model, token_chunks, samples: int = 4096, seed: int = 0) -> mx.array:
    """Estimate query-derived filters for every layer.

    Args:
        model: an mlx-lm model whose layers all cache per-head keys.
        token_chunks: iterable of 1-D token sequences; each is run as one
            independent forward pass (fresh caches of the model's own kind,
            ``make_prompt_cache``), so RoPE positions restart.
        samples: at most this many query rows per query head (uniform sample of
            all tokens seen, seeded).
        seed: sampling seed.

    Returns:
        ``[n_layers, n_kv_heads, head_dim]`` float32 unit vectors.

    Raises:
        ValueError: ``samples < 1``, no tokens, or the model's cache list does
            not have one entry per layer.
        QueriesNotCaptured: some layers delivered no queries (named, with the
            function computing their attention); nothing is returned.
    """
    from mlx_lm.models.cache import make_prompt_cache

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    n_layers, n_kv, _ = model_dims(model)
    per_layer: list[list[mx.array]] = [[] for _ in range(n_layers)]
    missing: dict[int, str] = {}

    def grab(layer, queries, _keys):
        per_layer[layer].append(queries[0].astype(mx.float32))  # [H_q, L, D]

    seen = 0
    for chunk in token_chunks:
        caches = make_prompt_cache(model)
        if len(caches) != n_layers:
            raise ValueError(f"the model's cache list has {len(caches)} entries for {n_layers} layers: "
                             "calibration needs one attention cache per layer")
        with capture_attention(model, grab, caches=caches, on_missing=missing.setdefault):
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
    return mx.stack(filters)


def save_filters(path: str, filters: mx.array, model, **info) -> None:
    """Write ``filters [n_layers, n_kv_heads, head_dim]`` with metadata (see module doc).

    ``info`` adds string metadata (e.g. ``calibration_text``, ``calibration_tokens``).
    """
    check_filters_shape(filters, model)
    n_layers, n_kv, hd = model_dims(model)
    meta = {
        "format": FORMAT, "model_id": model_identity(model), "n_layers": str(n_layers),
        "n_kv_heads": str(n_kv), "head_dim": str(hd), "sign_convention": SIGN_CONVENTION,
        "qfilters_mlx_version": __version__,
    }
    meta.update({k: str(v) for k, v in info.items()})
    mx.save_safetensors(path, {"filters": filters.astype(mx.float32)}, meta)


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
        mid = model_identity(model)
        if meta.get("model_id") != mid:
            raise ValueError(f"{path} was calibrated for model {meta.get('model_id')}, "
                             f"not this model ({mid})")
        check_filters_shape(filters, model)
    return filters, meta


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
