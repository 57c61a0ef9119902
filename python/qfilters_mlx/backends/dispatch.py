"""One dispatch point for the eviction hot path.

A *backend* provides these operations with the exact semantics of
:mod:`qfilters_mlx.backends.reference` (same tie-break, same dtypes):

* ``projection_scores(keys [B,H,T,D], filters [H,D] f32, sign) -> [B,H,T] f32``
* ``select_compact(scores [B,H,T] f32, keys, values, budget, n_sink, recent)
  -> (kept [B,H,K] int32 ascending, keys [B,H,K,D], values [B,H,K,Dv])`` with
  ``K = min(budget, T)``.
* ``decode_select(scores, positions, new_scores, free, position, n_sink, recent)
  -> (scores, positions, victim)``: the bookkeeping of one decode step of the
  slot cache (see :func:`qfilters_mlx.backends.reference.decode_select`), and
  ``write_slot(buf, rows, free)``: the new K/V row into the free slot; each one
  primitive in the cpp backend (write_slot reuses the buffer in place), the
  reference elsewhere.
* ``decode_select_keys(scores, positions, new_keys, filters, free, position,
  sign, n_sink, recent)``: ``decode_select`` of the Q-Filters score of
  ``new_keys [B,H,1,D]`` (one fused primitive in the cpp backend).

``recent`` is one int (every head) or a sequence of ``H`` ints, one window per KV
head (:mod:`qfilters_mlx.backends.windows`); every backend checks it and applies
head ``h``'s window to row ``[b, h]``.

Backends: ``"reference"`` (pure MLX, always available), ``"cpp"`` (the compiled
extension ``qfilters_mlx._ext``), ``"metal"`` (Metal kernels). ``"auto"`` picks
metal when the default device is a Metal GPU, else cpp when the extension
imports, else reference. Importing this module compiles and loads nothing; a
backend is resolved only when :func:`get_backend` is called.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.backends import reference
from qfilters_mlx.backends.base import Backend

BACKENDS = ("auto", "reference", "cpp", "metal")


def _reference_select_compact(scores, keys, values, budget, n_sink, recent):
    kept = reference.select_keep(scores, budget, n_sink, recent)
    k, v = reference.compact(keys, values, kept)
    return kept, k, v


REFERENCE = Backend("reference", reference.projection_scores, _reference_select_compact)


def _cpp_backend() -> Backend | None:
    try:
        from qfilters_mlx import _ext
    except ImportError:
        return None
    return Backend("cpp", _ext.projection_scores, _ext.select_compact, _ext.decode_select,
                   _ext.write_slot, _ext.decode_select_keys)


def _metal_available() -> bool:
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def _metal_backend() -> Backend:
    """Metal kernels: the metallib built with the extension when installed,
    else the same kernel source through ``mx.fast.metal_kernel`` (see
    :mod:`qfilters_mlx.backends.metal`). Raises ValueError without Metal."""
    from qfilters_mlx.backends.metal import metal_backend

    return metal_backend("auto")


def get_backend(name: str = "auto") -> Backend:
    """Resolve a backend by name.

    Raises:
        ValueError: unknown name, or the requested backend is not available here
            (the message names what is missing).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference":
        return REFERENCE
    if name == "metal" or (name == "auto" and _metal_available()):
        return _metal_backend()
    cpp = _cpp_backend()
    if name == "cpp":
        if cpp is None:
            raise ValueError(
                "backend='cpp' is not available: the compiled extension qfilters_mlx._ext "
                "is not installed (reinstall the package with `pip install .`)"
            )
        return cpp
    return cpp if cpp is not None else REFERENCE
