"""Attention cost of one decode step when KV heads are stored at their own sizes (retrieval heads
with a big budget, the others a small one) against one budget for every head, at the same bytes (up to a token per head).

A proxy for the cache the retrieval-heads direction would need (the cache itself stores one
budget per layer): SmolLM2-135M shapes (30 layers, 9 query heads over 3 KV heads, D 64,
float32, batch 1). One step, per layer: write the new token's key and value in place, then
attention of the 9 query heads over the stored keys. ``one``: every KV head holds ``budget``
tokens (one ``[1, 3, budget, 64]`` array per layer, one attention call). ``groups``: the heads of
``bench/results/kv_directions.json``'s arm at that budget (``--arm``), each layer's heads grouped
by their budget, one array and one attention call per group, the query heads of each group
gathered and the outputs put back in head order (two groups in a layer with a big head: the
big heads, and the others stored at the largest of their budgets, which differ by the one token
of the left-over spread). Timed as ``--rounds`` alternating pairs of ``--steps`` steps (one
``mx.eval`` per step); the figure is the median over rounds of the ratio of the two medians.

Usage::

    python bench/bench_head_groups_step.py [--arm heads-needle-4q] [--budget 128]

Writes ``bench/results/head_groups_step.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import common  # noqa: F401  (fast BLAS before MLX)
import mlx.core as mx
import numpy as np

L, HQ, HKV, D = 30, 9, 3, 64
OUT = common.RESULTS / "head_groups_step.json"


def layouts(budgets, big: int) -> list:
    """Per layer: ``[(kv_heads, size)]``: the heads at ``big`` and the others (their budgets differ by
    at most the one token of the left-over spread: stored at the largest of them)."""
    out = []
    for row in budgets:
        hs_big = [h for h, b in enumerate(row) if b == big]
        rest = [h for h, b in enumerate(row) if b != big]
        out.append([(hs, s) for hs, s in ((rest, max((row[h] for h in rest), default=0)), (hs_big, big)) if hs])
    return out


def make_state(layout, rng):
    """Per layer, per group: ``(keys, values, query head indices, output order)``."""
    state = []
    for groups in layout:
        per = []
        order = []
        for hs, b in groups:
            k = mx.array(rng.standard_normal((1, len(hs), b, D)).astype(np.float32))
            v = mx.array(rng.standard_normal((1, len(hs), b, D)).astype(np.float32))
            q_idx = mx.array([h * (HQ // HKV) + g for h in hs for g in range(HQ // HKV)])
            per.append([k, v, q_idx])
            order += [h * (HQ // HKV) + g for h in hs for g in range(HQ // HKV)]
        inverse = mx.array(np.argsort(order)) if len(per) > 1 else None
        state.append((per, inverse))
    mx.eval([x for per, _ in state for g in per for x in g])
    return state


def step(state, q, new_k, new_v, slot: int):
    outs = []
    for per, inverse in state:
        parts = []
        for g in per:
            k, v, q_idx = g
            n = k.shape[1]
            s = slot % k.shape[2]
            k[:, :, s:s + 1] = new_k[:, :n]
            v[:, :, s:s + 1] = new_v[:, :n]
            qq = q if inverse is None else q[:, q_idx]
            parts.append(mx.fast.scaled_dot_product_attention(qq, k, v, scale=D ** -0.5))
        o = parts[0] if inverse is None else mx.concatenate(parts, axis=1)[:, inverse]
        outs.append(o)
    mx.eval(outs, [x for per, _ in state for g in per for x in g[:2]])


def time_steps(state, steps: int, rng) -> float:
    q = mx.array(rng.standard_normal((1, HQ, 1, D)).astype(np.float32))
    kv = mx.array(rng.standard_normal((1, HKV, 1, D)).astype(np.float32))
    mx.eval(q, kv)
    times = []
    for i in range(steps + 5):
        tic = time.perf_counter()
        step(state, q, kv, kv, i)
        if i >= 5:
            times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arm", default="heads-needle-4q")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    res = json.loads((common.RESULTS / "kv_directions.json").read_text())
    from qfilters_mlx.evaluation.retrieval_heads import split_budgets

    name = a.arm
    _, _, m = name.split("-")
    mult, _, k = m.rstrip("q").partition("x")
    ranking = np.array(res["rankings"]["needle"]["values"])
    budgets, _, top = split_budgets(ranking, a.budget, int(mult) * a.budget, None if k else a.budget // 2, 4,
                                    heads=int(k) if k else None)
    assert int(np.sum(budgets)) == L * HKV * a.budget
    rng = np.random.default_rng(0)
    one = make_state(layouts([[a.budget] * HKV] * L, 0), rng)
    lay = layouts(budgets, int(mult) * a.budget)
    held = sum(len(hs) * size for groups in lay for hs, size in groups)
    groups = make_state(lay, rng)
    rounds = []
    for _ in range(a.rounds):
        t1 = time_steps(one, a.steps, rng)
        t2 = time_steps(groups, a.steps, rng)
        rounds.append({"one_ms": t1 * 1e3, "groups_ms": t2 * 1e3, "ratio": t2 / t1})
        print(rounds[-1], flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    out = {"meta": common.run_meta(python=sys.version.split()[0]), "arm": name, "budget": a.budget,
           "big_heads": len(top), "layers_split": sum(len(g) > 1 for g in lay),
           "tokens_budgeted": int(np.sum(budgets)), "tokens_stored": held, "rounds": rounds, "median_ratio": ratio,
           "command": " ".join(["python bench/bench_head_groups_step.py", *sys.argv[1:]])}
    rows = [[i + 1, f"{r['one_ms']:.3f}", f"{r['groups_ms']:.3f}", f"{r['ratio']:.3f}"] for i, r in enumerate(rounds)]
    md = ["# Attention step over KV heads at their own sizes vs one budget", "", "Command:", "",
          f"    {out['command']}", "",
          f"Arm `{name}` at budget {a.budget}: {len(top)} heads at {int(mult) * a.budget} tokens in "
          f"{out['layers_split']} of 30 layers; per-head budgets sum to {out['tokens_budgeted']} tokens "
          f"(one budget: {L * HKV * a.budget}), {held} stored (each layer's other heads at the largest of "
          f"their budgets, one token apart). Median step (ms) per round, {a.steps} steps; load average at the start "
          f"{out['meta']['loadavg_start'][0]:.1f} on {out['meta']['machine']}:", ""]
    md += common.md_table(["round", "one budget", "head groups", "ratio"], rows)
    md += ["", f"Median ratio over rounds: {ratio:.3f}.", ""]
    common.write_results(OUT, out, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
