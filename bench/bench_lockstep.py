"""Prefill and decode speed of several caches in lockstep: arms take turns chunk by chunk and token by token.

``bench_generate.py`` runs each arm's 200 tokens back to back, so on a shared
machine a load change between two arms' runs moves their ratio by more than the
caches differ. Here the arms take turns: the prompt is prefilled in 2,048-token
chunks (mlx-lm's ``prefill_step_size``; after each chunk the caches' state is
evaluated, as mlx-lm does), one chunk per arm in an order that rotates, and the
decode steps are interleaved the same way: round ``i`` generates one greedy token with
each arm, in an order that rotates every round, timing each step (model call +
argmax + ``mx.eval``, as ``generate_step`` does per token, without its
one-step-ahead ``async_eval`` overlap, which is the same for every arm). Steps of
the same round ran within a fraction of a second of each other, so the
per-round ratio of two arms' step times is paired; reported: the median step
time per arm and the median over rounds of each arm's step time relative to
``rotating`` and ``full`` (tokens/s ratio = inverse time ratio).

Arms are those of ``bench_generate.py`` (same settings: n_sink 4, recent
budget/2, key-SVD filter sign -1 over the first 128 keys); by default the full
cache, ``RotatingKVCache``, qfilters-cpp and veloxquant-mlx's Q-Filters cache,
all budgets of one prompt length in one lockstep group (the full cache once).
Ratios to veloxquant-mlx are in the JSON (``*_vs_velox``).

Usage::

    python bench/bench_lockstep.py                     # 1k, 4k, 8k; budgets 256, 512
    python bench/bench_lockstep.py --lengths 1024 --budgets 256 --steps 32   # quick look

Writes ``bench/results/lockstep.{json,md}``.
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

from common import ARMS, PREFILL_STEP, make_caches  # noqa: E402

DEFAULT_ARMS = ("full", "rotating", "qfilters-cpp", "velox-qfilters")


def prefill_lockstep(model, prompt: mx.array, arms: list) -> tuple[dict, dict]:
    """Fresh caches per arm, filled with ``prompt`` in ``PREFILL_STEP``-token chunks, the arms
    taking turns chunk by chunk (order rotating); after each chunk the caches' state is
    evaluated, as mlx-lm's prefill does. Returns ``{arm: (caches, first token)}`` and
    ``{arm: [seconds per chunk]}``."""
    built = {a: make_caches(a[0], a[1] or 0, model=model) for a in arms}
    state, times = {}, {a: [] for a in arms}
    starts = list(range(0, prompt.size, PREFILL_STEP))
    for i, s0 in enumerate(starts):
        chunk = prompt[s0:s0 + PREFILL_STEP][None]
        for a in arms[i % len(arms):] + arms[:i % len(arms)]:
            caches, ctx = built[a]
            mx.synchronize()
            t0 = time.perf_counter()
            with ctx:
                logits = model(chunk, cache=caches)
            nxt = mx.argmax(logits[0, -1])
            mx.eval(nxt, [c.state for c in caches])
            times[a].append(time.perf_counter() - t0)
            state[a] = (caches, int(nxt.item()))
    return state, times


def step(model, caches, tok: int) -> tuple[int, float]:
    """One greedy decode step; returns (next token, seconds)."""
    mx.synchronize()
    t0 = time.perf_counter()
    logits = model(mx.array([[tok]]), cache=caches)
    nxt = mx.argmax(logits[0, -1])
    mx.eval(nxt)
    return int(nxt.item()), time.perf_counter() - t0


def run_group(model, prompt: mx.array, arms: list[tuple[str, int | None]], steps: int,
              warmup: int) -> tuple[dict, dict]:
    state, prefill_times = prefill_lockstep(model, prompt, arms)
    times = {a: [] for a in arms}
    for r in range(steps + warmup):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for a in order:
            caches, tok = state[a]
            tok, dt = step(model, caches, tok)
            state[a] = (caches, tok)
            if r >= warmup:
                times[a].append(dt)
    return prefill_times, times


def summarize(n: int, prefill_times: dict, times: dict) -> list[dict]:
    rows = []
    ref_full = next((a for a in times if a[0] == "full"), None)
    for (arm, b), ts in times.items():
        pf = prefill_times[(arm, b)]
        row = {"length": n, "budget": b, "arm": arm, "steps": len(ts),
               "step_ms": 1e3 * statistics.median(ts), "tps": 1.0 / statistics.median(ts),
               "prefill_s": sum(pf), "prompt_tps": n / sum(pf)}
        for name, ref in (("full", ref_full), ("rotating", ("rotating", b) if b else None),
                          ("velox", ("velox-qfilters", b) if b else None)):
            if ref is None or ref not in times or ref == (arm, b):
                continue
            # tokens/s ratio of this arm to ref, per round, median over rounds
            row[f"tps_vs_{name}"] = statistics.median(r / t for t, r in zip(ts, times[ref]))
            # prompt tokens/s ratio: chunk by chunk interleaved, so the totals are paired
            row[f"prompt_vs_{name}"] = sum(prefill_times[ref]) / sum(pf)
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    L = [f"SmolLM2-135M-Instruct float32 on {meta['machine']}, mlx {meta['mlx']}, mlx-lm {meta['mlx_lm']}; "
         f"{meta['steps']} lockstep decode rounds after {meta['warmup']} warm-up rounds; load average "
         f"{meta['loadavg_start'][0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end.", ""]
    f = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    L += common.md_table(
        ["prompt", "budget", "arm", "prompt tok/s", "prompt x full", "prompt x rotating", "step ms (median)",
         "gen tok/s", "gen x rotating (paired)", "gen x full (paired)", "prompt / gen x velox"],
        [[r["length"], r["budget"] or "-", r["arm"], f"{r['prompt_tps']:.1f}", f(r.get("prompt_vs_full")),
          f(r.get("prompt_vs_rotating")), f"{r['step_ms']:.1f}", f"{r['tps']:.2f}", f(r.get("tps_vs_rotating")),
          f(r.get("tps_vs_full")), f"{f(r.get('prompt_vs_velox'))} / {f(r.get('tps_vs_velox'))}"] for r in rows],
        "rrlrrrrrrrr")
    L += ["", "gen x ...: per round, (1 / this arm's step time) / (1 / the reference arm's step time in the "
          "same round), median over rounds. prompt x ...: ratio of total prefill times, the arms' chunks "
          f"({PREFILL_STEP} tokens) having run in turns."]
    return "\n".join(L) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=common.int_list, default=[1024, 4096, 8192])
    p.add_argument("--budgets", type=common.int_list, default=[256, 512])
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(DEFAULT_ARMS))
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {ARMS}")
    args.arms, velox_note = common.available(args.arms)
    model, tokenizer = common.load_model()
    prompts = common.prompts(tokenizer, args.lengths)
    meta = common.run_meta(steps=args.steps, warmup=args.warmup, arms=args.arms, velox=velox_note,
                           prompt_source=common.PROMPT_SOURCE)
    rows = []
    for n, prompt in prompts.items():
        # one lockstep group per prompt: the full cache once, every other arm at every budget
        arms = [(a, None) for a in args.arms if a == "full"]
        arms += [(a, b) for b in args.budgets for a in args.arms if a != "full"]
        got = summarize(n, *run_group(model, prompt, arms, args.steps, args.warmup))
        rows += got
        for r in got:
            print(f"N={n:5d} b={r['budget']} {r['arm']:20s} prompt {r['prompt_tps']:6.1f} tok/s "
                  f"x full {r.get('prompt_vs_full', float('nan')):.3f}  step {r['step_ms']:8.1f} ms  "
                  f"x rotating {r.get('tps_vs_rotating', float('nan')):.3f}  "
                  f"x full {r.get('tps_vs_full', float('nan')):.3f}", flush=True)
        meta["loadavg_end"] = os.getloadavg()
        if not args.no_write:
            common.write_results(args.out / "lockstep.json", {"meta": meta, "rows": rows}, markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
