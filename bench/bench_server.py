"""Batched serving throughput and peak memory: eviction caches vs mlx-lm's caches.

What ``qfilters-mlx server`` runs per request batch, without HTTP: mlx-lm's
``BatchGenerator`` (continuous batching, as ``mlx_lm.server`` uses it) over
``C`` concurrent requests, each a distinct ``--prompt`` -token prompt (windows of
CPython's reference text, see ``common.prompts``), greedy, ``--max-tokens`` each.
Arms, at one budget (``--budget``):

* ``full``: mlx-lm's default cache (``KVCache`` -> ``BatchKVCache``), keeps everything;
* ``rotating``: ``BatchGenerator(max_kv_size=budget)`` (``RotatingKVCache(budget, keep=4)``
  -> ``BatchRotatingKVCache``);
* ``qfilters``: ``KVCacheBuilder.install`` (``BatchQFiltersCache``): n_sink 4, recent
  budget/2, key-SVD filter from the first 128 keys, sign -1 (``common.qf_config``).

Measured per (arm, C): decode throughput = generated tokens summed over requests /
decode time (``BatchGenerator.stats``: prompt processing excluded), the end-to-end
rate (generated tokens / wall time, prefill included), and peak memory
(``mx.get_peak_memory`` after ``mx.reset_peak_memory``, weights included).
Writes ``bench/results/server.json`` and ``server.md``.

Run: ``PYTHONPATH=python python bench/bench_server.py`` (``--help`` for the sizes).
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from qfilters_mlx.cache.builder import KVCacheBuilder

ARMS = ("full", "rotating", "qfilters")


def run_arm(model, arm: str, budget: int, rows: list[list[int]], max_tokens: int, backend: str) -> dict:
    if arm == "qfilters":
        KVCacheBuilder.install(model, common.qf_config(budget), backend=backend)
    kw = {"max_kv_size": budget} if arm == "rotating" else {}
    try:
        mx.clear_cache()
        mx.reset_peak_memory()
        gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(rows),
                             prefill_batch_size=len(rows), **kw)
        tic = time.perf_counter()
        n = 0
        with gen.stats() as stats:
            gen.insert(rows)
            while responses := gen.next_generated():
                n += len(responses)
        wall = time.perf_counter() - tic
        gen.close()
    finally:
        if arm == "qfilters":
            del model.make_cache
    return {"arm": arm, "concurrency": len(rows), "generated": n,
            "decode_tok_s": stats.generation_tokens / stats.generation_time
            if hasattr(stats, "generation_time") else stats.generation_tps,
            "end_to_end_tok_s": n / wall, "prompt_tok_s": stats.prompt_tps,
            "peak_memory_gb": mx.get_peak_memory() / 1e9, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--concurrency", type=common.int_list, default=[1, 4, 8])
    ap.add_argument("--backend", default="cpp")
    ap.add_argument("--out", default=str(common.RESULTS / "server.json"))
    args = ap.parse_args()

    model, tok = common.load_model()
    stride = 97  # distinct prompts: windows of the text shifted by 97 tokens
    text = common.prompts(tok, [args.prompt + stride * max(args.concurrency)])
    ids = list(text.values())[0].tolist()
    results = []
    for c in args.concurrency:
        rows = [ids[i * stride: i * stride + args.prompt] for i in range(c)]
        for arm in ARMS:
            r = run_arm(model, arm, args.budget, rows, args.max_tokens, args.backend)
            results.append(r)
            print(f"C={c} {arm:9s} decode {r['decode_tok_s']:7.1f} tok/s  end-to-end "
                  f"{r['end_to_end_tok_s']:6.1f} tok/s  peak {r['peak_memory_gb']:.3f} GB", flush=True)

    def get(arm, c, key):
        return next(r[key] for r in results if r["arm"] == arm and r["concurrency"] == c)

    rows_md = []
    for c in args.concurrency:
        for arm in ARMS:
            rows_md.append([c, arm, f"{get(arm, c, 'decode_tok_s'):.1f}",
                            f"{get(arm, c, 'end_to_end_tok_s'):.1f}",
                            f"{get(arm, c, 'peak_memory_gb'):.3f}",
                            f"{get(arm, c, 'decode_tok_s') / get('rotating', c, 'decode_tok_s'):.2f}",
                            f"{get(arm, c, 'peak_memory_gb') / get('rotating', c, 'peak_memory_gb'):.2f}"])
    meta = common.run_meta(prompt_tokens=args.prompt, max_tokens=args.max_tokens, budget=args.budget,
                           backend=args.backend, loadavg_end=__import__("os").getloadavg())
    md = [f"# Batched serving (BatchGenerator), SmolLM2-135M float32, {args.prompt}-token prompts, "
          f"{args.max_tokens} generated tokens each, budget {args.budget}", "",
          f"Machine: {meta['machine']}, load average at start {meta['loadavg_start'][0]:.1f} "
          f"(shared, loaded). Decode = generated tokens summed over requests / decode time; "
          "end-to-end includes prefill; peak memory includes the weights.", "",
          *common.md_table(["concurrent", "cache", "decode tok/s", "end-to-end tok/s",
                            "peak GB", "decode vs rotating", "peak vs rotating"], rows_md,
                           "rllrrrr"), ""]
    paths = common.write_results(args.out, {"meta": meta, "results": results}, "\n".join(md))
    print("\n".join(md))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
