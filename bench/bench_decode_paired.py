"""Decode speed of several caches in lockstep: one token per arm per round, order rotating.

``bench_generate.py`` runs each arm's 200 tokens back to back, so on a shared
machine a load change between two arms' runs moves their ratio by more than the
caches differ. Here every arm is prefilled with the same prompt (mlx-lm's
``generate_step`` prefill: ``prefill_step_size`` 2048, then the first token),
and the decode steps are interleaved: round ``i`` generates one greedy token with
each arm, in an order that rotates every round, timing each step (model call +
argmax + ``mx.eval``, as ``generate_step`` does per token, without its
one-step-ahead ``async_eval`` overlap, which is the same for every arm). Steps of
the same round ran within a fraction of a second of each other, so the
per-round ratio of two arms' step times is paired; reported: the median step
time per arm and the median over rounds of each arm's step time relative to
``rotating`` and ``full`` (tokens/s ratio = inverse time ratio).

Arms are those of ``bench_generate.py`` (same settings: n_sink 4, recent
budget/2, key-SVD filter sign -1 over the first 128 keys); by default the full
cache, ``RotatingKVCache`` and qfilters-cpp, all budgets of one prompt length in
one lockstep group (the full cache once).

Usage::

    python bench/bench_decode_paired.py                     # 1k, 4k; budgets 256, 512
    python bench/bench_decode_paired.py --lengths 1024 --budgets 256 --steps 32   # quick look

Writes ``bench/results/decode_paired.{json,md}``.
"""

from __future__ import annotations

from bench_generate import ARMS, PREFILL_STEP, PROMPT_START, build, code_version  # noqa: I001  (same folder)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from qfilters_mlx.prepare_model import prepare_model  # noqa: E402
from qfilters_mlx.prompts import source_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ARMS = ("full", "rotating", "qfilters-cpp")


def prefill(model, prompt: mx.array, arm: str, budget: int):
    """Fresh caches for ``arm``, filled with ``prompt`` by mlx-lm; returns (caches, first token)."""
    caches, ctx = build(arm, model, budget)
    with ctx:
        gen = generate_step(prompt, model, max_tokens=1, prompt_cache=caches,
                            prefill_step_size=PREFILL_STEP)
        tok, _ = next(gen)
    return caches, int(tok)


def step(model, caches, tok: int) -> tuple[int, float]:
    """One greedy decode step; returns (next token, seconds)."""
    mx.synchronize()
    t0 = time.perf_counter()
    logits = model(mx.array([[tok]]), cache=caches)
    nxt = mx.argmax(logits[0, -1])
    mx.eval(nxt)
    return int(nxt.item()), time.perf_counter() - t0


def run_group(model, prompt: mx.array, arms: list[tuple[str, int | None]], steps: int,
              warmup: int) -> dict:
    state = {a: prefill(model, prompt, a[0], a[1] or 0) for a in arms}
    times = {a: [] for a in arms}
    for r in range(steps + warmup):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for a in order:
            caches, tok = state[a]
            tok, dt = step(model, caches, tok)
            state[a] = (caches, tok)
            if r >= warmup:
                times[a].append(dt)
    return times


def summarize(n: int, times: dict) -> list[dict]:
    rows = []
    ref_full = next((a for a in times if a[0] == "full"), None)
    for (arm, b), ts in times.items():
        row = {"length": n, "budget": b, "arm": arm, "steps": len(ts),
               "step_ms": 1e3 * statistics.median(ts), "tps": 1.0 / statistics.median(ts)}
        for name, ref in (("full", ref_full), ("rotating", ("rotating", b) if b else None)):
            if ref is None or ref not in times or ref == (arm, b):
                continue
            # tokens/s ratio of this arm to ref, per round, median over rounds
            row[f"tps_vs_{name}"] = statistics.median(r / t for t, r in zip(ts, times[ref]))
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    L = [f"SmolLM2-135M-Instruct float32 on {meta['machine']}, mlx {meta['mlx']}, mlx-lm {meta['mlx_lm']}; "
         f"{meta['steps']} lockstep decode rounds after {meta['warmup']} warm-up rounds; load average "
         f"{meta['loadavg_start'][0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end.", "",
         "| prompt | budget | arm | step ms (median) | tok/s | tok/s x rotating (paired) | tok/s x full (paired) |",
         "|---:|---:|---|---:|---:|---:|---:|"]
    f = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    for r in rows:
        L.append(f"| {r['length']} | {r['budget'] or '-'} | {r['arm']} | {r['step_ms']:.1f} | {r['tps']:.2f} | "
                 f"{f(r.get('tps_vs_rotating'))} | {f(r.get('tps_vs_full'))} |")
    L += ["", "Paired ratio: per round, (1 / this arm's step time) / (1 / the reference arm's step time in the "
          "same round), median over rounds."]
    return "\n".join(L) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[256, 512])
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(DEFAULT_ARMS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {ARMS}")
    if "velox-qfilters" in args.arms:
        try:
            import veloxquant_mlx  # noqa: F401
        except ImportError:
            args.arms.remove("velox-qfilters")

    model, tokenizer = mlx_lm.load(str(prepare_model()))
    ids = tokenizer.encode(source_text(), add_special_tokens=False)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "code": code_version(), "steps": args.steps,
            "warmup": args.warmup, "arms": args.arms, "loadavg_start": os.getloadavg(),
            "prompt_source": f"pydoc_data topics, tokens [{PROMPT_START}, {PROMPT_START}+N)"}
    rows = []
    for n in args.lengths:
        prompt = mx.array(ids[PROMPT_START:PROMPT_START + n])
        # one lockstep group per prompt: the full cache once, every other arm at every budget
        arms = [(a, None) for a in args.arms if a == "full"]
        arms += [(a, b) for b in args.budgets for a in args.arms if a != "full"]
        got = summarize(n, run_group(model, prompt, arms, args.steps, args.warmup))
        rows += got
        for r in got:
            print(f"N={n:5d} b={r['budget']} {r['arm']:20s} {r['step_ms']:8.1f} ms  "
                  f"x rotating {r.get('tps_vs_rotating', float('nan')):.3f}  "
                  f"x full {r.get('tps_vs_full', float('nan')):.3f}", flush=True)
        meta["loadavg_end"] = os.getloadavg()
        if not args.no_write:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "decode_paired.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            (args.out / "decode_paired.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
