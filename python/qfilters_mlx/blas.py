"""Fast float32 BLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel for Linux links a bundled reference BLAS
(``mlx_cpu.libs/libblas-*.so``), which runs float32 matrix products at a few
GFLOP/s. Debian's ``libopenblas0-pthread`` package installs an optimised BLAS
with the same ``cblas_*`` symbols. If that library is loaded into the global
symbol scope *before* ``mlx.core`` is imported, the dynamic linker resolves
MLX's BLAS calls to OpenBLAS instead of the bundled copy.

Measured on a 2-core x86-64 machine (float32 1024x1024 matmul, mlx 0.32.4,
fresh process each): bundled BLAS ~720 ms; ``enable_fast_blas()`` before
``import mlx.core`` ~16 ms; ``LD_PRELOAD`` ~17 ms; loading it *after*
``import mlx.core`` ~640 ms (no effect: MLX's symbols are already bound).

Only float32 goes through BLAS: float16, bfloat16 and quantized matmuls use
MLX's own kernels, which is why the converted model is kept in float32.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import warnings

__all__ = ["OPENBLAS_CANDIDATES", "enable_fast_blas"]

_MULTIARCH = f"{platform.machine()}-linux-gnu"

#: Debian/Ubuntu paths of OpenBLAS's reference-BLAS-compatible library, tried in order.
OPENBLAS_CANDIDATES = (
    f"/usr/lib/{_MULTIARCH}/openblas-pthread/libblas.so.3",
    f"/usr/lib/{_MULTIARCH}/openblas-openmp/libblas.so.3",
    f"/usr/lib/{_MULTIARCH}/openblas-serial/libblas.so.3",
)

_loaded: str | None = None


def enable_fast_blas(path: str | None = None) -> str | None:
    """Load OpenBLAS globally so MLX's float32 CPU matmuls use it.

    Must run before the first ``import mlx.core`` in the process; afterwards
    it does nothing (loading then does not rebind MLX's BLAS symbols) and
    emits a ``RuntimeWarning``.

    Args:
        path: a specific ``libblas.so.3`` to load; by default the first of
            :data:`OPENBLAS_CANDIDATES` that exists (Debian package
            ``libopenblas0-pthread``).

    Returns:
        The path of the library loaded (by this call, an earlier one, or
        ``LD_PRELOAD`` naming an OpenBLAS library), or
        ``None`` when nothing was loaded: not Linux, disabled with
        ``QFILTERS_MLX_FAST_BLAS=0``, no library found, ``mlx.core`` already
        imported, or the load failed. Never raises.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        if not sys.platform.startswith("linux"):
            return None
        switch = os.environ.get("QFILTERS_MLX_FAST_BLAS", "1").strip().lower()
        if switch in ("0", "false", "no", "off"):
            return None
        preloaded = [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
                     if "openblas" in p]
        if preloaded:  # LD_PRELOAD works as well as loading before mlx
            _loaded = preloaded[0]
            return _loaded
        if "mlx.core" in sys.modules:
            warnings.warn(
                "enable_fast_blas() called after mlx.core was imported; "
                "MLX keeps its bundled BLAS. Call it before importing mlx.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        candidates = (path,) if path else OPENBLAS_CANDIDATES
        for candidate in candidates:
            if os.path.exists(candidate):
                ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
                _loaded = candidate
                return candidate
    except Exception:  # never let an optional speed-up break the caller
        return None
    return None
