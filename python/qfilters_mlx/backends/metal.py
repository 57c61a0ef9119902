"""Metal kernels: the JIT entry point (``mx.fast.metal_kernel``) and the
launch geometry shared with the metallib path and the Linux emulation.

The kernel code lives in ``metal/qfilters.h`` (templates and the
``QF_*_BODY`` kernel bodies); it is shipped inside the package as
``qfilters_mlx/metal/`` (a source checkout reads the repository's ``metal/``).
Two entry points run the same code:

* **metallib**: ``metal/qfilters.metal`` is compiled by ``mlx_build_metallib``
  when the package is built against an MLX with Metal (macOS); the C++
  primitives' ``eval_gpu`` load ``qfilters.metallib`` from next to
  ``qfilters_mlx/_ext`` and dispatch it (``_ext.projection_scores(...,
  stream=mx.gpu)``).
* **jit**: this module passes ``qfilters.h`` as the ``header`` and one
  ``QF_*_BODY(...)`` line as the ``source`` of ``mx.fast.metal_kernel``; MLX
  writes the signature and compiles on first use (then caches).

:func:`metal_backend` with ``path="auto"`` (what ``get_backend("metal")``
uses) takes the metallib when the compiled extension was built with Metal and
its ``qfilters.metallib`` is installed, else the JIT path: a package built
without the Metal toolchain, or a source checkout, still runs on the GPU.

Nothing here compiles, loads or reads a file at import; kernels are created
when a backend is constructed and compiled by MLX when first evaluated.
Non-contiguous inputs are read in place through their strides (no copies);
kept rows are copied as unsigned integers of the element size (bit-exact).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import mlx.core as mx

from qfilters_mlx.backends.windows import recent_windows

__all__ = [
    "SIMD",
    "score_launch",
    "select_launch",
    "gather_launch",
    "metal_source_dir",
    "metal_backend",
    "JitKernels",
]

# Must match metal/qfilters.h and csrc/qfilters.cpp (eval_gpu).
SIMD = 32
SCORE_TG = 256  # 8 SIMD groups: 8 key rows per threadgroup per step
GATHER_TG = 256
SELECT_MAX_TG = 512  # <= QF_SELECT_MAX_TG (1024) in qfilters.h
MAX_SCORE_GROUPS = 2048  # grid-stride beyond this
MAX_GATHER_GROUPS = 4096
MAX_INDEX = 2**31 - 1  # kernels index elements with 32-bit integers

_STORAGE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_LOADERS = {mx.float32: "qf_f32", mx.float16: "qf_f16", mx.bfloat16: "qf_bf16"}
_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


# --------------------------------------------------------------------------
# Launch geometry (grid counts THREADS, as mx.fast.metal_kernel and
# dispatchThreads expect; always whole threadgroups).
# --------------------------------------------------------------------------


def score_launch(B: int, H: int, T: int) -> tuple[int, int]:
    """``(grid_threads, threadgroup)`` of the scoring kernel: one SIMD group
    per key row, up to ``MAX_SCORE_GROUPS`` threadgroups (grid-stride)."""
    rows = B * H * T
    groups = max(1, min(math.ceil(rows / (SCORE_TG // SIMD)), MAX_SCORE_GROUPS))
    return groups * SCORE_TG, SCORE_TG


def select_launch(B: int, H: int, T: int) -> tuple[int, int]:
    """One threadgroup per (batch, head) row, ``T`` rounded up to whole SIMD
    groups and capped at ``SELECT_MAX_TG`` threads (rows longer than that are
    processed in chunks)."""
    tg = min(SELECT_MAX_TG, max(SIMD, math.ceil(T / SIMD) * SIMD))
    return tg * B * H, tg


def gather_launch(B: int, H: int, K: int, D: int) -> tuple[int, int]:
    """One element per thread, up to ``MAX_GATHER_GROUPS`` threadgroups."""
    total = B * H * K * D
    groups = max(1, min(math.ceil(total / GATHER_TG), MAX_GATHER_GROUPS))
    return groups * GATHER_TG, GATHER_TG


# --------------------------------------------------------------------------
# Kernel sources
# --------------------------------------------------------------------------


def metal_source_dir() -> Path:
    """Folder holding ``qfilters.h``: the installed package's ``metal/``, or
    the repository's ``metal/`` in a source checkout."""
    package = Path(__file__).resolve().parent.parent  # qfilters_mlx/
    for cand in (package / "metal", package.parent.parent / "metal"):
        if (cand / "qfilters.h").is_file():
            return cand
    raise FileNotFoundError(
        "metal/qfilters.h not found next to qfilters_mlx (reinstall the package)"
    )


_SCORE_SOURCE = """
    QF_SCORE_BODY({loader}, keys, keys_shape, keys_strides, filters, filters_strides,
                  params, out, threadgroup_position_in_grid, threadgroups_per_grid,
                  simdgroup_index_in_threadgroup, simdgroups_per_threadgroup,
                  thread_index_in_simdgroup);
"""

_SELECT_SOURCE = """
    QF_SELECT_BODY(scores, scores_shape, scores_strides, params, kept,
                   threadgroup_position_in_grid, thread_index_in_threadgroup,
                   threads_per_threadgroup, thread_index_in_simdgroup,
                   simdgroup_index_in_threadgroup, simdgroups_per_threadgroup);
"""

_GATHER_SOURCE = """
    QF_GATHER_BODY(src, src_shape, src_strides, kept, kept_shape, out,
                   thread_position_in_grid, threads_per_grid);
"""


# --------------------------------------------------------------------------
# Validation (same rules and messages as the compiled extension)
# --------------------------------------------------------------------------


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"[qfilters.{op}] {msg}")


def _check_score_args(keys: mx.array, filters: mx.array, sign: int) -> None:
    op = "projection_scores"
    if not isinstance(keys, mx.array) or not isinstance(filters, mx.array):
        raise TypeError(f"[qfilters.{op}] keys and filters must be mx.array")
    if keys.ndim != 4:
        _fail(op, f"keys must have 4 dimensions [B, H, T, D], got shape {tuple(keys.shape)}")
    if filters.ndim != 2:
        _fail(op, f"filters must have 2 dimensions [H, D], got shape {tuple(filters.shape)}")
    if keys.dtype not in _LOADERS:
        _fail(op, f"keys must be float32, float16 or bfloat16, got {keys.dtype}")
    if not mx.issubdtype(filters.dtype, mx.floating):
        _fail(op, f"filters must be a floating-point array, got {filters.dtype}")
    if tuple(filters.shape) != (keys.shape[1], keys.shape[3]):
        _fail(op, f"filters must have shape [H, D] = {(keys.shape[1], keys.shape[3])} "
                  f"to match keys {tuple(keys.shape)}, got {tuple(filters.shape)}")
    if isinstance(sign, bool) or sign not in (1, -1):
        _fail(op, f"sign must be +1 or -1, got {sign!r}")
    if keys.size > MAX_INDEX:
        _fail(op, f"keys has {keys.size} elements; the Metal kernels index with 32 bits")


def _check_select_args(scores, keys, values, budget, n_sink, recent) -> list[int]:
    """Checks the arguments; returns the ``H`` recent windows (``recent``: one int or ``H``)."""
    op = "select_compact"
    for name, a in (("scores", scores), ("keys", keys), ("values", values)):
        if not isinstance(a, mx.array):
            raise TypeError(f"[qfilters.{op}] {name} must be an mx.array")
    if scores.ndim != 3:
        _fail(op, f"scores must have 3 dimensions [B, H, T], got shape {tuple(scores.shape)}")
    for name, a in (("keys", keys), ("values", values)):
        if a.ndim != 4:
            _fail(op, f"{name} must have 4 dimensions [B, H, T, D], got shape {tuple(a.shape)}")
        if tuple(a.shape[:3]) != tuple(scores.shape):
            _fail(op, f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must match "
                      f"scores [B, H, T] = {tuple(scores.shape)} in their first three dimensions")
        if a.dtype.size not in _STORAGE:
            _fail(op, f"{name} dtype {a.dtype} is not supported")
        if a.size > MAX_INDEX:
            _fail(op, f"{name} has {a.size} elements; the Metal kernels index with 32 bits")
    if not mx.issubdtype(scores.dtype, mx.floating):
        _fail(op, f"scores must be a floating-point array, got {scores.dtype}")
    for name, v in (("budget", budget), ("n_sink", n_sink)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"[qfilters.{op}] {name} must be an int, got {type(v).__name__}")
    if budget < 1:
        _fail(op, f"budget must be >= 1, got {budget}")
    try:
        return recent_windows(recent, scores.shape[1], n_sink, budget, inclusive=True)
    except TypeError as e:
        raise TypeError(f"[qfilters.{op}] {e}") from None
    except ValueError as e:
        _fail(op, str(e))


# --------------------------------------------------------------------------
# JIT path
# --------------------------------------------------------------------------


class JitKernels:
    """The three kernels through ``mx.fast.metal_kernel`` (created here,
    compiled by MLX on first evaluation). ``poison`` (tests only) fills the
    outputs with that value before the kernels run, to prove every element is
    written."""

    def __init__(self, poison: float | None = None):
        header = (metal_source_dir() / "qfilters.h").read_text()
        self._poison = poison
        self._score = {
            dt: mx.fast.metal_kernel(
                name=f"qfilters_score_{_DTYPE_NAMES[dt]}",
                input_names=["keys", "filters", "params"],
                output_names=["out"],
                source=_SCORE_SOURCE.format(loader=loader),
                header=header,
                ensure_row_contiguous=False,
            )
            for dt, loader in _LOADERS.items()
        }
        self._select = mx.fast.metal_kernel(
            name="qfilters_select",
            input_names=["scores", "params"],
            output_names=["kept"],
            source=_SELECT_SOURCE,
            header=header,
            ensure_row_contiguous=False,
        )
        self._gather = {
            size: mx.fast.metal_kernel(
                name=f"qfilters_gather_uint{8 * size}",
                input_names=["src", "kept"],
                output_names=["out"],
                source=_GATHER_SOURCE,
                header=header,
                ensure_row_contiguous=False,
            )
            for size in _STORAGE
        }

    def _launch(self, kernel, inputs: list, shape: tuple, dtype, launch: tuple[int, int]) -> mx.array:
        """Run ``kernel`` on the GPU with a 1-D ``launch = (grid threads, threadgroup size)``;
        its one output has ``shape`` and ``dtype``."""
        grid, tg = launch
        (out,) = kernel(inputs=inputs, output_shapes=[shape], output_dtypes=[dtype], grid=(grid, 1, 1),
                        threadgroup=(tg, 1, 1), init_value=self._poison, stream=mx.gpu)
        return out

    def projection_scores(self, keys: mx.array, filters: mx.array, sign: int = 1) -> mx.array:
        _check_score_args(keys, filters, sign)
        B, H, T, _ = keys.shape
        if B * H * T == 0:
            return mx.zeros((B, H, T), mx.float32)
        storage = _STORAGE[keys.dtype.size]
        inputs = [keys.view(storage), filters.astype(mx.float32), mx.array([sign], dtype=mx.int32)]
        return self._launch(self._score[keys.dtype], inputs, (B, H, T), mx.float32, score_launch(B, H, T))

    def select(self, scores: mx.array, budget: int, n_sink: int, recent: list[int]) -> mx.array:
        """Kept positions ``[B, H, min(budget, T)]`` int32, ascending; ``recent``: ``H``
        windows (params ``{budget, n_sink, recent[0..H)}``, see metal/qfilters.h)."""
        B, H, T = scores.shape
        K = min(budget, T)
        inputs = [scores.astype(mx.float32), mx.array([budget, n_sink, *recent], dtype=mx.int32)]
        return self._launch(self._select, inputs, (B, H, K), mx.int32, select_launch(B, H, T))

    def gather(self, x: mx.array, kept: mx.array) -> mx.array:
        """``x[b, h, kept[b, h, k], :]`` bit-exact, ``[B, H, K, D]``."""
        B, H, _, D = x.shape
        K = kept.shape[2]
        storage = _STORAGE[x.dtype.size]
        out = self._launch(self._gather[x.dtype.size], [x.view(storage), kept], (B, H, K, D), storage,
                           gather_launch(B, H, K, D))
        return out.view(x.dtype)

    def select_compact(self, scores, keys, values, budget, n_sink=0, recent=0):
        windows = _check_select_args(scores, keys, values, budget, n_sink, recent)
        B, H, T = scores.shape
        K = min(budget, T)
        if B * H * K == 0:
            return (mx.zeros((B, H, K), mx.int32),
                    mx.zeros((B, H, K, keys.shape[3]), keys.dtype),
                    mx.zeros((B, H, K, values.shape[3]), values.dtype))
        kept = self.select(scores, budget, n_sink, windows)
        k = self.gather(keys, kept) if keys.shape[3] else mx.zeros((B, H, K, 0), keys.dtype)
        v = self.gather(values, kept) if values.shape[3] else mx.zeros((B, H, K, 0), values.dtype)
        return kept, k, v


# --------------------------------------------------------------------------
# Backend construction
# --------------------------------------------------------------------------


def _metallib_ops() -> tuple[Callable, Callable] | None:
    """The compiled extension's GPU ops when it was built with Metal and its
    metallib is installed, else None."""
    try:
        from qfilters_mlx import _ext
    except ImportError:
        return None
    find = getattr(_ext, "metal_library_path", None)
    if find is None or find() is None:
        return None

    def projection_scores(keys, filters, sign=1):
        return _ext.projection_scores(keys, filters, sign, stream=mx.gpu)

    def select_compact(scores, keys, values, budget, n_sink=0, recent=0):
        if not isinstance(recent, int):  # per head: a list for the binding
            recent = [int(r) for r in (recent.tolist() if hasattr(recent, "tolist") else recent)]
        return _ext.select_compact(scores, keys, values, budget, n_sink, recent, stream=mx.gpu)

    return projection_scores, select_compact


def metal_backend(path: str = "auto"):
    """The ``metal`` backend (a :class:`qfilters_mlx.backends.base.Backend`).

    Args:
        path: ``"auto"`` (metallib if installed, else JIT), ``"metallib"`` or
            ``"jit"``.

    Raises:
        ValueError: Metal is not available, or the requested path is not.
    """
    from qfilters_mlx.backends.base import Backend

    if path not in ("auto", "jit", "metallib"):
        raise ValueError(f"path must be 'auto', 'jit' or 'metallib', got {path!r}")
    if not mx.metal.is_available():
        raise ValueError("backend='metal' is not available: this MLX has no Metal GPU "
                         "(use backend='cpp' or 'reference')")
    if path in ("auto", "metallib"):
        ops = _metallib_ops()
        if ops is not None:
            return Backend("metal", *ops)
        if path == "metallib":
            raise ValueError("the metallib path is not available: qfilters_mlx._ext was built "
                             "without Metal or qfilters.metallib is not installed")
    jit = JitKernels()
    return Backend("metal", jit.projection_scores, jit.select_compact)
