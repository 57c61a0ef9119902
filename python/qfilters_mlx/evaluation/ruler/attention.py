"""MLX's CPU attention with its softmax computed in C, bit for bit the same.

On a CPU stream ``mx.fast.scaled_dot_product_attention`` runs MLX's fallback: ``scale * q``,
``q @ k^T``, the mask (``where(mask, s, finfo.min)``), ``softmax(precise=True)``, ``p @ v``.
MLX's CPU softmax on x86 is scalar (``Simd<float, 1>``): its ``exp`` (Cephes' polynomial through
``std::fma``) runs at about 40 M elements/s on this repository's 2-core machine, so over a 2k
context the softmax is most of the attention's time, more than the matrix products. :func:`sdpa`
runs the same operations in the same order with MLX, except the softmax: :data:`SOURCE`, the
same arithmetic (``mlx/backend/cpu/softmax.cpp`` and ``simd/math.h``: row maximum; ``exp(x - m)``
by the same polynomial with ``fmaf``; the sum accumulated left to right in float32; ``1 / sum``
times each term), compiled with contraction off so that the compiler fuses nothing else, and
vectorized over each row's elements (the row's sum stays in order). The result is the same bits
(tests/evaluation/test_ruler_attention.py compares every bit with MLX's own).

:func:`fast_attention` routes ``mx.fast.scaled_dot_product_attention`` through :func:`sdpa` for
the length of a ``with`` block where it applies (float32, CPU stream, no sinks, mask ``None``,
``"causal"`` or boolean, enough elements to pay the copies) and to MLX otherwise. The C library is
compiled on first use with the system's C compiler into a temporary folder; without one (or with
``QFILTERS_MLX_C_SOFTMAX=0``) the block changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

__all__ = ["SOURCE", "available", "fast_attention", "sdpa", "softmax"]

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
static inline float mlx_exp(float x_init) {
    float x = x_init * 1.442695f;
    float ipart = floorf(x + 0.5f);  /* MLX: floor((double)x + 0.5), equal for every x kept below */
    float fpart = x - ipart;
    x = 1.535336188319500e-4f;
    x = fmaf(x, fpart, 1.339887440266574e-3f);
    x = fmaf(x, fpart, 9.618437357674640e-3f);
    x = fmaf(x, fpart, 5.550332471162809e-2f);
    x = fmaf(x, fpart, 2.402264791363012e-1f);
    x = fmaf(x, fpart, 6.931472028550421e-1f);
    x = fmaf(x, fpart, 1.000000000000000f);
    float c = ipart < -200.0f ? -200.0f : (ipart > 200.0f ? 200.0f : ipart);
    int32_t epart = ((int32_t)c + 127) << 23;
    float p;
    memcpy(&p, &epart, 4);
    float r = p * x;
    r = x_init != x_init ? x_init : r;
    r = x_init > 88.0f ? INFINITY : r;
    r = x_init < -88.0f ? 0.0f : r;
    return r;
}
static void exp_shift(const float* restrict in, float* restrict out, long n, float m) {
    for (long j = 0; j < n; j++) out[j] = mlx_exp(in[j] - m);
}
static float row_max(const float* restrict in, long n) {
    float acc[16];
    for (int k = 0; k < 16; k++) acc[k] = -INFINITY;
    long j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) acc[k] = in[j + k] > acc[k] ? in[j + k] : acc[k];
    float m = -INFINITY;
    for (int k = 0; k < 16; k++) m = acc[k] > m ? acc[k] : m;
    for (; j < n; j++) m = in[j] > m ? in[j] : m;
    return m;
}
static void scale(float* restrict out, long n, float r) {
    for (long j = 0; j < n; j++) out[j] = out[j] * r;
}
void softmax_rows(const float* in, float* out, long rows, long n) {
    long i = 0;
    for (; i + 8 <= rows; i += 8) {  /* eight rows' sums at once: eight independent chains */
        float s[8] = {0};
        for (int r = 0; r < 8; r++) exp_shift(in + (i + r) * n, out + (i + r) * n, n, row_max(in + (i + r) * n, n));
        const float* o = out + i * n;
        for (long j = 0; j < n; j++)
            for (int r = 0; r < 8; r++) s[r] = s[r] + o[r * n + j];
        for (int r = 0; r < 8; r++) scale(out + (i + r) * n, n, 1 / s[r]);
    }
    for (; i < rows; i++) {
        exp_shift(in + i * n, out + i * n, n, row_max(in + i * n, n));
        float s = 0.0f;
        for (long j = 0; j < n; j++) s = s + out[i * n + j];
        scale(out + i * n, n, 1 / s);
    }
}
"""
"""The C softmax (module doc). ``floorf(x + 0.5f)`` equals MLX's ``floor((double)x + 0.5)`` for
``|x| <= 128`` (the sum is exact in float32 there); other ``x`` come from ``x_init`` outside
``[-88, 88]``, whose result both replace; the clamp only keeps the integer conversion defined."""

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
"""``-ffp-contract=off``: no product and sum fused other than the written ``fmaf``."""

MIN_ELEMENTS = 1 << 16
"""Smaller score matrices (decoding one token over a short cache) stay with MLX's softmax."""


@functools.lru_cache(maxsize=1)
def _library():
    if os.environ.get("QFILTERS_MLX_C_SOFTMAX", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="qfilters_softmax_"))
    src, lib = folder / "softmax.c", folder / "softmax.so"
    src.write_text(SOURCE)
    try:
        subprocess.run([cc, *FLAGS, str(src), "-o", str(lib), "-lm"], check=True, capture_output=True, timeout=120)
        fn = ctypes.CDLL(str(lib)).softmax_rows
    except (OSError, subprocess.SubprocessError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    fn.restype = None
    return fn


def available() -> bool:
    """Whether the C softmax compiled (else :func:`fast_attention` changes nothing)."""
    return _library() is not None


def softmax(scores: mx.array) -> mx.array:
    """``mx.softmax(scores, axis=-1, precise=True)`` of a float32 array, the same bits, by the C library.

    Raises:
        RuntimeError: the library is not available (:func:`available`).
    """
    fn = _library()
    if fn is None:
        raise RuntimeError("the C softmax is not available (no C compiler, or QFILTERS_MLX_C_SOFTMAX=0)")
    mx.eval(scores)
    a = np.ascontiguousarray(np.asarray(scores, dtype=np.float32))
    out = np.empty_like(a)
    n = a.shape[-1]
    fn(a.ctypes.data, out.ctypes.data, a.size // n if n else 0, n)
    return mx.array(out)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """MLX's CPU ``scaled_dot_product_attention`` fallback (``mlx/fast.cpp``), op for op, the
    softmax by :func:`softmax`. ``q [B, H_q, L, D]``, ``k, v [B, H_kv, T, D]``, ``mask``: ``None``,
    ``"causal"`` (the last ``L`` of ``T`` positions) or a boolean array broadcastable to
    ``[B, H_q, L, T]``."""
    B, Hq, L, D = q.shape
    Hk = k.shape[1]
    n = Hq // Hk
    q = mx.multiply(mx.array(scale, q.dtype), q)
    if n > 1:
        q = q.reshape(B, Hk, n, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = mx.matmul(q, mx.swapaxes(k, -1, -2))
    if mask is not None:
        if isinstance(mask, str):
            kL = k.shape[-2]
            mask = mx.expand_dims(mx.arange(kL - L, kL), 1) >= mx.expand_dims(mx.arange(0, kL), 0)
        if n > 1 and mask.ndim >= 3:
            mask = (mx.expand_dims(mask, -3) if mask.shape[-3] == 1
                    else mask.reshape(*mask.shape[:-3], Hk, n, *mask.shape[-2:]))
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    out = mx.matmul(softmax(scores), v)
    return out.reshape(B, Hq, L, out.shape[-1]) if n > 1 else out


def _applies(q, k, v, mask, sinks, stream) -> bool:
    if sinks is not None or stream is not None or mx.default_device() != mx.cpu:
        return False
    if q.ndim != 4 or k.ndim != 4 or q.shape[1] % k.shape[1] or q.shape[2] > k.shape[2]:
        return False
    if any(x.dtype != mx.float32 for x in (q, k, v)):
        return False
    if isinstance(mask, str) and mask != "causal":
        return False
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        return False
    if mask is not None and not isinstance(mask, (str, mx.array)):
        return False
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] >= MIN_ELEMENTS


@contextlib.contextmanager
def fast_attention():
    """Within the block, ``mx.fast.scaled_dot_product_attention`` calls that :func:`sdpa` covers
    (module doc) run through it; the name is restored on exit. Does nothing when the library is
    not :func:`available`."""
    if not available():
        yield
        return
    original = mx.fast.scaled_dot_product_attention

    def wrapped(q, k, v, *args, scale, mask=None, sinks=None, stream=None, **kwargs):
        if args or kwargs or not _applies(q, k, v, mask, sinks, stream):
            return original(q, k, v, *args, scale=scale, mask=mask, sinks=sinks, stream=stream, **kwargs)
        return sdpa(q, k, v, scale, mask)

    mx.fast.scaled_dot_product_attention = wrapped
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = original
