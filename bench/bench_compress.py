"""What compressing a context once costs, vs streaming eviction during the same prefill.

Shapes of SmolLM2-135M (30 layers, H_kv 3, D 64, float32, B 1), cache only (no model:
the model's prefill cost is the same for both and dwarfs either). Every arm is fed the
same seeded random keys/values of a ``--contexts`` context in mlx-lm's 2,048-token
prefill chunks, on every layer, with one ``mx.eval`` of the returned arrays per chunk
(as ``generate_step`` evaluates the cache state after each chunk). Q-Filters scores
with fixed per-layer filters (as with ``--filters``: no calibration), backend ``auto``.

Arms, at each fraction kept (``--kept``):

* ``streaming``: ``QFiltersKVCache`` with budget ``int(context * kept)`` (n_sink 4, recent
  budget/2), evicting after every chunk; time = the whole prefill;
* ``compress_once``: the cache appends every chunk (no eviction), then
  ``compress_caches(..., ratio=1 - kept)`` once; times = prefill appends, the compression
  alone, and their sum;
* ``full``: mlx-lm's ``KVCache`` (the appends alone, the yardstick).

Reported: the median over ``--repeats`` runs of each time (ms, all 30 layers).

Usage::

    python bench/bench_compress.py               # contexts 4096, 8192; writes bench/results/compress.{json,md}
    python bench/bench_compress.py --quick       # 4 layers, 1024 tokens, no files written
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

H_KV, HEAD_DIM, DTYPE, LAYERS, CHUNK = 3, 64, mx.float32, 30, 2048


def _caches(arm: str, context: int, kept: float, layers: int, filters) -> list:
    from mlx_lm.models.cache import KVCache

    from qfilters_mlx import CompressOnce, KVCacheConfig, QFiltersKVCache

    if arm == "full":
        return [KVCache() for _ in range(layers)]
    if arm == "streaming":
        cfg = KVCacheConfig(method="qfilters", head_dim=HEAD_DIM, qfilters_budget=int(context * kept))
    else:
        cfg = KVCacheConfig(method="qfilters", head_dim=HEAD_DIM, mode=CompressOnce(at="manual"))
    return [QFiltersKVCache(cfg, i, filters=filters[i]) for i in range(layers)]


def _prefill(caches, kv) -> float:
    """Seconds to feed ``kv [(k, v) per chunk]`` to every layer, evaluated per chunk."""
    mx.synchronize()
    t0 = time.perf_counter()
    for k, v in kv:
        outs = [c.update_and_fetch(k, v) for c in caches]
        mx.eval(outs, [getattr(c, "scores", None) for c in caches if hasattr(c, "scores")])
    mx.synchronize()
    return time.perf_counter() - t0


def run_one(context: int, kept: float, layers: int, repeats: int) -> dict:
    from qfilters_mlx import compress_caches

    key = mx.random.key(context)
    kk, kv_, kf = mx.random.split(key, 3)
    keys = mx.random.normal((1, H_KV, context, HEAD_DIM), dtype=DTYPE, key=kk)
    values = mx.random.normal((1, H_KV, context, HEAD_DIM), dtype=DTYPE, key=kv_)
    filters = mx.random.normal((layers, H_KV, HEAD_DIM), key=kf)
    filters = filters / mx.linalg.norm(filters, axis=-1, keepdims=True)
    chunks = [(keys[:, :, s:s + CHUNK], values[:, :, s:s + CHUNK]) for s in range(0, context, CHUNK)]
    mx.eval(chunks, filters)
    t = {"full": [], "streaming": [], "compress_once_prefill": [], "compress_once_compress": []}
    for _ in range(repeats + 1):  # the first round warms up
        t["full"].append(_prefill(_caches("full", context, kept, layers, filters), chunks))
        t["streaming"].append(_prefill(_caches("streaming", context, kept, layers, filters), chunks))
        once = _caches("compress_once", context, kept, layers, filters)
        t["compress_once_prefill"].append(_prefill(once, chunks))
        mx.synchronize()
        t0 = time.perf_counter()
        compress_caches(once, ratio=1.0 - kept)
        mx.eval([(c.keys, c.values, c.scores, c.positions) for c in once])
        mx.synchronize()
        t["compress_once_compress"].append(time.perf_counter() - t0)
        assert once[0].size() == int(context * kept)
    med = {k: 1e3 * statistics.median(v[1:]) for k, v in t.items()}
    med["compress_once_total"] = med["compress_once_prefill"] + med["compress_once_compress"]
    return {"context": context, "kept": kept, "layers": layers, "repeats": repeats,
            "backend": once[0].backend.name, "median_ms": med,
            "raw_ms": {k: [1e3 * x for x in v[1:]] for k, v in t.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=common.int_list, default=[4096, 8192])
    ap.add_argument("--kept", default="0.25,0.125")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    kept = [float(x) for x in args.kept.split(",")]
    layers, contexts, repeats = (4, [1024], 2) if args.quick else (LAYERS, args.contexts, args.repeats)
    meta = common.run_meta(layers=layers, h_kv=H_KV, head_dim=HEAD_DIM, dtype=str(DTYPE), chunk=CHUNK)
    rows, results = [], []
    for ctx in contexts:
        for k in kept:
            r = run_one(ctx, k, layers, repeats)
            results.append(r)
            m = r["median_ms"]
            rows.append([ctx, f"{100 * k:g}%", f"{m['full']:.1f}", f"{m['streaming']:.1f}",
                         f"{m['compress_once_prefill']:.1f}", f"{m['compress_once_compress']:.1f}",
                         f"{m['compress_once_total']:.1f}"])
            print(rows[-1], flush=True)
    md = ["# Compress once vs streaming eviction during the prefill (cache only)", "",
          f"{layers} layers x H_kv {H_KV} x D {HEAD_DIM}, float32, {CHUNK}-token prefill chunks, "
          f"backend {results[0]['backend']}; median ms over {repeats} runs, all layers. Machine: "
          f"{meta['machine']}, load average at start {tuple(round(x, 1) for x in meta['loadavg_start'])} "
          "(shared with other jobs).", "",
          *common.md_table(["context", "kept", "full (appends)", "streaming (evict per chunk)",
                            "compress_once: appends", "compress_once: compress", "compress_once: total"],
                           rows, "rrrrrrr"), ""]
    print("\n".join(md))
    if not args.quick:
        for p in common.write_results(common.RESULTS / "compress.json", {"meta": meta, "results": results},
                                      "\n".join(md)):
            print("wrote", p)


if __name__ == "__main__":
    main()
