"""Microbenchmarks of the eviction hot path: reference (pure MLX) vs cpp (``_ext``).

For B=1, H_kv in {3, 8}, D in {64, 128}, T in {1024, 4096, 16384}, budget T/4
(n_sink 4, recent budget/2, float16 keys/values like an mlx-lm cache), times

* ``score``:  projection scores ``[1, H, T]`` from keys ``[1, H, T, D]``;
* ``select``: sink/recent-masked top-k selection + compaction of keys and values;
* ``evict``:  the whole eviction step (score + select + compact);

for every available arm: ``reference``, ``cpp``, ``metal`` (only where Metal
is present: the metallib, else the JIT kernels) and, when the published
``veloxquant-mlx`` package is installed (``bench`` extra), its Q-Filters path
(``qfilters_update_batched``, the batched score + protected top-k + gather its
cache runs on a CPU). Each op is also compared with ``copy``: a plain MLX copy
(``mx.array(x)``) of a buffer holding half the op's bytes, i.e. a copy that
moves (reads + writes) exactly the bytes the op must move, timed in the same run.

Bytes that must move: score reads the keys and writes the scores; select reads
the scores, reads and writes the kept key/value rows and writes the positions;
evict is their sum.

Run either as pytest-benchmark (``pytest bench/bench_kernels.py --benchmark-only``)
or as a script (``python bench/bench_kernels.py``), which prints a table and
writes ``bench/results/kernels.json``. Every timed call ends in ``mx.eval``.
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from common import time_call  # noqa: E402
from qfilters_mlx.backends import reference  # noqa: E402

try:
    from qfilters_mlx import _ext
except ImportError:  # not built: only the reference arm runs
    _ext = None


def _metal_backend():
    """The ``metal`` backend (metallib, else JIT) when Metal is present."""
    if not mx.metal.is_available():
        return None
    from qfilters_mlx.backends.metal import metal_backend

    return metal_backend("auto")


_METAL = _metal_backend()

try:
    from veloxquant_mlx.quantizers.qfilters import qfilters_update_batched as _velox_update
except ImportError:
    _velox_update = None

HEADS = (3, 8)
HEAD_DIMS = (64, 128)
LENGTHS = (1024, 4096, 16384)
DTYPE = mx.float16
N_SINK = 4
SIGN = 1
OPS = ("score", "select", "evict")
RESULTS = common.RESULTS / "kernels.json"


@dataclass(frozen=True)
class Config:
    H: int
    D: int
    T: int

    @property
    def budget(self) -> int:
        return self.T // 4

    @property
    def recent(self) -> int:
        return self.budget // 2

    @property
    def label(self) -> str:
        return f"H{self.H}-D{self.D}-T{self.T}"


CONFIGS = [Config(H, D, T) for H in HEADS for D in HEAD_DIMS for T in LENGTHS]


def op_bytes(cfg: Config, op: str) -> int:
    """Bytes an op must move (reads + writes), B = 1."""
    isz = DTYPE.size
    score = cfg.H * cfg.T * cfg.D * isz + cfg.H * cfg.T * 4
    select = cfg.H * cfg.T * 4 + 2 * (2 * cfg.H * cfg.budget * cfg.D * isz) + cfg.H * cfg.budget * 4
    return {"score": score, "select": select, "evict": score + select}[op]


class Inputs:
    """Seeded inputs of one config, evaluated before any timing."""

    def __init__(self, cfg: Config):
        rng = np.random.default_rng([cfg.H, cfg.D, cfg.T])
        shape = (1, cfg.H, cfg.T, cfg.D)
        self.cfg = cfg
        self.keys = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(DTYPE)
        self.values = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(DTYPE)
        f = rng.standard_normal((cfg.H, cfg.D)).astype(np.float32)
        self.filters = mx.array(f / np.linalg.norm(f, axis=-1, keepdims=True))
        self.scores = reference.projection_scores(self.keys, self.filters, SIGN)
        self.copy_src = {
            # Real bytes (mx.zeros would be a broadcast scalar, not a buffer).
            op: mx.array(rng.integers(0, 256, op_bytes(cfg, op) // 2, dtype=np.uint8))
            for op in OPS
        }
        # veloxquant works on [B*H, T, D] groups.
        self.keys3 = self.keys.reshape(cfg.H, cfg.T, cfg.D)
        self.values3 = self.values.reshape(cfg.H, cfg.T, cfg.D)
        mx.eval(self.keys, self.values, self.filters, self.scores, self.keys3, self.values3,
                *self.copy_src.values())


def _ref_select(x: Inputs, scores: mx.array):
    kept = reference.select_keep(scores, x.cfg.budget, N_SINK, x.cfg.recent)
    return (kept, *reference.compact(x.keys, x.values, kept))


def _cpp_evict(x: Inputs):
    c = x.cfg
    s = _ext.projection_scores(x.keys, x.filters, SIGN)
    return _ext.select_compact(s, x.keys, x.values, c.budget, N_SINK, c.recent)


def arms(x: Inputs) -> dict[tuple[str, str], Callable[[], object]]:
    """(op, arm) -> a zero-argument callable returning the arrays to evaluate."""
    c = x.cfg
    out: dict[tuple[str, str], Callable[[], object]] = {
        ("score", "reference"): lambda: reference.projection_scores(x.keys, x.filters, SIGN),
        ("select", "reference"): lambda: _ref_select(x, x.scores),
        ("evict", "reference"): lambda: _ref_select(x, reference.projection_scores(x.keys, x.filters, SIGN)),
    }
    if _ext is not None:
        out[("score", "cpp")] = lambda: _ext.projection_scores(x.keys, x.filters, SIGN)
        out[("select", "cpp")] = lambda: _ext.select_compact(
            x.scores, x.keys, x.values, c.budget, N_SINK, c.recent
        )
        out[("evict", "cpp")] = lambda: _cpp_evict(x)
    if _METAL is not None:  # Metal GPU: inputs are read in place (unified memory)
        m = _METAL
        out[("score", "metal")] = lambda: m.projection_scores(x.keys, x.filters, SIGN)
        out[("select", "metal")] = lambda: m.select_compact(
            x.scores, x.keys, x.values, c.budget, N_SINK, c.recent
        )
        out[("evict", "metal")] = lambda: m.select_compact(
            m.projection_scores(x.keys, x.filters, SIGN), x.keys, x.values, c.budget, N_SINK, c.recent
        )
    if _velox_update is not None:
        out[("evict", "veloxquant")] = lambda: _velox_update(
            x.keys3, x.values3, x.filters, c.budget, N_SINK, c.recent, SIGN
        )
    for op in OPS:
        out[(op, "copy")] = lambda op=op: mx.array(x.copy_src[op])
    return out


def run(configs: list[Config] = CONFIGS) -> dict:
    rows = []
    for cfg in configs:
        x = Inputs(cfg)
        fns = arms(x)
        timed = {key: time_call(fn) for key, fn in fns.items()}
        for op in OPS:
            nbytes = op_bytes(cfg, op)
            copy = timed[(op, "copy")]["min_s"]
            ref = timed[(op, "reference")]["min_s"]
            for (o, arm), t in timed.items():
                if o != op:
                    continue
                rows.append({
                    "H": cfg.H, "D": cfg.D, "T": cfg.T, "budget": cfg.budget,
                    "n_sink": N_SINK, "recent": cfg.recent, "dtype": str(DTYPE),
                    "op": op, "arm": arm, "bytes": nbytes, **t,
                    "gb_per_s": nbytes / t["min_s"] / 1e9,
                    "speedup_vs_reference": ref / t["min_s"],
                    "time_vs_copy": t["min_s"] / copy,
                })
    return {
        "benchmark": "qfilters kernels: score / select+compact / eviction step",
        "timing": "seconds per call, min over repeated calls after warm-up (median also kept); "
                  "ratios use the min",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": sys.version.split()[0], "mlx": mx.__version__,
                    "device": str(mx.default_device())},
        "arms_missing": {"cpp": _ext is None, "metal": _METAL is None,
                         "veloxquant": _velox_update is None},
        "rows": rows,
    }


def format_table(result: dict) -> str:
    rows = [[r["H"], r["D"], r["T"], r["op"], r["arm"], f"{r['min_s'] * 1e3:.3f}", f"{r['gb_per_s']:.2f}",
             f"{r['speedup_vs_reference']:.1f}", f"{r['time_vs_copy']:.2f}"] for r in result["rows"]]
    return "\n".join(common.md_table(
        ["H", "D", "T", "op", "arm", "time (ms)", "GB/s", "x faster than ref", "time / copy"], rows, "lllllrrrr"))


# --------------------------------------------------------------------------
# pytest-benchmark entry points (`pytest bench/bench_kernels.py --benchmark-only`)
# --------------------------------------------------------------------------

def _pytest_params():
    import pytest

    params = []
    for cfg in CONFIGS:
        for op, arm in (
            ("score", "reference"), ("score", "cpp"), ("score", "metal"), ("score", "copy"),
            ("select", "reference"), ("select", "cpp"), ("select", "metal"), ("select", "copy"),
            ("evict", "reference"), ("evict", "cpp"), ("evict", "metal"), ("evict", "veloxquant"),
            ("evict", "copy"),
        ):
            params.append(pytest.param(cfg, op, arm, id=f"{cfg.label}-{op}-{arm}"))
    return params


if "pytest" in sys.modules:
    import pytest

    _INPUTS: dict[Config, Inputs] = {}

    @pytest.mark.parametrize("cfg,op,arm", _pytest_params())
    def test_kernel_benchmark(benchmark, cfg, op, arm):
        if arm == "cpp" and _ext is None:
            pytest.skip("qfilters_mlx._ext is not built")
        if arm == "metal" and _METAL is None:
            pytest.skip("no Metal GPU")
        if arm == "veloxquant" and _velox_update is None:
            pytest.skip("veloxquant-mlx is not installed (pip install '.[bench]')")
        if cfg not in _INPUTS:
            _INPUTS.clear()  # one config's inputs alive at a time
            _INPUTS[cfg] = Inputs(cfg)
        fn = arms(_INPUTS[cfg])[(op, arm)]
        benchmark.group = f"{cfg.label}-{op}"
        benchmark.extra_info.update(bytes=op_bytes(cfg, op), budget=cfg.budget)
        benchmark.pedantic(lambda: mx.eval(fn()), rounds=10, iterations=1, warmup_rounds=3)
        benchmark.extra_info["gb_per_s"] = op_bytes(cfg, op) / benchmark.stats.stats.min / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    p.add_argument("--quick", action="store_true", help="only H=8, D=128, T=4096")
    args = p.parse_args(argv)
    configs = [Config(8, 128, 4096)] if args.quick else CONFIGS
    result = run(configs)
    print(format_table(result))
    common.write_results(args.out, result)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
