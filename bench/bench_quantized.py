"""Decode speed and KV bytes of eviction + quantized storage, in one run.

Arms, at 4k and 8k prompts (SmolLM2-135M-Instruct float32, 30 layers, 3 KV heads, D 64):

* ``qfilters``: ``QFiltersKVCache`` (key-SVD filter from the first 128 keys, sign -1,
  4 sinks, recent budget/2), K/V stored in the model's dtype;
* ``qfilters-kv8`` / ``qfilters-kv4``: the same with ``kv_bits`` 8 / 4 (group size 64);
* ``mlx-quantized-kv8`` / ``mlx-quantized-kv4``: mlx-lm's ``QuantizedKVCache`` (full length);
* ``full``: mlx-lm's ``KVCache`` (full length, reference).

Filling: each layer's cache is fed the prompt's K/V in 2,048-token calls (mlx-lm's
``prefill_step_size``), so evictions run as in a prefill; the K/V are seeded random
normal rows of the model's shapes, not the model's own prefill (the decode cost and the
bytes depend on shapes and budget, not on values; a real 8k prefill of every arm would
take most of an hour on this shared machine). Decode: the real model, one token per
call (``mx.eval`` per step), ``--rounds`` rounds of ``--steps`` steps interleaved over the
arms (load drifts hit every arm alike); tokens/s from the median round. KV bytes: what the
caches hold (``nbytes``: buffers, plus scores,
positions and filter for ours; quantized: packed words + scales + biases).

Usage: ``PYTHONPATH=python python bench/bench_quantized.py [--prompts 4096,8192] [--budget 512]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import mlx.core as mx
from common import RESULTS, int_list, load_model, md_table, run_meta, write_results

OUT = RESULTS / "quantized.json"
ARMS = ("full", "mlx-quantized-kv8", "mlx-quantized-kv4", "qfilters", "qfilters-kv8", "qfilters-kv4")


def make(arm: str, budget: int, n_layers: int, head_dim: int) -> list:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from qfilters_mlx import KVCacheConfig
    from qfilters_mlx.cache.kv_cache import build_cache

    if arm == "full":
        return [KVCache() for _ in range(n_layers)]
    if arm.startswith("mlx-quantized-kv"):
        return [QuantizedKVCache(group_size=64, bits=int(arm[-1])) for _ in range(n_layers)]
    bits = int(arm[-1]) if arm.startswith("qfilters-kv") else None
    cfg = KVCacheConfig(head_dim=head_dim, qfilters_budget=budget, qfilters_n_sink=common.N_SINK,
                        qfilters_calib_tokens=common.CALIB, qfilters_filter_source="keys",
                        qfilters_sign=common.SIGN, kv_bits=bits)
    return [build_cache(cfg, layer_idx=i) for i in range(n_layers)]


def fill(caches, T: int, n_kv: int, head_dim: int, chunk: int = common.PREFILL_STEP) -> None:
    """Feed ``T`` seeded random K/V rows per layer in ``chunk``-token calls."""
    for i, c in enumerate(caches):
        for s in range(0, T, chunk):
            L = min(chunk, T - s)
            k, v = mx.random.normal((2, 1, n_kv, L, head_dim), key=mx.random.key(1000 * i + s // chunk))
            mx.eval(c.update_and_fetch(k, v))


def decode(model, caches, steps: int) -> float:
    """Seconds for ``steps`` model decode steps (one token per call, logits evaluated)."""
    y = mx.array([[1]], mx.uint32)
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(steps):
        logits = model(y, cache=caches)
        y = mx.argmax(logits[:, -1:], axis=-1).astype(mx.uint32)
        mx.eval(y)
    mx.synchronize()
    return time.perf_counter() - tic


def kept(c) -> int:
    return c.size() if hasattr(c, "config") else c.offset  # mlx-lm's caches: everything


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int_list, default=[4096, 8192])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="decode steps per arm and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the arms (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    model, _ = load_model()
    from qfilters_mlx.model_info import model_dims

    n_layers, n_kv, head_dim = model_dims(model)
    arms = args.arms.split(",")
    rows = []
    for T in args.prompts:
        caches = {}
        for arm in arms:
            caches[arm] = make(arm, args.budget, n_layers, head_dim)
            fill(caches[arm], T, n_kv, head_dim)
            decode(model, caches[arm], args.warmup)
        per_step = {arm: [] for arm in arms}
        for _ in range(args.rounds):  # interleaved: load drifts hit every arm alike
            for arm in arms:
                per_step[arm].append(decode(model, caches[arm], args.steps) / args.steps)
        for arm in arms:
            held = sum(c.nbytes for c in caches[arm])
            sec = statistics.median(per_step[arm])
            rows.append({"prompt": T, "arm": arm,
                         "budget": None if arm.startswith(("full", "mlx")) else args.budget,
                         "tokens_per_s": 1.0 / sec, "ms_per_token": 1e3 * sec,
                         "ms_per_token_rounds": [1e3 * x for x in per_step[arm]],
                         "kv_bytes": held, "kept_tokens": kept(caches[arm][0])})
            print(f"{T} {arm}: {rows[-1]['tokens_per_s']:.2f} tok/s, {held / 2**20:.2f} MiB", flush=True)
        del caches
    data = {"meta": run_meta(budget=args.budget, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                             note="2 cores shared with 5 other jobs: absolute speeds are noisy"),
            "rows": rows}
    write_results(args.out, data, markdown(data))
    print(markdown(data))


def markdown(data: dict) -> str:
    m = data["meta"]
    lines = ["# Decode speed and KV bytes: eviction + quantized storage", "",
             f"SmolLM2-135M-Instruct float32, budget {m['budget']} (ours); per arm the median over "
             f"{m['rounds']} interleaved rounds of {m['steps']} decode steps (after {m['warmup']}); "
             "caches filled with seeded random K/V in 2,048-token calls "
             f"(bench/bench_quantized.py). Machine: {m['machine']}, load at start {m['loadavg_start']} "
             "(shared: speeds are noisy).", ""]
    header = ["prompt", "arm", "kept tokens", "decode tok/s", "ms/token", "KV bytes (MiB)", "vs full"]
    full = {r["prompt"]: r["kv_bytes"] for r in data["rows"] if r["arm"] == "full"}
    body = [[r["prompt"], r["arm"], r["kept_tokens"], f"{r['tokens_per_s']:.2f}", f"{r['ms_per_token']:.1f}",
             f"{r['kv_bytes'] / 2**20:.2f}",
             f"1/{full[r['prompt']] / r['kv_bytes']:.1f}" if r["prompt"] in full else ""]
            for r in data["rows"]]
    return "\n".join(lines + md_table(header, body, "rlrrrrr")) + "\n"


if __name__ == "__main__":
    main()
