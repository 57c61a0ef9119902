"""Decode step and prefill of the real model with head groups against the one-budget cache.

SmolLM2-135M-Instruct (float32, 30 layers, 3 KV heads) with the calibrated query filter
(``bench/results/smollm2_filters.safetensors``). Two arms per budget B, at the same tokens
held (up to the rounding of the small budget):

* ``one``: ``KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=B))``: every head at B;
* ``groups``: ``heads=`` :func:`layout`: ``--big-heads`` heads (head 0 of layers spread evenly
  over the depth) at ``--multiple`` x B, every other head at the small budget that keeps the
  total (rounded down), so each layer with a big head holds two groups
  (:class:`~qfilters_mlx.cache.head_groups.HeadGroupsKVCache`); recent window B/2 for the
  small heads (the default) and the small heads' window for the big ones.

Which heads are big does not change the cost; how many layers hold two groups does.

Per context N (tokens of the reference text): ``--prefill-rounds`` rounds, each building
fresh caches for both arms (order alternating) and timing the prefill of N tokens (mlx-lm's
2,048-token chunks, one ``mx.eval`` of the logits per chunk); then, on the last round's
caches, ``--rounds`` rounds of ``--steps`` greedy decode steps per arm (order alternating;
one step = the model on one token + ``mx.eval`` of the logits, as ``generate_step``), the
median step per round and arm. Figures: the median over rounds of the per-round ratio
groups / one (paired: both arms ran back to back under the same load).

Usage::

    python bench/bench_head_groups_decode.py [--budgets 128,256] [--contexts 1024,4096]

Writes ``bench/results/head_groups_decode.json`` and ``.md``.
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

FILTERS = common.RESULTS / "smollm2_filters.safetensors"
N_SINK = 4


def layout(n_layers: int, n_kv: int, budget: int, big_heads: int, multiple: int):
    """``HeadBudgets``: head 0 of ``big_heads`` layers spread over the depth at
    ``multiple * budget``, the other heads at ``floor((n_layers n_kv budget - big_heads
    multiple budget) / (n_layers n_kv - big_heads))``; recent windows ``small // 2``."""
    from qfilters_mlx import HeadBudgets

    big = multiple * budget
    small = (n_layers * n_kv * budget - big_heads * big) // (n_layers * n_kv - big_heads)
    layers = {round(i * n_layers / big_heads) for i in range(big_heads)}
    budgets = [[big if (h == 0 and i in layers) else small for h in range(n_kv)] for i in range(n_layers)]
    recents = [[small // 2] * n_kv for _ in range(n_layers)]
    return HeadBudgets(budgets, recents)


def build(model, arm: str, budget: int, big_heads: int, multiple: int):
    from qfilters_mlx import KVCacheBuilder, KVCacheConfig
    from qfilters_mlx.model_info import model_dims

    cfg = KVCacheConfig(qfilters_budget=budget, qfilters_filters=str(FILTERS))
    if arm == "one":
        return KVCacheBuilder.for_model(model, cfg)
    n_layers, n_kv = model_dims(model)[:2]
    heads = layout(n_layers, n_kv, budget, big_heads, multiple)
    return KVCacheBuilder.for_model(model, cfg, heads=heads)


def prefill(model, caches, tokens) -> float:
    t0 = time.perf_counter()
    for i in range(0, tokens.size, common.PREFILL_STEP):
        mx.eval(model(tokens[None, i:i + common.PREFILL_STEP], cache=caches))
    return time.perf_counter() - t0


def steps(model, caches, token, n: int) -> tuple[list[float], mx.array]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = model(token, cache=caches)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
        token = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
    return times, token


def held_bytes(caches) -> int:
    return sum(c.nbytes for c in caches)


def run(args) -> dict:
    model, tokenizer = common.load_model()
    texts = common.prompts(tokenizer, args.contexts)
    cells = []
    for budget in args.budgets:
        for N in args.contexts:
            pre = {"one": [], "groups": []}
            for r in range(args.prefill_rounds):
                order = ("one", "groups") if r % 2 == 0 else ("groups", "one")
                caches = {}
                for arm in order:
                    caches[arm] = build(model, arm, budget, args.big_heads, args.multiple)
                    pre[arm].append(prefill(model, caches[arm], texts[N]))
            token = {arm: texts[N][None, -1:] for arm in caches}
            dec = {"one": [], "groups": []}
            for r in range(args.rounds):
                for arm in (("one", "groups") if r % 2 == 0 else ("groups", "one")):
                    t, token[arm] = steps(model, caches[arm], token[arm], args.steps)
                    dec[arm].append(statistics.median(t[args.warmup:]))
            cell = {"budget": budget, "context": N,
                    "bytes": {arm: held_bytes(c) for arm, c in caches.items()},
                    "prefill_s": pre, "step_median_s": dec,
                    "prefill_ratio": statistics.median(g / o for g, o in zip(pre["groups"], pre["one"])),
                    "step_ratio": statistics.median(g / o for g, o in zip(dec["groups"], dec["one"]))}
            cells.append(cell)
            print(f"B={budget} N={N}: step x{cell['step_ratio']:.3f}, prefill x{cell['prefill_ratio']:.3f}, "
                  f"bytes {cell['bytes']}", flush=True)
    return {"cells": cells}


def markdown(res: dict, command: str) -> str:
    m = res["meta"]
    lines = ["# Head groups against the one-budget cache: decode step and prefill (SmolLM2-135M, float32)", "",
             f"Command: `{command}`; {m['machine']}, load average at start {m['loadavg_start'][0]:.1f}. "
             f"Layout: {res['args']['big_heads']} heads at {res['args']['multiple']}x the budget, the "
             "others at the rest (module docstring). Ratios: groups / one, median over paired rounds "
             f"({res['args']['rounds']} rounds of {res['args']['steps']} decode steps; "
             f"{res['args']['prefill_rounds']} prefills per arm).", ""]
    rows = []
    for c in res["cells"]:
        one, grp = c["step_median_s"]["one"], c["step_median_s"]["groups"]
        rows.append([c["budget"], f"{c['context']:,}", f"{statistics.median(one) * 1e3:.1f}",
                     f"{statistics.median(grp) * 1e3:.1f}", f"**{c['step_ratio']:.3f}**",
                     f"{statistics.median(c['prefill_s']['one']):.2f}",
                     f"{statistics.median(c['prefill_s']['groups']):.2f}", f"{c['prefill_ratio']:.3f}",
                     f"{c['bytes']['one'] / 1e6:.2f} / {c['bytes']['groups'] / 1e6:.2f}"])
    lines += common.md_table(["budget", "context", "step one (ms)", "step groups (ms)", "step ratio",
                              "prefill one (s)", "prefill groups (s)", "prefill ratio",
                              "bytes held one / groups (MB)"], rows, "rrrrrrrrr")
    return "\n".join(lines + [""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=common.int_list, default=[128, 256])
    p.add_argument("--contexts", type=common.int_list, default=[1024, 4096])
    p.add_argument("--big-heads", type=int, default=8)
    p.add_argument("--multiple", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--prefill-rounds", type=int, default=2)
    p.add_argument("--out", default=str(common.RESULTS / "head_groups_decode.json"))
    args = p.parse_args()
    meta = common.run_meta()
    res = {"meta": meta, "args": vars(args), **run(args)}
    command = "python bench/bench_head_groups_decode.py " + " ".join(
        a for a in os.sys.argv[1:])
    res["command"] = command
    out = common.write_results(common.Path(args.out), res, markdown(res, command))
    print(markdown(res, command))
    print("wrote", *out)


if __name__ == "__main__":
    main()
