"""Decode-step cost with one recent window vs per-head windows.

SmolLM2 shapes (30 layers, H_kv 3, D 64, float32, B 1), the cpp backend, budget 256,
4 sinks, key-SVD filter (sign -1) calibrated on the first 128 keys. Each cache is
filled with ``--context`` seeded random tokens, then ``--steps`` single-token
steps (``update_and_fetch`` on every layer, one ``mx.eval``) are timed one by one;
the median is printed as one JSON line. ``--recent int`` uses recent 128 for every
head (one window for all heads); ``--recent perhead`` a per-head table
(0 / 128 / 252 in turn over heads and layers). Run it alternately in both trees
for a paired before/after comparison::

    PYTHONPATH=python python bench/bench_perhead_step.py --recent int
    PYTHONPATH=python python bench/bench_perhead_step.py --recent perhead
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

LAYERS, H_KV, D = 30, 3, 64


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recent", choices=("int", "perhead"), default="int")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--budget", type=int, default=256)
    args = p.parse_args(argv)
    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    b = args.budget
    if args.recent == "int":
        recent = b // 2
    else:
        cycle = (0, b // 2, b - 4)
        recent = [[cycle[(layer + h) % 3] for h in range(H_KV)] for layer in range(LAYERS)]
    cfg = KVCacheConfig(qfilters_budget=b, qfilters_n_sink=4, qfilters_recent=recent, qfilters_sign=-1,
                        qfilters_filter_source="keys", head_dim=D)
    caches = [QFiltersKVCache(cfg, layer_idx=i, backend="cpp") for i in range(LAYERS)]
    mx.random.seed(0)
    for start in range(0, args.context, 512):
        kv = mx.random.normal((1, H_KV, min(512, args.context - start), D))
        out = [c.update_and_fetch(kv, kv) for c in caches]
        mx.eval(out)
    rows = mx.random.normal((args.steps + 8, 1, H_KV, 1, D))
    mx.eval(rows)
    times = []
    for i in range(args.steps + 8):
        r = rows[i]
        mx.eval(r)
        t0 = time.perf_counter()
        out = [c.update_and_fetch(r, r) for c in caches]
        mx.eval(out)
        if i >= 8:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"recent": args.recent, "median_ms": 1e3 * statistics.median(times),
                      "p10_ms": 1e3 * statistics.quantiles(times, n=10)[0], "steps": args.steps,
                      "context": args.context, "layers": LAYERS, "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
