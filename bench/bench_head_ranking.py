"""Finding a model's retrieval heads once: how long it takes, which heads, how stable.

* ``resolve``: :func:`qfilters_mlx.filters.head_store.resolve_head_ranking` in a fresh user
  cache, as ``KVCacheBuilder.for_model`` would call it on first use (model identity, 12
  full-cache passes over the calibration needles, the file written), then again (the file found);
  beside it in the same run, the default filter's first use
  (:func:`qfilters_mlx.filters.default_filters.resolve_filters`: 2,048 tokens), for the ratio,
  in wall time and in the process's CPU time (all threads; on a machine shared with other jobs
  the CPU time is the work done, the wall time also the waits);
* the top heads of the ranking, and the overlap of its top 8 with (a) the top 8 of each needle
  form alone (pass-key numbers, words) and of each span of the calibration text alone, and (b) the simulator's ranking
  (``bench/results/kv_directions.json``, ``rankings.needle``: 6 pass-key prompts of the
  evaluation's source text, offsets 170,000 and 185,000, the big heads of ``heads-needle-4x8q``),
  with Spearman's rank correlation over all heads;
* the budgets :func:`qfilters_mlx.filters.head_budgets.head_budgets` gives at budgets 128 and 256
  with the default constants.

``--store`` (for a bigger model, where every pass counts): one measurement only, in the user
cache itself (the file ``KVCacheBuilder.for_model`` and the other benches then find): the
12 passes of :func:`~qfilters_mlx.filters.head_ranking.rank_heads` timed, the ranking written to
:func:`~qfilters_mlx.filters.head_store.heads_path` with the metadata ``resolve_head_ranking``
writes, then found again; no filter first use beside it (no ratio). Refused when the file exists.

Usage::

    python bench/bench_head_ranking.py [--model smollm2-135m]
    python bench/bench_head_ranking.py --model qwen2.5-coder-0.5b --out bench/results/head_ranking_qwen.json
    python bench/bench_head_ranking.py --model qwen2.5-coder-0.5b --store \
        --out bench/results/head_ranking_qwen.json   # one measurement, into the user cache

Writes ``bench/results/head_ranking.json`` and ``.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from scipy.stats import spearmanr

from qfilters_mlx.filters.head_budgets import DEFAULT_BIG_HEADS, DEFAULT_MULTIPLE, big_heads, head_budgets
from qfilters_mlx.filters.head_ranking import SPANS, calibration_needles
from qfilters_mlx.filters.head_store import resolve_head_ranking

OUT = common.RESULTS / "head_ranking.json"
SIM = common.RESULTS / "kv_directions.json"
N_SINK, TOP = 4, 8


def _first_uses(model, tokenizer) -> tuple[object, dict]:
    from qfilters_mlx.config import KVCacheConfig
    from qfilters_mlx.filters import head_ranking
    from qfilters_mlx.filters.default_filters import resolve_filters

    measured = []  # what the first use's rank_heads returned (per needle, for the overlaps)
    rank_heads = head_ranking.rank_heads
    head_ranking.rank_heads = lambda model, tokenizer: measured.append(rank_heads(model, tokenizer)) or measured[-1]
    with tempfile.TemporaryDirectory() as home:
        before = os.environ.get("QFILTERS_MLX_HOME")
        os.environ["QFILTERS_MLX_HOME"] = home
        try:
            tic, cpu = time.perf_counter(), time.process_time()
            resolve_filters(model, KVCacheConfig(), tokenizer=tokenizer)
            t_filter, c_filter = time.perf_counter() - tic, time.process_time() - cpu
            tic, cpu = time.perf_counter(), time.process_time()
            first = resolve_head_ranking(model, tokenizer)
            t_first, c_first = time.perf_counter() - tic, time.process_time() - cpu
            tic = time.perf_counter()
            again = resolve_head_ranking(model)
            t_again = time.perf_counter() - tic
        finally:
            head_ranking.rank_heads = rank_heads
            if before is None:
                del os.environ["QFILTERS_MLX_HOME"]
            else:
                os.environ["QFILTERS_MLX_HOME"] = before
    assert np.array_equal(first.ranking, again.ranking) and len(measured) == 1
    assert np.array_equal(measured[0].ranking.astype(np.float32), first.ranking)
    return measured[0], {"first_use_s": round(t_first, 2), "found_s": round(t_again, 3),
                      "filter_first_use_s": round(t_filter, 2), "ratio_to_filter": round(t_first / t_filter, 2),
                      "first_use_cpu_s": round(c_first, 2), "filter_first_use_cpu_s": round(c_filter, 2),
                      "cpu_ratio_to_filter": round(c_first / c_filter, 2),
                      "loadavg_end": os.getloadavg(), "origin": first.origin.replace(home, "$QFILTERS_MLX_HOME")}


def _store_once(model, tokenizer) -> tuple[object, dict]:
    from qfilters_mlx.filters.head_store import heads_path, measure_and_store
    from qfilters_mlx.identity import model_identity

    path = heads_path(model_identity(model))
    if path.exists():
        raise SystemExit(f"{path} exists: --store measures a model without a stored ranking")
    tic = time.perf_counter()
    measured, _, error = measure_and_store(model, tokenizer, path)
    if error is not None:
        raise SystemExit(f"{path} not written: {error}")
    t_first = time.perf_counter() - tic
    tic = time.perf_counter()
    again = resolve_head_ranking(model)
    t_again = time.perf_counter() - tic
    assert np.array_equal(again.ranking, measured.ranking.astype(np.float32))
    return measured, {"first_use_s": round(t_first, 2), "found_s": round(t_again, 3), "filter_first_use_s": None,
                      "ratio_to_filter": None, "loadavg_end": os.getloadavg(), "origin": again.origin.replace(str(Path.home()), "~")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_model_arg(p)
    p.add_argument("--store", action="store_true", help="measure once, into the user cache (no filter ratio)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    model, tokenizer = common.load_model(a.model)
    meta = common.run_meta(model=a.model)  # (the load average at start)
    measured, timing = (_store_once if a.store else _first_uses)(model, tokenizer)
    ranking = measured.ranking
    per_form = {f: measured.per_needle[np.array(measured.forms) == f] for f in dict.fromkeys(measured.forms)}
    top = big_heads(ranking, TOP)
    out = {"meta": meta, "timing": timing,
           "ranking": np.round(ranking, 6).tolist(),
           "top": [{"layer": l, "head": h, "needle_attention": round(float(ranking[l, h]), 4)} for l, h in top],
           "recalled": f"{measured.recalled}/{measured.prompts}", "overlap": {},
           "tokens": {"computed": measured.computed,
                      "in_passes": sum(len(n.prompt.tokens) - 1 for n in calibration_needles(tokenizer))}}
    half = len(measured.forms) // len(SPANS)  # (the needles come span by span)
    per_form.update({f"span {s}": measured.per_needle[i * half:(i + 1) * half] for i, s in enumerate(SPANS)})
    for form, runs in per_form.items():
        mine = runs.mean(axis=0)
        out["overlap"][form if form.startswith("span") else f"form {form}"] = {"top8_shared": len(set(top) & set(big_heads(mine, TOP))),
                                          "spearman": round(float(spearmanr(ranking.ravel(), mine.ravel())[0]), 3)}
    if a.model == "smollm2-135m" and SIM.is_file():
        sim = json.loads(SIM.read_text())
        sim_rank = np.array(sim["rankings"]["needle"]["values"])
        sim_top = [tuple(x) for x in sim["heads"]["heads-needle-4x8q@128"]["big"]]
        out["overlap"]["simulator heads-needle-4x8q"] = {
            "top8_shared": len(set(top) & set(sim_top)), "simulator_top8": sim_top,
            "spearman": round(float(spearmanr(ranking.ravel(), sim_rank.ravel())[0]), 3)}
    out["budgets"] = {}
    for budget in (128, 256):
        hb = head_budgets(ranking, budget, N_SINK)
        b = np.array(hb.budgets)
        out["budgets"][str(budget)] = {"big": int(b.max()), "small": int(b.min()), "recent": hb.recents[0][0],
                                       "total": hb.total_tokens, "one_budget_total": int(b.size * budget),
                                       "layers_with_two_groups": sum(len(hb.groups(i)) == 2 for i in range(hb.n_layers))}
    beside = (f"{timing['ratio_to_filter']} times the default filter's first use in the same run "
              f"({timing['filter_first_use_s']} s, 2,048 tokens); in CPU time of the process (all threads: "
              f"the work, whatever else the cores ran) {timing['first_use_cpu_s']} s against the filter's "
              f"{timing['filter_first_use_cpu_s']} s, {timing['cpu_ratio_to_filter']} times"
              if timing["ratio_to_filter"] else
              "measured once into the user cache (`--store`: the 12 passes and the file written; no filter "
              "first use beside it)")
    md = [f"# Retrieval heads of {a.model}, found once", "",
          "Command:", "", f"    python bench/bench_head_ranking.py --model {a.model}" + (" --store" if a.store else "")
          + (f" --out {a.out.resolve().relative_to(common.ROOT)}" if a.out.resolve() != OUT.resolve() else ""), "",
          f"First use (identity, 12 calibration needles, file written): **{timing['first_use_s']} s**, "
          f"{beside}; found again: {timing['found_s']} s. "
          f"Load average {', '.join(f'{x:.1f}' for x in out['meta']['loadavg_start'])} at start, "
          f"{', '.join(f'{x:.1f}' for x in timing['loadavg_end'])} at the end (2 cores, shared). "
          f"The full cache answers {out['recalled']} of the needles. The 12 passes hold "
          f"{out['tokens']['in_passes']:,} tokens; {out['tokens']['computed']:,} went through the model (the "
          "others are starts shared with an earlier needle, their keys and values reused).", "",
          *common.md_table(["rank", "layer", "KV head", "needle attention"],
                           [[i + 1, t["layer"], t["head"], t["needle_attention"]] for i, t in enumerate(out["top"])],
                           "rrrr"), "",
          *common.md_table(["compared with", f"top {TOP} shared", "Spearman (all heads)"],
                           [[k, v["top8_shared"], v["spearman"]] for k, v in out["overlap"].items()], "lrr"), "",
          f"Budgets by the rule (k = {DEFAULT_BIG_HEADS}, m = {DEFAULT_MULTIPLE}, {N_SINK} sinks):", "",
          *common.md_table(["budget", "big", "others", "recent (all)", "tokens held", "one budget", "layers with 2 groups"],
                           [[k, v["big"], v["small"], v["recent"], v["total"], v["one_budget_total"],
                             v["layers_with_two_groups"]] for k, v in out["budgets"].items()], "rrrrrrr"), ""]
    print("\n".join(md))
    common.write_results(a.out, out, "\n".join(md))


if __name__ == "__main__":
    main()
