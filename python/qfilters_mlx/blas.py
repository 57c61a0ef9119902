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

This module is the one owner of BLAS setup: scripts call :func:`enable_fast_blas`
before importing mlx; the command line calls :func:`ensure_fast_blas`, which can
also re-execute a program whose process already imported mlx.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import warnings
from pathlib import Path

__all__ = ["OPENBLAS_CANDIDATES", "NO_FAST_BLAS_ENV", "describe", "enable_fast_blas",
           "ensure_fast_blas", "openblas_mapped"]

NO_FAST_BLAS_ENV = "QFILTERS_MLX_NO_FAST_BLAS"
"""Set (to anything) to make :func:`ensure_fast_blas` do nothing."""

_REEXEC_ENV = "QFILTERS_MLX_BLAS_REEXEC"

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


def openblas_mapped() -> str | None:
    """Path of one of :data:`OPENBLAS_CANDIDATES`' libraries if it is mapped into
    this process (Linux, read from ``/proc/self/maps``), else ``None``.

    Only the Debian OpenBLAS folders count: numpy's own bundled OpenBLAS
    (``libscipy_openblas*``) is mapped too but MLX does not use it.
    """
    folders = tuple(os.path.dirname(p) + "/" for p in OPENBLAS_CANDIDATES)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if path.startswith(folders):
                    return path
    except OSError:
        pass
    return None


def ensure_fast_blas(reexec_module: str | None = None) -> str | None:
    """Make MLX use OpenBLAS if possible; returns the library in use or ``None``.

    Before ``mlx.core`` is imported this is :func:`enable_fast_blas`. Afterwards
    the library can only come from a new process: with ``reexec_module`` (a
    module name run as ``python -m reexec_module``) the program re-executes
    itself once with ``LD_PRELOAD`` naming the library and the same
    ``sys.argv[1:]`` (never returns then). Does nothing off Linux or when
    ``QFILTERS_MLX_NO_FAST_BLAS`` is set.
    """
    if not sys.platform.startswith("linux") or os.environ.get(NO_FAST_BLAS_ENV):
        return None
    if "mlx.core" not in sys.modules:
        return enable_fast_blas()
    mapped = openblas_mapped()
    if mapped or reexec_module is None or os.environ.get(_REEXEC_ENV):
        return mapped
    library = next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)
    if library is None:
        return None
    env = dict(os.environ)
    env[_REEXEC_ENV] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    package_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", reexec_module, *sys.argv[1:]], env)
    return None  # not reached


def describe(library: str | None) -> str:
    """One line naming the BLAS MLX uses, for summaries (``library`` from the functions above)."""
    if library:
        return library
    if sys.platform.startswith("linux"):
        return "MLX's bundled BLAS (slow float32 matmul; install libopenblas0-pthread)"
    return "platform default"
