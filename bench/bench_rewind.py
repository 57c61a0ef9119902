"""What exact rewinds cost a decode step: the rewind journal on and off, paired.

Shapes of SmolLM2-135M (30 layers, H_kv 3, D 64, float32, B 1), cache only (no
model). Arms: ``qfilters-cpp`` with ``max_rewind`` 0 (no journal), 16
(the default) and 64, and mlx-lm's ``RotatingKVCache(max_size=budget, keep=4)``
as the yardstick. Every arm is prefilled with the same ``--context`` seeded
random keys/values in 2,048-token chunks, then the arms decode in lockstep: one
step each per round (``make_mask(1)``, ``update_and_fetch`` of one row on every
layer, one ``mx.eval`` of the returned arrays, as ``bench.common.cache_step_times``
times it), so machine load hits every arm in the same round. Reported: median ms
per step, and the median over rounds of each arm's step time divided by the
journal-off arm's in the same round (paired ratio), plus the journal's bytes
(``journal_nbytes``) summed over layers.

``--model`` measures the same arms inside the real model instead (SmolLM2-135M-Instruct
float32, the calibrated filters of ``bench/results/smollm2_filters.safetensors``): every arm
prefills the same ``--context``-token prompt (2,048-token steps), then the arms decode
greedily in rounds, each arm ``--tokens-per-round`` tokens per round in a shuffled order
(seeded by the round), timed per token with the model's forward pass; reported as the median
ms per token and the median (and quartiles) over rounds of each arm's time per token over the
journal-off arm's in the same round. Writes ``rewind_model.{json,md}``.

Usage::

    python bench/bench_rewind.py             # budgets 256 and 512, writes bench/results/rewind.{json,md}
    python bench/bench_rewind.py --quick     # 4 layers, few steps, no files written
    python bench/bench_rewind.py --model --depths 0,3,16 --context 4096 --rounds 30
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

H_KV, HEAD_DIM, DTYPE = 3, 64, mx.float32
DEPTHS = (0, 16, 64)


def build(arm: str, budget: int, n_layers: int) -> list:
    if arm == "rotating":
        return common.make_caches("rotating", budget, n_layers=n_layers, head_dim=HEAD_DIM)[0]
    from qfilters_mlx import QFiltersKVCache

    depth = int(arm.rsplit("-", 1)[1])
    cfg = common.qf_config(budget, "keys", HEAD_DIM)
    return [QFiltersKVCache(cfg, layer_idx=i, backend="cpp", max_rewind=depth) for i in range(n_layers)]


def prefill(caches: list, context: int, seed: int) -> None:
    kv = mx.random.normal((2, 1, H_KV, context, HEAD_DIM), dtype=DTYPE, key=mx.random.key(seed))
    for start in range(0, context, common.PREFILL_STEP):
        chunk = kv[:, :, :, start:start + common.PREFILL_STEP]
        mx.eval([c.update_and_fetch(chunk[0], chunk[1]) for c in caches])


def step(caches: list, rows: list) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mask = caches[0].make_mask(1, return_array=False, window_size=None)
    outs = [c.update_and_fetch(k, v) for c, (k, v) in zip(caches, rows)]
    mx.eval(outs, mask if isinstance(mask, mx.array) else [])
    mx.synchronize()
    return time.perf_counter() - t0


def run(budget: int, context: int, n_layers: int, steps: int, warmup: int) -> dict:
    arms = [f"qfilters-cpp-depth-{d}" for d in DEPTHS] + ["rotating"]
    caches = {a: build(a, budget, n_layers) for a in arms}
    for a in arms:
        prefill(caches[a], context, seed=1)
    new = mx.random.normal((steps + warmup, n_layers, 2, 1, H_KV, 1, HEAD_DIM), dtype=DTYPE,
                           key=mx.random.key(2))
    mx.eval(new)
    times = {a: [] for a in arms}
    for s in range(steps + warmup):
        rows = [(new[s, i, 0], new[s, i, 1]) for i in range(n_layers)]
        mx.eval(rows)
        order = arms[s % len(arms):] + arms[:s % len(arms)]  # rotate who goes first
        for a in order:
            t = step(caches[a], rows)
            if s >= warmup:
                times[a].append(t)
    base = times[arms[0]]
    out = {}
    for a in arms:
        ratios = [x / y for x, y in zip(times[a], base)]
        journal = sum(getattr(c, "journal_nbytes", 0) for c in caches[a])
        out[a] = {"median_ms": 1e3 * statistics.median(times[a]),
                  "paired_ratio_vs_depth0": statistics.median(ratios),
                  "journal_bytes": journal, "steps": len(times[a])}
    return out


def run_model(budget: int, context: int, depths, rounds: int, per_round: int) -> dict:
    """Decode inside SmolLM2 (see the module docstring): per arm, seconds per token per round."""
    import random

    from qfilters_mlx import KVCacheBuilder, KVCacheConfig

    model, tokenizer = common.load_model()
    prompt = common.prompts(tokenizer, [context])[context]
    filters = common.ROOT / "bench" / "results" / "smollm2_filters.safetensors"
    arms = [f"qfilters-cpp-depth-{d}" for d in depths] + ["rotating"]
    caches, last, prefill_s = {}, {}, {}
    for a in arms:
        if a == "rotating":
            c = common.make_caches("rotating", budget, n_layers=len(model.layers))[0]
        else:
            depth = int(a.rsplit("-", 1)[1])
            c = list(KVCacheBuilder.for_model(model, KVCacheConfig(
                qfilters_budget=budget, qfilters_filters=str(filters)), max_rewind=depth))
        tic = time.perf_counter()
        for s in range(0, context, common.PREFILL_STEP):
            logits = model(prompt[None, s:s + common.PREFILL_STEP], cache=c)
            mx.eval(logits, [x.state for x in c])
        prefill_s[a] = time.perf_counter() - tic
        print(f"{a}: prefill {prefill_s[a]:.1f} s", flush=True)
        caches[a], last[a] = c, mx.argmax(logits[:, -1], axis=-1)
    times = {a: [] for a in arms}
    for r in range(rounds + 1):  # round 0 warms up
        order = arms[:]
        random.Random(r).shuffle(order)
        for a in order:
            y = last[a]
            mx.synchronize()
            tic = time.perf_counter()
            for _ in range(per_round):
                y = mx.argmax(model(y[:, None], cache=caches[a])[:, -1], axis=-1)
                mx.eval(y)
            if r:
                times[a].append((time.perf_counter() - tic) / per_round)
            last[a] = y
    out = {}
    for a in arms:
        ratios = sorted(x / y for x, y in zip(times[a], times[arms[0]]))
        quart = [ratios[int(q * (len(ratios) - 1))] for q in (0.25, 0.75)]
        journal = sum(getattr(c, "journal_nbytes", 0) for c in caches[a])
        out[a] = {"median_ms": 1e3 * statistics.median(times[a]),
                  "paired_ratio_vs_depth0": statistics.median(ratios), "paired_ratio_quartiles": quart,
                  "journal_bytes": journal, "rounds": len(times[a]), "prefill_s": prefill_s[a]}
    return out


def markdown_model(results: dict, meta: dict) -> str:
    rows = [[key, arm, f"{r['median_ms']:.1f}", f"{r['paired_ratio_vs_depth0']:.3f}x",
             f"{r['paired_ratio_quartiles'][0]:.3f}-{r['paired_ratio_quartiles'][1]:.3f}",
             f"{r['journal_bytes'] / 1024:.0f} KiB"]
            for key, arms in results.items() for arm, r in arms.items()]
    lines = ["# Decode with and without the rewind journal, SmolLM2-135M-Instruct", "",
             f"`python bench/bench_rewind.py --model` on {meta['machine']} (load average at start "
             f"{meta['loadavg_start'][0]:.1f}); float32, greedy, {meta['rounds']} rounds of "
             f"{meta['per_round']} tokens per arm in shuffled order.", ""]
    lines += common.md_table(["budget / context", "arm", "median ms per token", "paired vs depth 0",
                              "quartiles", "journal (all layers)"], rows, "llrrrr")
    return "\n".join(lines) + "\n"


def markdown(results: dict, meta: dict) -> str:
    rows = []
    for key, arms in results.items():
        for arm, r in arms.items():
            rows.append([key, arm, f"{r['median_ms']:.2f}", f"{r['paired_ratio_vs_depth0']:.2f}x",
                         f"{r['journal_bytes'] / 1024:.0f} KiB"])
    lines = ["# Decode step with and without the rewind journal", "",
             f"`python bench/bench_rewind.py` on {meta['machine']} (load average at start "
             f"{meta['loadavg_start'][0]:.1f}); {meta['layers']} layers, H_kv 3, D 64, float32, cache only, "
             f"{meta['steps']} paired rounds.", ""]
    lines += common.md_table(["budget / context", "arm", "median ms per step", "paired vs depth 0",
                              "journal (all layers)"], rows, "llrrr")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=common.int_list, default=[256, 512])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="4 layers, 20 steps, no files written")
    ap.add_argument("--model", action="store_true", help="decode inside SmolLM2 (see above)")
    ap.add_argument("--depths", type=common.int_list, default=list(DEPTHS))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens-per-round", type=int, default=8)
    args = ap.parse_args()
    if args.model:
        budget = args.budgets[0]
        meta = common.run_meta(rounds=args.rounds, per_round=args.tokens_per_round)
        results = {f"{budget} / {args.context}": run_model(budget, args.context, args.depths,
                                                           args.rounds, args.tokens_per_round)}
        md = markdown_model(results, meta)
        print(md)
        for p in common.write_results(common.ROOT / "bench" / "results" / "rewind_model.json",
                                      {"meta": meta, "results": results}, md):
            print("wrote", p)
        return
    if args.quick:
        args.layers, args.steps, args.warmup, args.budgets = 4, 20, 5, [256]
    results = {f"{b} / {args.context}": run(b, args.context, args.layers, args.steps, args.warmup)
               for b in args.budgets}
    meta = common.run_meta(layers=args.layers, steps=args.steps, warmup=args.warmup)
    md = markdown(results, meta)
    print(md)
    if not args.quick:
        for p in common.write_results(common.ROOT / "bench" / "results" / "rewind.json",
                                      {"meta": meta, "results": results}, md):
            print("wrote", p)


if __name__ == "__main__":
    main()
