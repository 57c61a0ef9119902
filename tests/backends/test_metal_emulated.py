"""The Metal kernels of ``metal/qfilters.h``, executed on Linux by emulation,
against the pure-MLX reference.

``tests/backends/metal_emu`` compiles the kernel header as C++20 with a compatibility
layer (address spaces -> bounds-checked pointers, threadgroup arrays shared per
group, ``threadgroup_barrier``, the SIMD-group functions, threadgroup atomics)
and a launcher that runs every threadgroup's threads concurrently: as
``std::thread``s with ``std::barrier`` (mode ``threads``) or as cooperative
fibers resumed in a random order after every barrier (mode ``fibers``, used
for the bulk of the matrix because it is ~100x faster on two cores). The
kernel bodies are the very ``QF_*_BODY`` lines that ``mx.fast.metal_kernel``
and ``metal/qfilters.metal`` compile; the launch geometry is the one
``qfilters_mlx.backends.metal`` uses on a Mac (plus extra threadgroup sizes).
Not emulated: the kernel signatures and the host code that binds buffers
(covered on macOS by ``tests/backends/test_metal_native.py``).

Every output is poisoned and every output element must be written exactly
once (the emulator counts writes). Kept positions must equal the reference,
gathered keys/values must be bit-identical, scores within a per-dtype
tolerance of a float64 oracle (and at most twice the reference's own error).
Inputs are non-contiguous views read in place through their strides (offset
first element, transposed, strided, negative strides), as on the GPU.

The emulator is built with the C++ compiler found on PATH; without one the
module is skipped.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers.kernel_inputs import TIE_BREAK_CASES, TIE_BREAK_SCORES, score_array
from helpers.oracle import np_keep_rows
from qfilters_mlx.backends import reference
from qfilters_mlx.backends import metal as mk

REPO = Path(__file__).resolve().parents[2]
EMU_DIR = REPO / "tests" / "backends" / "metal_emu"
METAL_DIR = REPO / "metal"

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DTYPE_IDS = ("float32", "float16", "bfloat16")
LENGTHS = (1, 31, 32, 33, 255, 256, 257, 1025, 4097)
HEADS = (1, 8)
HEAD_DIMS = (64, 80, 128)
# Error of a score relative to sum_d |k_d u_d| against the float64 oracle: all
# dtypes are decoded exactly to float32 and accumulated in float32.
SCORE_RTOL = {mx.float32: 2e-6, mx.float16: 2e-6, mx.bfloat16: 2e-6}
LAYOUTS = ("contiguous", "offset", "swapaxes", "strided_t", "strided_d", "reversed")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="session")
def emu(tmp_path_factory) -> Path:
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH to build the Metal emulator")
    out = tmp_path_factory.mktemp("metal_emu") / "emu"
    # -U_FORTIFY_SOURCE: the fibers switch stacks with _longjmp, which the
    # fortified longjmp check would reject.
    cmd = [cxx, "-std=c++20", "-O2", "-pthread", "-U_FORTIFY_SOURCE", f"-I{REPO}", f"-I{EMU_DIR}",
           str(EMU_DIR / "emu_main.cpp"), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"emulator build failed:\n{' '.join(cmd)}\n{res.stderr}"
    return out


class Emu:
    """Collects cases into one manifest, runs the emulator once, reads outputs."""

    def __init__(self, binary: Path, workdir: Path):
        self.binary, self.dir = binary, workdir
        self.lines: list[str] = []
        self.n = 0
        self._cache: dict[int, tuple[np.ndarray, list[str]]] = {}

    def _file(self, arr: np.ndarray) -> str:
        self.n += 1
        p = self.dir / f"a{self.n}.bin"
        np.ascontiguousarray(arr).tofile(p)
        return str(p)

    def _array(self, name: str, view: np.ndarray) -> list[str]:
        """A numpy view (any strides) as base buffer + offset + strides (each
        distinct view is written once)."""
        if id(view) not in self._cache:  # keep the view alive: ids stay unique
            self._cache[id(view)] = (view, self._array_toks(view))
        return [name + t[1:] for t in self._cache[id(view)][1]]

    def _array_toks(self, view: np.ndarray) -> list[str]:
        name = "@"
        base = view
        while base.base is not None and isinstance(base.base, np.ndarray):
            base = base.base
        if not base.flags.c_contiguous:  # e.g. an array numpy made Fortran-ordered
            view = base = np.ascontiguousarray(view)
        isz = view.itemsize
        off_bytes = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        assert off_bytes % isz == 0 and all(s % isz == 0 for s in view.strides)
        flat = base.reshape(-1).view(view.dtype)
        return [f"{name}={self._file(flat)}", f"{name}_off={off_bytes // isz}",
                f"{name}_len={flat.size}",
                f"{name}_shape={','.join(map(str, view.shape))}",
                f"{name}_strides={','.join(str(s // isz) for s in view.strides)}"]

    def add(self, op: str, outputs: dict[str, tuple[int, np.dtype]], arrays: dict[str, np.ndarray],
            **kv) -> dict[str, Path]:
        cid = f"c{len(self.lines)}"
        toks = [op, f"id={cid}"]
        for name, view in arrays.items():
            toks += self._array(name, view)
        paths = {}
        for name, (length, dtype) in outputs.items():
            self.n += 1
            paths[name] = (self.dir / f"o{self.n}.bin", length, dtype)
            toks += [f"{name}={paths[name][0]}", f"{name}_len={length}"]
        toks += [f"{k}={v}" for k, v in kv.items()]
        self.lines.append(" ".join(toks))
        return paths

    def run(self, timeout: float = 600) -> None:
        manifest = self.dir / "manifest.txt"
        manifest.write_text("\n".join(self.lines) + "\n")
        res = subprocess.run([str(self.binary), str(manifest)], capture_output=True,
                             text=True, timeout=timeout)
        assert res.returncode == 0, f"emulator failed:\n{res.stderr[-4000:]}"
        assert res.stdout.count("ok ") == len(self.lines)

    @staticmethod
    def read(path) -> np.ndarray:
        p, length, dtype = path
        a = np.fromfile(p, dtype=dtype)
        assert a.size == length
        return a


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([20250312, *key])


def _storage(x: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """float32 numpy -> raw element storage of ``dtype`` (numpy unsigned ints)."""
    u = {2: mx.uint16, 4: mx.uint32}[dtype.size]
    return np.array(mx.array(x).astype(dtype).view(u))


def _to_mx(storage: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(np.ascontiguousarray(storage)).view(dtype)


def _layout(x: np.ndarray, kind: str) -> np.ndarray:
    """A view of a fresh buffer with the logical contents of ``x`` ([B,H,T,D]
    or [B,H,T]) and the named memory layout."""
    if kind == "contiguous":
        return x.copy()
    if kind == "offset":  # first element not at the start of the buffer
        big = np.zeros((x.size + 7,), x.dtype)
        big[7:] = x.reshape(-1)
        return big[7:].reshape(x.shape)
    if kind == "swapaxes":  # stored [B, T, H, ...], viewed as [B, H, T, ...]
        return np.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2)
    if kind == "strided_t":  # every other row of a twice-longer buffer
        big = np.zeros(x.shape[:2] + (2 * x.shape[2],) + x.shape[3:], x.dtype)
        big[:, :, 1::2] = x
        return big[:, :, 1::2]
    if kind == "strided_d":  # last axis strided
        big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    if kind == "reversed":  # negative strides on H and T
        return np.ascontiguousarray(x[:, ::-1, ::-1])[:, ::-1, ::-1]
    raise ValueError(kind)


def _bits(x: mx.array) -> np.ndarray:
    u = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.dtype.size]
    return np.array(mx.contiguous(x).view(u))


# --------------------------------------------------------------------------
# Harness self-checks: the emulator must catch the faults it exists for.
# --------------------------------------------------------------------------


def test_emulator_rejects_faults(emu, tmp_path):
    scores = np.arange(40, dtype=np.float32).reshape(1, 1, 40)
    cases = {
        # kept has 10 slots but the output buffer claims 11: one never written.
        "written 0 times": dict(out_len=11, grid=32, tg=32),
        # output buffer too small: out-of-bounds write is caught.
        "out-of-bounds write": dict(out_len=9, grid=32, tg=32),
        # grid counted in threadgroups instead of threads.
        "not a multiple": dict(out_len=10, grid=1, tg=32),
        "multiple of 32": dict(out_len=10, grid=48, tg=48),
    }
    for want, c in cases.items():
        e = Emu(emu, tmp_path)
        e.add("select", {"kept": (c["out_len"], np.int32)}, {"scores": scores},
              params="10,2,3", grid=c["grid"], tg=c["tg"], mode="fibers", seed=1)
        with pytest.raises(AssertionError, match=want):
            e.run()
    # Reading past a strided input's allocation is caught as well.
    e = Emu(emu, tmp_path)
    paths = e.add("select", {"kept": (10, np.int32)}, {"scores": scores},
                  params="10,2,3", grid=32, tg=32, mode="fibers", seed=1)
    e.lines[-1] = e.lines[-1].replace("scores_strides=40,40,1", "scores_strides=40,40,2")
    with pytest.raises(AssertionError, match="out-of-bounds access to scores"):
        e.run()
    del paths


def test_emulator_catches_a_missing_barrier(tmp_path):
    """Mutation check: the selection kernel with the barrier between writing
    and reading the SIMD-group totals removed must fail under emulation
    (wrong positions, or an output slot written twice / never)."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH to build the Metal emulator")
    src = (METAL_DIR / "qfilters.h").read_text()
    barrier = ("      part[parity * 32u + sg] = tot_sg;\n    }\n"
               "    threadgroup_barrier(mem_flags::mem_threadgroup);\n")
    assert src.count(barrier) == 1
    (tmp_path / "metal").mkdir()
    (tmp_path / "metal" / "qfilters.h").write_text(src.replace(barrier, barrier.rsplit("    threadgroup_barrier", 1)[0]))
    binary = tmp_path / "emu_mutant"
    res = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-U_FORTIFY_SOURCE", f"-I{tmp_path}",
                          f"-I{EMU_DIR}", str(EMU_DIR / "emu_main.cpp"), "-o", str(binary)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    e = Emu(binary, tmp_path)
    rng = _rng(11)
    checks = []
    for seed in range(4):
        s = _scores(rng, (1, 2, 257), "random")
        want = np.array(reference.select_keep(mx.array(s), 100, 4, 16))
        p = e.add("select", {"kept": (want.size, np.int32)}, {"scores": s}, params="100,4,16",
                  grid=128, tg=64, mode="fibers", seed=seed)
        checks.append((p["kept"], want))
    try:
        e.run()
    except AssertionError as err:
        assert "EMULATOR ERROR" in str(err)
        return
    assert any(not np.array_equal(Emu.read(p).reshape(w.shape), w) for p, w in checks), \
        "the emulator did not notice a missing threadgroup_barrier"


# --------------------------------------------------------------------------
# Projection scores
# --------------------------------------------------------------------------


def _score_case(e: Emu, keys: np.ndarray, dtype, filters: np.ndarray, sign: int, layout: str,
                launch, mode="fibers", seed=0):
    B, H, T, D = keys.shape
    st = _layout(_storage(keys, dtype), layout)
    f_view = filters.T.copy().T if layout in ("swapaxes", "reversed") else filters.copy()
    grid, tg = launch
    return e.add("score", {"out": (B * H * T, np.float32)}, {"keys": st, "filters": f_view},
                 dtype=mk._DTYPE_NAMES[dtype], sign=sign, grid=grid, tg=tg, mode=mode, seed=seed)


def _check_scores(got: np.ndarray, keys_mx: mx.array, filters: np.ndarray, sign: int, dtype, ctx):
    k = np.array(keys_mx.astype(mx.float32), dtype=np.float64)
    f = filters.astype(np.float64)
    prod = k * f[None, :, None, :]
    exact = sign * prod.sum(-1)
    scale = np.maximum(np.abs(prod).sum(-1), np.finfo(np.float32).tiny)
    ref = np.array(reference.projection_scores(keys_mx, mx.array(filters), sign), np.float64)
    got = got.reshape(exact.shape).astype(np.float64)
    err = (np.abs(got - exact) / scale).max()
    err_ref = (np.abs(ref - exact) / scale).max()
    assert err <= SCORE_RTOL[dtype], (ctx, err)
    assert err <= 2 * err_ref + SCORE_RTOL[dtype], (ctx, err, err_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_projection_scores_emulated(emu, tmp_path, dtype):
    """T x H x D with the Mac launch geometry, plus a one-threadgroup grid
    (the grid-stride loop) for every case; layouts and signs rotate."""
    e = Emu(emu, tmp_path)
    checks = []
    for i, (T, H, D) in enumerate(itertools.product(LENGTHS, HEADS, HEAD_DIMS)):
        B = 2 if (T < 1000 and i % 2) else 1
        rng = _rng(1, T, H, D, DTYPES.index(dtype))
        keys = (rng.standard_normal((B, H, T, D)) * 3).astype(np.float32)
        filters = rng.standard_normal((H, D)).astype(np.float32)
        sign = (1, -1)[i % 2]
        layout = LAYOUTS[i % len(LAYOUTS)]
        keys_mx = _to_mx(_storage(keys, dtype), dtype)
        for launch in (_emu_launch(mk.score_launch(B, H, T)), (mk.SCORE_TG, mk.SCORE_TG)):
            p = _score_case(e, keys, dtype, filters, sign, layout, launch, seed=i)
            checks.append((p, keys_mx, filters, sign, f"T={T} H={H} D={D} B={B} {layout} {launch}"))
    e.run()
    for p, keys_mx, filters, sign, ctx in checks:
        _check_scores(Emu.read(p["out"]), keys_mx, filters, sign, dtype, ctx)


def test_projection_scores_special_values_emulated(emu, tmp_path):
    """float16 subnormals / signed zeros / extremes and values beyond the
    float16 range decode exactly and accumulate in float32."""
    e = Emu(emu, tmp_path)
    vals = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, 1.0], np.float16)
    keys16 = np.tile(vals, (8, 1)).reshape(1, 1, 8, 8)  # row t, element d
    cases = []
    for d in range(8):
        f = np.zeros((1, 8), np.float32)
        f[0, d] = 1.0
        p = e.add("score", {"out": (8, np.float32)}, {"keys": keys16.view(np.uint16).copy(), "filters": f},
                  dtype="float16", sign=1, grid=256, tg=256, mode="fibers", seed=d)
        cases.append((d, p))
    big = np.full((1, 2, 5, 128), 1000.0, np.float16).view(np.uint16)
    pb = e.add("score", {"out": (10, np.float32)}, {"keys": big, "filters": np.ones((2, 128), np.float32)},
               dtype="float16", sign=-1, grid=256, tg=256, mode="fibers", seed=9)
    e.run()
    for d, p in cases:
        np.testing.assert_array_equal(Emu.read(p["out"]), np.full(8, np.float32(vals[d])))
    np.testing.assert_array_equal(Emu.read(pb["out"]), np.full(10, -128000.0, np.float32))


# --------------------------------------------------------------------------
# Selection + gather
# --------------------------------------------------------------------------


def _scores(rng, shape, mode):
    return score_array(rng, shape, mode)


def _budgets(T: int) -> list[int]:
    below = sorted({1, max(1, T // 4), max(1, T - 1)})
    return [b for b in below if b < T] + [T, T + 5]


def _sink_recent(budget: int) -> list[tuple[int, int]]:
    cands = [(0, 0), (min(4, budget), 0), (0, min(16, budget)), (budget // 3, budget // 3), (0, budget)]
    return sorted({c for c in cands if c[0] + c[1] <= budget})


def _params(budget: int, n_sink: int, recent, H: int) -> str:
    """The select kernel's params {budget, n_sink, recent[0..H)} (one window per head)."""
    windows = list(recent) if isinstance(recent, (list, tuple)) else [recent] * H
    assert len(windows) == H
    return ",".join(str(v) for v in (budget, n_sink, *windows))


def _head_windows(recent: int, most: int, H: int, k: int):
    """Every other case per head: head h gets recent, 0, most (= budget - n_sink), ...
    rotated by k; else the one int ``recent``."""
    if k % 2 == 0:
        return recent
    cycle = (recent, 0, most, most // 2)
    return [cycle[(h + k) % 4] for h in range(H)]


# The grid-stride kernels (score, gather) run with the Mac geometry while it
# has at most this many threadgroups; bigger launches are emulated with this
# many groups (same code path: every thread loops over its share), which keeps
# the emulated matrix within minutes on two cores.
EMU_MAX_GROUPS = 32


def _emu_launch(launch: tuple[int, int]) -> tuple[int, int]:
    grid, tg = launch
    return min(grid, EMU_MAX_GROUPS * tg), tg


def _select_launches(B: int, H: int, T: int, largest: bool) -> list[tuple[int, int]]:
    """The Mac geometry, plus one SIMD group per row (many chunks) and, with
    ``largest``, a 1024-thread group (the scratch maximum)."""
    out = {mk.select_launch(B, H, T), (32 * B * H, 32)}
    if largest:
        out.add((1024 * B * H, 1024))
    return sorted(out)


@pytest.mark.parametrize("T", LENGTHS)
def test_select_gather_emulated(emu, tmp_path, T):
    """B, H, budget (below / equal / above T), n_sink and recent (including 0),
    score modes with ties, NaN and -0.0, layouts, all dtypes, D of 64/80/128."""
    e = Emu(emu, tmp_path)
    modes = ("random", "ties", "const")
    checks = []
    for i, (B, H) in enumerate(itertools.product((1, 2), HEADS)):
        rng = _rng(3, T, B, H)
        dtype = DTYPES[i % 3]
        vdtype = DTYPES[(i + 1) % 3]
        Dk, Dv = HEAD_DIMS[i % 3], HEAD_DIMS[(i + 1) % 3]
        if T > 1025:
            Dk, Dv = 64, 80
        keys = _storage(rng.standard_normal((B, H, T, Dk)).astype(np.float32), dtype)
        vals = rng.standard_normal((B, H, T, Dv)).astype(np.float32)
        vals[rng.random(vals.shape) < 0.01] = np.nan
        vals = _storage(vals, vdtype)
        keys_mx, vals_mx = _to_mx(keys, dtype), _to_mx(vals, vdtype)
        lk, lv = LAYOUTS[i % len(LAYOUTS)], LAYOUTS[(i + 3) % len(LAYOUTS)]
        keys_view, vals_view = _layout(keys, lk), _layout(vals, lv)
        for j, budget in enumerate(_budgets(T)):
            for n_sink, recent in _sink_recent(budget):
                mode = modes[(i + j + n_sink + recent) % 3]
                s = _scores(rng, (B, H, T), mode)
                ls = LAYOUTS[(i + j + n_sink) % len(LAYOUTS)]
                recent = _head_windows(recent, budget - n_sink, H, i + j + n_sink)
                ref_kept = np.array(reference.select_keep(mx.array(s), budget, n_sink, recent))
                np.testing.assert_array_equal(ref_kept, np_keep_rows(s, budget, n_sink, recent))
                ctx = f"B={B} H={H} budget={budget} sink={n_sink} recent={recent} mode={mode} {ls}"
                for grid, tg in _select_launches(B, H, T, largest=i < 2):
                    p = e.add("select", {"kept": (ref_kept.size, np.int32)}, {"scores": _layout(s, ls)},
                              params=_params(budget, n_sink, recent, H), grid=grid, tg=tg,
                              mode="fibers", seed=j)
                    checks.append(("kept", p["kept"], ref_kept, f"{ctx} tg={tg}"))
            # Gather (its own kernel) once per budget, from the reference's
            # kept positions of the last (n_sink, recent) case.
            K = ref_kept.shape[-1]
            ref_k, ref_v = reference.compact(keys_mx, vals_mx, mx.array(ref_kept))
            kept_in = np.ascontiguousarray(ref_kept, dtype=np.int32)
            for name, view, D, ref in (("k", keys_view, Dk, ref_k), ("v", vals_view, Dv, ref_v)):
                grid, tg = _emu_launch(mk.gather_launch(B, H, K, D))
                p = e.add("gather", {"out": (B * H * K * D, view.dtype)},
                          {"src": view, "kept": kept_in}, isz=view.itemsize,
                          grid=grid, tg=tg, mode="fibers", seed=j)
                checks.append((name, p["out"], _bits(ref).reshape(-1), f"B={B} H={H} budget={budget}"))
    e.run()
    for what, path, want, ctx in checks:
        got = Emu.read(path)
        np.testing.assert_array_equal(got.reshape(want.shape), want, err_msg=f"{what}: {ctx}")


def test_select_tie_break_and_special_values_emulated(emu, tmp_path):
    s = TIE_BREAK_SCORES.reshape(1, 1, 8)
    cases = TIE_BREAK_CASES
    e = Emu(emu, tmp_path)
    paths = {}
    for (budget, n_sink, recent) in cases:
        paths[(budget, n_sink, recent)] = e.add(
            "select", {"kept": (budget, np.int32)}, {"scores": s},
            params=_params(budget, n_sink, recent, 1), grid=32, tg=32, mode="fibers", seed=budget)
    e.run()
    for key, want in cases.items():
        assert Emu.read(paths[key]["kept"]).tolist() == want, key


def test_threads_mode_subset(emu, tmp_path):
    """The same kernels with one std::thread per Metal thread and
    std::barrier (real concurrency), on a subset small enough for two cores."""
    e = Emu(emu, tmp_path)
    checks = []
    for i, T in enumerate((31, 257, 1025)):
        B, H, D = 2, 3, 80
        rng = _rng(7, T)
        dtype = DTYPES[i]
        keys = _storage(rng.standard_normal((B, H, T, D)).astype(np.float32), dtype)
        keys_mx = _to_mx(keys, dtype)
        filters = rng.standard_normal((H, D)).astype(np.float32)
        p = e.add("score", {"out": (B * H * T, np.float32)}, {"keys": _layout(keys, "swapaxes"),
                  "filters": filters}, dtype=mk._DTYPE_NAMES[dtype], sign=-1, grid=128, tg=64,
                  mode="threads", seed=i)
        checks.append(("score", p["out"], keys_mx, filters))
        for mode_s in ("random", "ties"):
            s = _scores(rng, (B, H, T), mode_s)
            budget, n_sink = max(1, T // 3), min(4, T // 3)
            recent = [T // 9, 0, budget - n_sink] if mode_s == "ties" else T // 9
            ref_kept = np.array(reference.select_keep(mx.array(s), budget, n_sink, recent))
            p = e.add("select", {"kept": (ref_kept.size, np.int32)}, {"scores": _layout(s, "reversed")},
                      params=_params(budget, n_sink, recent, H), grid=64 * B * H, tg=64,
                      mode="threads", seed=i)
            checks.append(("kept", p["kept"], ref_kept, None))
            K = ref_kept.shape[-1]
            ref_k, _ = reference.compact(keys_mx, keys_mx, mx.array(ref_kept))
            p = e.add("gather", {"out": (B * H * K * D, keys.dtype)},
                      {"src": _layout(keys, "strided_d"), "kept": ref_kept.astype(np.int32)},
                      isz=keys.itemsize, grid=128, tg=64, mode="threads", seed=i)
            checks.append(("gather", p["out"], _bits(ref_k).reshape(-1), None))
    e.run()
    for i, (what, path, a, b) in enumerate(checks):
        got = Emu.read(path)
        if what == "score":
            _check_scores(got, a, b, -1, a.dtype, f"threads case {i}")
        else:
            np.testing.assert_array_equal(got.reshape(a.shape), a, err_msg=f"{what} case {i}")


# --------------------------------------------------------------------------
# Launch geometry: grid counts threads, whole threadgroups, one row per group
# --------------------------------------------------------------------------


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("H", HEADS)
def test_launch_geometry(T, H):
    for B in (1, 2):
        grid, tg = mk.select_launch(B, H, T)
        assert tg % mk.SIMD == 0 and 32 <= tg <= mk.SELECT_MAX_TG and grid == tg * B * H
        assert tg >= min(T, mk.SELECT_MAX_TG)
        grid, tg = mk.score_launch(B, H, T)
        assert grid % tg == 0 and tg % mk.SIMD == 0
        assert grid // mk.SIMD >= min(B * H * T, mk.MAX_SCORE_GROUPS * tg // mk.SIMD)
        for D in HEAD_DIMS:
            grid, tg = mk.gather_launch(B, H, T, D)
            assert grid % tg == 0 and (grid >= B * H * T * D or grid == mk.MAX_GATHER_GROUPS * tg)


def test_sources_present_and_consistent():
    header = (METAL_DIR / "qfilters.h").read_text()
    metal = (METAL_DIR / "qfilters.metal").read_text()
    assert "#define QF_SELECT_MAX_TG 1024" in header and mk.SELECT_MAX_TG <= 1024
    assert f"#define QF_SCORE_TG {mk.SCORE_TG}" in header
    assert f"#define QF_GATHER_TG {mk.GATHER_TG}" in header
    for name in ("qfilters_score_float32", "qfilters_score_float16", "qfilters_score_bfloat16",
                 "qfilters_gather_uint16", "qfilters_gather_uint32", "qfilters_select"):
        assert name in metal
    # The package finds the same header (installed copy or the checkout's).
    assert (mk.metal_source_dir() / "qfilters.h").read_text() == header
