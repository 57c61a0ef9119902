"""The Metal backend on a real Metal GPU (both entry points: the JIT path
through ``mx.fast.metal_kernel`` and the metallib loaded by the extension's
``eval_gpu``) against the pure-MLX reference; plus the backend-selection rules
that hold everywhere (nothing compiles at import, ``auto`` follows the default
device, ``metal`` without Metal raises at construction).

The GPU tests skip where Metal is absent (Linux CI runs the same kernel code
under emulation: ``tests/backends/test_metal_emulated.py``). On the macOS workflow
``QFILTERS_EXPECT_METALLIB=1`` turns a missing metallib into a failure.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from helpers.kernel_inputs import TIE_BREAK_CASES, TIE_BREAK_SCORES, score_array
from qfilters_mlx.backends import reference
from qfilters_mlx.backends import dispatch as kernels

HAS_METAL = mx.metal.is_available()
needs_metal = pytest.mark.skipif(not HAS_METAL, reason="no Metal GPU")

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DTYPE_IDS = ("float32", "float16", "bfloat16")
LENGTHS = (1, 31, 32, 33, 255, 256, 257, 511, 512, 513, 1025, 4097)
HEADS = (1, 8)
HEAD_DIMS = (64, 80, 128)
SCORE_RTOL = {mx.float32: 4e-6, mx.float16: 4e-6, mx.bfloat16: 4e-6}
POISON = 48879.0  # 0xBEEF: fills every output before the JIT kernels run


# --------------------------------------------------------------------------
# Backend selection (runs everywhere)
# --------------------------------------------------------------------------


def test_import_compiles_nothing():
    code = (
        "import mlx.core as mx\n"
        "def boom(*a, **k): raise SystemExit('metal_kernel called at import')\n"
        "mx.fast.metal_kernel = boom\n"
        "import qfilters_mlx, qfilters_mlx.backends.dispatch, qfilters_mlx.backends.metal\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.skipif(HAS_METAL, reason="Metal is available here")
def test_metal_backend_without_metal_raises():
    from qfilters_mlx.backends import metal as metal_kernels

    with pytest.raises(ValueError, match="metal"):
        kernels.get_backend("metal")
    for path in ("auto", "jit", "metallib"):
        with pytest.raises(ValueError, match="metal"):
            metal_kernels.metal_backend(path)
    assert kernels.get_backend("auto").name in ("cpp", "reference")


def test_auto_uses_cpu_path_when_default_device_is_cpu():
    old = mx.default_device()
    try:
        mx.set_default_device(mx.cpu)
        assert kernels.get_backend("auto").name in ("cpp", "reference")
    finally:
        mx.set_default_device(old)


@needs_metal
def test_auto_uses_metal_when_default_device_is_gpu():
    old = mx.default_device()
    try:
        mx.set_default_device(mx.gpu)
        assert kernels.get_backend("auto").name == "metal"
    finally:
        mx.set_default_device(old)


@pytest.mark.skipif(os.environ.get("QFILTERS_EXPECT_METALLIB") != "1",
                    reason="only where the build must have produced the metallib")
def test_metallib_is_installed():
    from qfilters_mlx import _ext

    path = _ext.metal_library_path()
    assert path is not None and path.endswith("qfilters.metallib")


# --------------------------------------------------------------------------
# Native equivalence
# --------------------------------------------------------------------------


def _paths():
    out = [pytest.param("jit", id="jit")]
    out.append(pytest.param("metallib", id="metallib"))
    return out


@pytest.fixture(params=_paths())
def metal(request):
    """(backend, poisoned) for one entry point."""
    if not HAS_METAL:
        pytest.skip("no Metal GPU")
    from qfilters_mlx.backends import metal as metal_kernels

    if request.param == "jit":
        jit = metal_kernels.JitKernels(poison=POISON)
        return kernels.Backend("metal", jit.projection_scores, jit.select_compact)
    try:
        return metal_kernels.metal_backend("metallib")
    except ValueError as err:
        if os.environ.get("QFILTERS_EXPECT_METALLIB") == "1":
            raise
        pytest.skip(str(err))


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([20250313, *key])


def _layout(x: np.ndarray, kind: str, dtype: mx.Dtype) -> mx.array:
    """``x`` as an mx array with the named memory layout (read in place)."""
    if kind == "contiguous":
        return mx.array(x).astype(dtype)
    if kind == "swapaxes":
        return mx.array(np.ascontiguousarray(x.swapaxes(1, 2))).astype(dtype).swapaxes(1, 2)
    if kind == "strided_t":
        big = np.zeros(x.shape[:2] + (2 * x.shape[2],) + x.shape[3:], x.dtype)
        big[:, :, 1::2] = x
        return mx.array(big).astype(dtype)[:, :, 1::2]
    if kind == "strided_d":
        big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        big[..., ::2] = x
        return mx.array(big).astype(dtype)[..., ::2]
    if kind == "reversed":
        return mx.array(np.ascontiguousarray(x[:, ::-1, ::-1])).astype(dtype)[:, ::-1, ::-1]
    raise ValueError(kind)


LAYOUTS = ("contiguous", "swapaxes", "strided_t", "strided_d", "reversed")


def _bits(x: mx.array) -> np.ndarray:
    u = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.dtype.size]
    return np.array(mx.contiguous(x, stream=mx.cpu).view(u))


@needs_metal
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_projection_scores_native(metal, dtype):
    for i, (T, H, D) in enumerate(itertools.product(LENGTHS, HEADS, HEAD_DIMS)):
        B = 1 + i % 2
        rng = _rng(1, T, H, D, DTYPES.index(dtype))
        layout = LAYOUTS[i % len(LAYOUTS)]
        sign = (1, -1)[i % 2]
        keys = _layout((rng.standard_normal((B, H, T, D)) * 3).astype(np.float32), layout, dtype)
        filters = mx.array(rng.standard_normal((H, D)).astype(np.float32))
        got = metal.projection_scores(keys, filters, sign)
        assert got.shape == (B, H, T) and got.dtype == mx.float32
        k = np.array(keys.astype(mx.float32), np.float64)
        prod = k * np.array(filters, np.float64)[None, :, None, :]
        exact = sign * prod.sum(-1)
        scale = np.maximum(np.abs(prod).sum(-1), np.finfo(np.float32).tiny)
        err = (np.abs(np.array(got, np.float64) - exact) / scale).max()
        ref = np.array(reference.projection_scores(keys, filters, sign), np.float64)
        err_ref = (np.abs(ref - exact) / scale).max()
        ctx = f"T={T} H={H} D={D} B={B} {layout}"
        assert err <= SCORE_RTOL[dtype], (ctx, err)
        assert err <= 2 * err_ref + SCORE_RTOL[dtype], (ctx, err, err_ref)


@needs_metal
def test_float16_beyond_range_native(metal):
    keys = mx.full((1, 2, 5, 128), 1000.0, dtype=mx.float16)
    got = np.array(metal.projection_scores(keys, mx.ones((2, 128)), -1))
    np.testing.assert_array_equal(got, np.full((1, 2, 5), -128000.0, np.float32))


def _scores(rng, shape, mode):
    return score_array(rng, shape, mode)


@needs_metal
@pytest.mark.parametrize("T", LENGTHS)
def test_select_compact_native(metal, T):
    modes = ("random", "ties", "const")
    for i, (B, H) in enumerate(itertools.product((1, 2), HEADS)):
        rng = _rng(3, T, B, H)
        dtype, vdtype = DTYPES[i % 3], DTYPES[(i + 1) % 3]
        Dk, Dv = HEAD_DIMS[i % 3], HEAD_DIMS[(i + 1) % 3]
        keys = _layout(rng.standard_normal((B, H, T, Dk)).astype(np.float32), LAYOUTS[i % 5], dtype)
        vals_np = rng.standard_normal((B, H, T, Dv)).astype(np.float32)
        vals_np[rng.random(vals_np.shape) < 0.01] = np.nan
        values = _layout(vals_np, LAYOUTS[(i + 2) % 5], vdtype)
        budgets = sorted({1, max(1, T // 4), max(1, T - 1)} - {T}) + [T, T + 5]
        for j, budget in enumerate(b for b in budgets if b >= 1):
            cands = [(0, 0), (min(4, budget), 0), (0, min(16, budget)),
                     (budget // 3, budget // 3), (0, budget)]
            for n_sink, recent in sorted({c for c in cands if c[0] + c[1] <= budget}):
                mode = modes[(i + j + n_sink + recent) % 3]
                scores = _layout(_scores(rng, (B, H, T), mode)[..., None], LAYOUTS[j % 5],
                                 mx.float32)[..., 0]
                kept, k, v = metal.select_compact(scores, keys, values, budget, n_sink, recent)
                K = min(budget, T)
                ctx = f"B={B} H={H} budget={budget} sink={n_sink} recent={recent} mode={mode}"
                assert kept.shape == (B, H, K) and kept.dtype == mx.int32, ctx
                assert k.shape == (B, H, K, Dk) and k.dtype == dtype, ctx
                assert v.shape == (B, H, K, Dv) and v.dtype == vdtype, ctx
                ref = reference.select_keep(scores, budget, n_sink, recent)
                np.testing.assert_array_equal(np.array(kept), np.array(ref), err_msg=ctx)
                rk, rv = reference.compact(keys, values, ref)
                np.testing.assert_array_equal(_bits(k), _bits(rk), err_msg=ctx)
                np.testing.assert_array_equal(_bits(v), _bits(rv), err_msg=ctx)


@needs_metal
def test_tie_break_and_special_values_native(metal):
    s = mx.array(TIE_BREAK_SCORES.reshape(1, 1, 8))
    keys = mx.array(np.arange(8, dtype=np.float32).reshape(1, 1, 8, 1))
    for (budget, n_sink, recent), want in TIE_BREAK_CASES.items():
        kept, k, _ = metal.select_compact(s, keys, keys, budget, n_sink, recent)
        assert np.array(kept)[0, 0].tolist() == want
        assert np.array(k)[0, 0, :, 0].tolist() == want


@needs_metal
def test_empty_and_lazy_composition_native(metal):
    kept, k, v = metal.select_compact(mx.zeros((2, 3, 0)), mx.zeros((2, 3, 0, 4)),
                                      mx.zeros((2, 3, 0, 5)), 4)
    assert kept.shape == (2, 3, 0) and k.shape == (2, 3, 0, 4) and v.shape == (2, 3, 0, 5)
    rng = _rng(4)
    keys = mx.array(rng.standard_normal((1, 2, 50, 64)).astype(np.float32))
    filters = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    kept, k, v = metal.select_compact(metal.projection_scores(keys, filters, 1), keys, keys + 1, 10, 2, 3)
    ref = reference.select_keep(reference.projection_scores(keys, filters, 1), 10, 2, 3)
    np.testing.assert_array_equal(np.array(kept), np.array(ref))
    np.testing.assert_array_equal(np.array(v), np.array(k) + 1)
