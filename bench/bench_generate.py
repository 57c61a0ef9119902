"""End-to-end generation benchmark: qfilters caches against mlx-lm's caches and veloxquant-mlx.

Model: SmolLM2-135M-Instruct, float32, fast BLAS (``qfilters_mlx.assets.prepare_model``).
Prompts: exactly ``N`` tokens (N in 1k, 2k, 4k, 8k) of real English prose, CPython's
reference documentation (``qfilters_mlx.assets.prompts.source_text``), taken from token
``PROMPT_START`` on (disjoint from the 2,048 perplexity-evaluation tokens).
Generation: greedy, exactly ``--max-tokens`` (200) tokens through
``mlx_lm.generate.generate_step`` (EOS is not a stop: every arm does the same work),
prefill chunked by mlx-lm's default ``prefill_step_size`` (2048).

Arms, all built fresh for every run and interleaved in one process (the order
rotates between repeats; values are medians over repeats):

* ``full``: mlx-lm ``KVCache`` (one per layer, independent of the budget);
* ``rotating``: mlx-lm ``RotatingKVCache(max_size=budget, keep=4)``;
* ``qfilters-reference`` / ``qfilters-cpp``: ``QFiltersKVCache`` with
  ``backend`` ``"reference"`` / ``"cpp"``, budget, n_sink 4,
  recent budget/2, filter from the SVD of the first 128 keys with sign -1;
* ``qfilters-cpp-queries`` (``--queries``): the paper's filter from the first
  128 post-RoPE queries, which needs ``observe_queries`` around generation;
* ``velox-qfilters``: the published ``veloxquant-mlx`` package's Q-Filters cache,
  built by its own ``KVCacheBuilder.for_model`` with method ``"qfilters"`` and
  the same budget / n_sink / recent / calib_tokens / sign (its key-SVD path; it
  stores K/V in float16).

Reported per (prompt length, budget, arm): prompt tokens/s (prompt tokens over
the time to the first generated token), generation tokens/s (the remaining
``max_tokens - 1`` tokens over their time, as mlx-lm reports it, and 1 / the
median time between tokens, which is robust to load spikes on a shared machine;
the ratios use the median), peak memory (``mx.get_peak_memory`` reset before
each run), the largest KV-cache size seen after any prefill chunk (sum of every
layer's ``nbytes``, read in mlx-lm's ``prompt_progress_callback``), and the
ratios to ``full`` and to ``rotating``.

Cache share of decode time (replay, default): after each timed run, the run's
own caches (final state: budget rows, or the whole context for ``full``) are
driven through ``--replay-steps`` more decode steps without the model:
``caches[0].make_mask(1)``, ``update_and_fetch`` of one pre-evaluated random
row of the model's K/V shape on every layer, one ``mx.eval`` of every returned
``(keys, values)`` (as in generation: a cache's lazily kept state is paid for in
the step that needs it). Median ms per step divided by the
median decode step time of the run is the cache's share. ``--instrument`` adds a
cross-check on the smallest prompt: every cache's ``update_and_fetch`` (and the
first layer's ``make_mask``) is wrapped during a real decode, the incoming
keys/values are evaluated first (untimed: the model's work), then the call plus
``mx.eval`` of its outputs is timed; this adds one dispatch per layer
that the real run does not pay, so it is an upper bound.

Usage::

    python bench/bench_generate.py            # full run, writes bench/results/generate.{json,md,png}
    python bench/bench_generate.py --quick    # 1k/2k prompts, budget 256, 32 tokens, no files
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from common import ARMS, PREFILL_STEP, make_caches  # noqa: E402
from qfilters_mlx.model_info import model_dims  # noqa: E402


def kv_bytes(caches: list) -> int:
    return int(sum(c.nbytes for c in caches))


# ------------------------------------------------------------------------- one run
def run_once(model, prompt: mx.array, arm: str, budget: int, max_tokens: int,
             instrument: bool = False) -> dict:
    caches, ctx = make_caches(arm, budget, model=model)
    kv_after_chunk = []

    def progress(done, total):
        if 0 < done < total:
            kv_after_chunk.append(kv_bytes(caches))

    timer = CacheTimer(caches) if instrument else None
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base_mem = mx.get_active_memory()
    tokens = []
    with ctx:
        gen = generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=caches,
                            prefill_step_size=PREFILL_STEP, prompt_progress_callback=progress)
        t0 = time.perf_counter()
        tok, _ = next(gen)
        t1 = time.perf_counter()
        prefill_peak = mx.get_peak_memory()
        tokens.append(tok)
        if timer is not None:
            timer.decoding = True
        step_t, tp = [], t1
        for tok, _ in gen:
            tokens.append(tok)
            tn = time.perf_counter()
            step_t.append(tn - tp)
            tp = tn
        t2 = time.perf_counter()
    out = {
        "prompt_tps": prompt.size / (t1 - t0),
        "generation_tps": (len(tokens) - 1) / (t2 - t1),
        "generation_tps_median_step": 1.0 / statistics.median(step_t),
        "peak_memory_mb": mx.get_peak_memory() / 2**20,
        "prefill_peak_over_base_mb": (prefill_peak - base_mem) / 2**20,
        "kv_after_chunk_max_mb": max(kv_after_chunk, default=0) / 2**20,
        "kv_final_mb": kv_bytes(caches) / 2**20,
        "n_generated": len(tokens),
        "tokens_head": tokens[:16],
    }
    if timer is not None:
        out["instrumented_cache_ms_per_step"] = timer.ms_per_step(warmup=8)
    else:
        out["cache_ms_per_step"] = replay_ms_per_step(caches, model)
    del caches
    return out


def replay_ms_per_step(caches: list, model, steps: int = 24, warmup: int = 4) -> float:
    """Cache-only cost of one decode step in the caches' final state, in ms: median over
    ``steps`` steps after ``warmup`` of :func:`common.cache_step_times` with the model's
    K/V row shape."""
    _, n_kv, hd = model_dims(model)
    return 1e3 * statistics.median(common.cache_step_times(caches, steps, warmup, n_kv, hd, seed=0))


class CacheTimer:
    """Times ``update_and_fetch`` (every layer) and ``make_mask`` (first layer) per decode step."""

    def __init__(self, caches: list):
        self.decoding = False
        self.steps: list[float] = []
        self._cur = 0.0
        self.n = len(caches)
        for i, c in enumerate(caches):
            c.update_and_fetch = self._wrap_update(c, c.update_and_fetch, i)
        caches[0].make_mask = self._wrap_mask(caches[0].make_mask)

    def _wrap_update(self, cache, fn, i):
        def wrapped(keys, values):
            if not self.decoding:
                return fn(keys, values)
            mx.eval(keys, values)
            mx.synchronize()
            t0 = time.perf_counter()
            out = fn(keys, values)
            mx.eval(out)
            mx.synchronize()
            self._cur += time.perf_counter() - t0
            if i == self.n - 1:
                self.steps.append(self._cur)
                self._cur = 0.0
            return out
        return wrapped

    def _wrap_mask(self, fn):
        def wrapped(*a, **k):
            if not self.decoding:
                return fn(*a, **k)
            t0 = time.perf_counter()
            m = fn(*a, **k)
            if isinstance(m, mx.array):
                mx.eval(m)
            self._cur += time.perf_counter() - t0
            return m
        return wrapped

    def ms_per_step(self, warmup: int) -> float:
        s = self.steps[warmup:] or self.steps
        return 1e3 * statistics.median(s) if s else float("nan")


# --------------------------------------------------------------------------- driver
def plan(lengths, budgets, arms):
    """(length, budget, arm) rows; ``full`` once per length (budget None)."""
    rows = []
    for n in lengths:
        for arm in arms:
            if arm == "full":
                rows.append((n, None, arm))
            else:
                rows.extend((n, b, arm) for b in budgets)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="prompts 1k/2k, budget 256, 32 tokens, 1 repeat, no result files")
    p.add_argument("--lengths", type=common.int_list, default=[1024, 2048, 4096, 8192])
    p.add_argument("--budgets", type=common.int_list, default=[256, 512])
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", type=lambda s: s.split(","), default=[a for a in ARMS if a != "qfilters-cpp-queries"])
    p.add_argument("--queries", action="store_true", help="add the qfilters-cpp-queries arm")
    p.add_argument("--instrument", action="store_true",
                   help="also run the instrumented cache-share pass (smallest prompt only)")
    p.add_argument("--instrument-tokens", type=int, default=48)
    p.add_argument("--length-order", choices=("asc", "desc"), default="asc",
                   help="run prompt lengths in this order (desc: longest first)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="combine generate.json files of separate runs (rows and ratios recomputed, "
                        "each row from its own run) into --out, without running anything")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args)
    if args.quick:
        args.lengths, args.budgets, args.max_tokens, args.repeats = [1024, 2048], [256], 32, 1
        args.instrument_tokens = 24
    if args.length_order == "desc":
        args.lengths = sorted(args.lengths, reverse=True)
    arms = list(args.arms)
    if args.queries and "qfilters-cpp-queries" not in arms:
        arms.insert(arms.index("qfilters-cpp") + 1 if "qfilters-cpp" in arms else len(arms),
                    "qfilters-cpp-queries")
    arms, velox_note = common.available(arms)
    model, tokenizer = common.load_model()
    prompts = common.prompts(tokenizer, args.lengths)

    rows = plan(args.lengths, args.budgets, arms)
    t_start = time.time()
    meta = common.run_meta(
        model="SmolLM2-135M-Instruct float32", velox=velox_note, prompt_source=common.PROMPT_SOURCE,
        max_tokens=args.max_tokens, repeats=args.repeats, prefill_step_size=PREFILL_STEP,
        n_sink=common.N_SINK, recent="budget // 2", calib_tokens=common.CALIB, sign=common.SIGN,
        kv_budget_plus_chunk_mb={b: kv_bound_mb(model, b) for b in args.budgets},
    )
    # warm-up (pages in the weights, starts BLAS threads)
    run_once(model, prompts[min(args.lengths)], "full", 256, 8)
    raw, instr = [], {}

    def save(final: bool) -> None:
        meta.update(loadavg_end=os.getloadavg(), wall_s=time.time() - t_start, complete=final)
        done = [r for r in rows if any((x["length"], x["budget"], x["arm"]) == r for x in raw)]
        summary = summarize(raw, done, instr)
        md = markdown(summary, meta, args)
        if final:
            print(md)
        if not args.quick:
            common.write_results(args.out / "generate.json", {"meta": meta, "summary": summary, "raw": raw}, md)
            if final:
                plot(summary, args, args.out / "generate.png", meta)
                print(f"wrote {args.out}/generate.json, generate.md, generate.png")

    for rep in range(args.repeats):
        # all arms of one prompt length back to back; arm order alternates between repeats
        for n in args.lengths:
            group = [r for r in rows if r[0] == n]
            for _, b, arm in (group if rep % 2 == 0 else group[::-1]):
                r = run_once(model, prompts[n], arm, b or 0, args.max_tokens)
                r.update({"length": n, "budget": b, "arm": arm, "repeat": rep, "loadavg": os.getloadavg()[0]})
                raw.append(r)
                print(f"rep {rep} N={n:5d} b={b} {arm:22s} prompt {r['prompt_tps']:8.1f} tok/s  "
                      f"gen {r['generation_tps']:6.2f} (median step {r['generation_tps_median_step']:6.2f}) tok/s  "
                      f"cache {r['cache_ms_per_step']:.2f} ms/step  peak {r['peak_memory_mb']:7.1f} MB  "
                      f"kv/chunk {r['kv_after_chunk_max_mb']:6.1f} MB  load {r['loadavg']:.1f}", flush=True)
                save(False)
    if args.instrument:
        n0 = min(args.lengths)
        for n, b, arm in (r for r in rows if r[0] == n0):
            r = run_once(model, prompts[n], arm, b or 0, args.instrument_tokens, instrument=True)
            instr[(n, b, arm)] = r["instrumented_cache_ms_per_step"]
            print(f"instrumented N={n:5d} b={b} {arm:22s} cache {instr[(n, b, arm)]:.3f} ms/step", flush=True)
    save(True)


def merge(args) -> None:
    """Rows of several runs in one table (each (length, budget, arm) from the run that measured it)."""
    runs = [json.loads(Path(f).read_text()) for f in args.merge]
    raw = [dict(r, run=i) for i, run in enumerate(runs) for r in run["raw"]]
    keys = list(dict.fromkeys((r["length"], r["budget"], r["arm"]) for r in raw))
    order = {a: i for i, a in enumerate(ARMS)}
    keys.sort(key=lambda k: (k[0], k[1] or 0, order.get(k[2], 99)))
    summary = summarize(raw, keys, {})
    meta = dict(runs[0]["meta"])
    meta["runs"] = [r["meta"] for r in runs]
    meta["repeats"] = max(len({(r["run"], r["repeat"]) for r in raw if r["length"] == n})
                          for n in {r["length"] for r in raw})
    meta["loadavg_start"] = [max(r["meta"]["loadavg_start"][0] for r in runs)] * 3
    meta["loadavg_end"] = [max(r["meta"]["loadavg_end"][0] for r in runs)] * 3
    meta["complete"] = all(r["meta"].get("complete") for r in runs)
    meta["kv_budget_plus_chunk_mb"] = {}
    for r in runs:
        meta["kv_budget_plus_chunk_mb"].update({int(b): v for b, v in r["meta"]["kv_budget_plus_chunk_mb"].items()})
    args.budgets = sorted(meta["kv_budget_plus_chunk_mb"])
    md = markdown(summary, meta, args)
    md += "\nMerged from " + ", ".join(
        f"run {i}: prompts {sorted({r['length'] for r in run['raw']})}, "
        f"load {run['meta']['loadavg_start'][0]:.1f}->{run['meta']['loadavg_end'][0]:.1f}"
        for i, run in enumerate(runs)) + " (runs overlapped in time; ratios compare rows of the same run).\n"
    print(md)
    common.write_results(args.out / "generate.json", {"meta": meta, "summary": summary, "raw": raw}, md)
    plot(summary, args, args.out / "generate.png", meta)
    print(f"wrote {args.out}/generate.json, generate.md, generate.png")


def kv_bound_mb(model, budget: int) -> float:
    """K+V float32 bytes of ``budget + prefill_step_size`` tokens over every layer."""
    n_layers, n_kv, hd = model_dims(model)
    return n_layers * (budget + PREFILL_STEP) * n_kv * hd * 4 * 2 / 2**20


def summarize(raw, rows, instr) -> list[dict]:
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    out = []
    for n, b, arm in rows:
        rs = [r for r in raw if (r["length"], r["budget"], r["arm"]) == (n, b, arm)]
        s = {"length": n, "budget": b, "arm": arm, "repeats": len(rs)}
        for k in ("prompt_tps", "generation_tps", "peak_memory_mb", "prefill_peak_over_base_mb",
                  "kv_after_chunk_max_mb", "kv_final_mb"):
            s[k] = med(rs, k)
        s["generation_tps_all"] = [r["generation_tps"] for r in rs]
        s["tokens_head"] = rs[0]["tokens_head"]
        s["generation_tps_median_step"] = med(rs, "generation_tps_median_step")
        s["step_ms"] = 1e3 / s["generation_tps_median_step"]
        s["cache_ms_per_step"] = med(rs, "cache_ms_per_step")
        s["cache_share"] = s["cache_ms_per_step"] / s["step_ms"]
        s["instrumented_cache_ms_per_step"] = instr.get((n, b, arm))
        out.append(s)
    by = {(s["length"], s["budget"], s["arm"]): s for s in out}
    for s in out:
        full = by.get((s["length"], None, "full"))
        rot = by.get((s["length"], s["budget"], "rotating")) if s["budget"] else None
        for ref, name in ((full, "full"), (rot, "rotating")):
            if ref is None:
                continue
            s[f"gen_vs_{name}"] = s["generation_tps"] / ref["generation_tps"]
            s[f"gen_median_vs_{name}"] = s["generation_tps_median_step"] / ref["generation_tps_median_step"]
            s[f"prompt_vs_{name}"] = s["prompt_tps"] / ref["prompt_tps"]
            # paired: the ratio within each repeat (arms of a repeat ran back to back), median
            # over repeats; robust to slow drifts of a shared machine's load
            for key, metric in (("gen", "generation_tps_median_step"), ("prompt", "prompt_tps")):
                s[f"{key}_paired_vs_{name}"] = _paired(raw, s, ref, metric)
    return out


def _paired(raw, row, ref, metric):
    """Median over repeats of row[metric] / ref[metric] measured in the same repeat (and run)."""
    def at(s):
        return {(r.get("run", 0), r["repeat"]): r[metric] for r in raw
                if (r["length"], r["budget"], r["arm"]) == (s["length"], s["budget"], s["arm"])}
    a, b = at(row), at(ref)
    ratios = [a[k] / b[k] for k in a if k in b]
    return statistics.median(ratios) if ratios else None


def fmt(x, spec):
    return "" if x is None else format(x, spec)


def markdown(summary, meta, args) -> str:
    L = [f"SmolLM2-135M-Instruct float32 on {meta['machine']}, mlx {meta['mlx']}, mlx-lm {meta['mlx_lm']}, "
         f"{meta['velox']}; {meta['max_tokens']} greedy tokens, medians over up to {meta['repeats']} interleaved "
         f"repeat(s); load average {meta['loadavg_start'][0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end "
         f"(shared 2-core machine, other jobs running: absolute numbers are low and noisy, compare ratios)."
         + ("" if meta.get("complete") else " PARTIAL: the run had not finished when this was written."), ""]
    L += common.md_table(
        ["prompt", "budget", "arm", "reps", "prompt tok/s", "gen tok/s", "gen tok/s (median step)", "gen x full",
         "gen x rotating", "prompt x full", "peak MB", "KV after chunk MB", "cache ms/step", "cache share"],
        [[s["length"], s["budget"] or "-", s["arm"], s["repeats"], f"{s['prompt_tps']:.0f}",
          f"{s['generation_tps']:.2f}", f"{s['generation_tps_median_step']:.2f}",
          fmt(s.get("gen_paired_vs_full"), ".2f"), fmt(s.get("gen_paired_vs_rotating"), ".2f"),
          fmt(s.get("prompt_paired_vs_full"), ".2f"), f"{s['peak_memory_mb']:.0f}",
          f"{s['kv_after_chunk_max_mb']:.1f}", f"{s['cache_ms_per_step']:.2f}", f"{s['cache_share']:.0%}"]
         for s in summary],
        "rrlrrrrrrrrrrr")
    L += ["", "gen tok/s: (tokens - 1) / decode time, as mlx-lm reports it; gen tok/s (median step): 1 / median "
          "time between generated tokens (robust to load spikes). x full / x rotating: paired ratios, the "
          "ratio of two arms measured in the same repeat (back to back), median over repeats (gen: of the "
          "median-step rates). "
          "KV after chunk: largest sum of the caches' `nbytes` seen after any prefill chunk "
          f"(budget + one {PREFILL_STEP}-token chunk, float32 K+V, all layers: "
          + ", ".join(f"budget {b}: {v:.1f} MB" for b, v in meta["kv_budget_plus_chunk_mb"].items())
          + "). cache ms/step: replay of one decode step's cache calls (make_mask + update_and_fetch on every "
          "layer + one mx.eval) on the run's final caches; cache share = cache ms/step / median step time.", ""]
    L += targets(summary, meta)
    return "\n".join(L) + "\n"


def targets(summary, meta) -> list[str]:
    by = {(s["length"], s["budget"], s["arm"]): s for s in summary}
    L = ["Targets, qfilters-cpp rows:", ""]
    cpp = [s for s in summary if s["arm"] == "qfilters-cpp"]
    for s in cpp:
        n, b = s["length"], s["budget"]
        rot = s.get("gen_paired_vs_rotating")
        full = s.get("gen_paired_vs_full")
        v = by.get((n, b, "velox-qfilters"))
        parts = [f"- N={n} budget {b}: gen {rot and f'{rot:.2f}'}x rotating "
                 f"({'met' if rot is not None and rot >= 0.95 else 'MISSED'} >= 0.95)"]
        if n >= 4096 and full is not None:
            parts.append(f"{full:.2f}x full ({'met' if full > 1 else 'MISSED'} > 1)")
        if v is not None:
            g = s["generation_tps_median_step"] / v["generation_tps_median_step"]
            pr = s["prompt_tps"] / v["prompt_tps"]
            parts.append(f"vs velox: gen {g:.2f}x, prompt {pr:.2f}x ({'met' if g > 1 and pr > 1 else 'MISSED'})")
        if n == 8192:
            bound = meta["kv_budget_plus_chunk_mb"].get(b, meta["kv_budget_plus_chunk_mb"].get(str(b)))
            pf = s.get("prompt_paired_vs_full")
            parts.append(f"prefill: KV after chunk {s['kv_after_chunk_max_mb']:.1f} MB vs budget + chunk "
                         f"{bound:.1f} MB ({'met' if s['kv_after_chunk_max_mb'] <= bound else 'MISSED'}), prompt "
                         f"{fmt(pf, '.2f')}x full ({'met' if pf is not None and pf >= 0.9 else 'MISSED'} >= 0.9)")
        L.append("; ".join(parts))
    return L


def plot(summary, args, path: Path, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = args.budgets
    fig, axes = plt.subplots(len(budgets), 2, figsize=(11, 3.8 * len(budgets)), squeeze=False)
    arms = list(dict.fromkeys(s["arm"] for s in summary))
    for i, b in enumerate(budgets):
        for arm in arms:
            ss = sorted((s for s in summary if s["arm"] == arm and s["budget"] in (b, None)),
                        key=lambda s: s["length"])
            x = [s["length"] for s in ss]
            axes[i][0].plot(x, [s["generation_tps_median_step"] for s in ss], marker="o", label=arm)
            axes[i][1].plot(x, [s["prompt_tps"] for s in ss], marker="o", label=arm)
        for j, what in enumerate(("generation tok/s (median step)", "prompt tok/s")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(what)
            ax.set_title(f"budget {b}: {what}", fontsize=10)
            ax.grid(True, alpha=0.3)
        axes[i][0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M float32, {meta['max_tokens']} tokens, median of {meta['repeats']}; "
                 f"load avg {meta['loadavg_start'][0]:.1f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
