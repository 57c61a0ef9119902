"""Picking the number of big heads on calibration text only: one step past the recall cliff.

docs/head-groups.md, "The constants", written before this ran: in the simulator
(:mod:`qfilters_mlx.evaluation.simulate`, teacher-forced, eviction after a prefix of
:data:`PREFIX` tokens), on 12 calibration needles built from other lines of the calibration text
than the ranking's (:func:`qfilters_mlx.filters.head_ranking.calibration_needles` on the
calibration text from a quarter of its length on), with the budgets of
:func:`qfilters_mlx.filters.head_budgets.head_budgets` (``m = 4``; the ranking
:func:`~qfilters_mlx.filters.head_ranking.rank_heads` measures; the default filter, made on first
use), count the needles whose key is recalled (every key token ranked first) among those the full
cache recalls, for ``k`` in :data:`KS` (in order, stopping once the pick is run); ``k`` is the
value one step past the first that keeps at least half of them. No evaluation text or prompt is
read.

Usage (resumable)::

    python bench/bench_head_rule.py [--budgets 128,64] [--model smollm2-135m]

Writes ``bench/results/head_rule.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import time

import common
import mlx.core as mx
import numpy as np

import bench_held_out_perplexity as g1
from qfilters_mlx.assets.prompts import calibration_text
from qfilters_mlx.evaluation.recall import full_predictions, key_recall
from qfilters_mlx.evaluation.simulate import MaskedArm, simulated_predictions
from qfilters_mlx.filters.head_budgets import head_budgets
from qfilters_mlx.filters.head_ranking import calibration_needles, rank_heads

OUT = common.RESULTS / "head_rule.json"
KS, MULTIPLE, PREFIX, N_SINK = (0, 2, 4, 8, 16, 32), 4, 32, 4


def pick(kept: dict, full: int):
    """One step past the first ``k`` (in :data:`KS` order) that keeps at least half of ``full``;
    ``None`` when none does (the largest tried, then, is not called a pick)."""
    for i, k in enumerate(KS):
        if str(k) in kept and 2 * kept[str(k)] >= full:
            return KS[min(i + 1, len(KS) - 1)]
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=common.int_list, default=[128])
    p.add_argument("--extra", default="", help="k:m,... more (k, m) points, run after the sweep and "
                   "reported apart (not part of the rule)")
    common.add_model_arg(p)
    a = p.parse_args()
    model, tokenizer = common.load_model(a.model)
    from qfilters_mlx.model_info import model_head_dim

    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    results["meta"] = common.run_meta(model=a.model)
    save = lambda: common.write_results(OUT, results)  # noqa: E731
    if "ranking" not in results:
        r = rank_heads(model, tokenizer)
        results["ranking"] = {"values": r.ranking.tolist(), "seconds": round(r.seconds, 1)}
    ranking = np.array(results["ranking"]["values"])
    if "filters" not in results:  # the default filter, made on first use (kept for a resumed run)
        results["filters"] = np.array(g1.default_filters(model, tokenizer)[0]).tolist()
    filters = mx.array(np.array(results["filters"], dtype=np.float32))
    text = calibration_text()[0]
    needles = calibration_needles(tokenizer, text[text.index("\n", len(text) // 4) + 1:])
    cells = results.setdefault("needles", {})
    for i, n in enumerate(needles):
        cell = cells.setdefault(str(i), {"form": n.form, "depth": n.depth, "distance": n.prompt.distance})
        if "full" not in cell:
            cell["full"] = key_recall(n.prompt, *full_predictions(model, n.prompt.tokens, PREFIX), PREFIX)[0]
            save()
    full = sum(c["full"] for c in cells.values())
    def run(b: int, k: int, m: int, key: str) -> None:
        try:
            hb = head_budgets(ranking, b, N_SINK, k, m)
        except ValueError as err:  # (k big heads at m x b do not fit in the one-budget total)
            results.setdefault("infeasible", {})[key] = str(err)
            return
        for i, n in enumerate(needles):
            cell = cells[str(i)]
            if not cell["full"] or key in cell:
                continue
            tic = time.perf_counter()
            arm = MaskedArm(g1.config("default", b, model_head_dim(model)), filters=filters,
                            budgets=hb.budgets, recents=hb.recents)
            cell[key] = key_recall(n.prompt, *simulated_predictions(model, n.prompt.tokens, arm, PREFIX), PREFIX)[0]
            save()
            print(f"needle {i} ({n.form} d{n.depth}) {key}: {'R' if cell[key] else '-'} "
                  f"({time.perf_counter() - tic:.1f} s)", flush=True)

    for b in a.budgets:
        for k in KS:  # k by k, so that the sweep stops one step past the cliff
            run(b, k, MULTIPLE, f"k{k}@{b}")
            kept = {str(j): sum(bool(c.get(f"k{j}@{b}")) for c in cells.values() if c["full"])
                    for j in KS[:KS.index(k) + 1]}
            if pick(kept, full) is not None and KS.index(k) >= KS.index(pick(kept, full)):
                break
        for point in filter(None, a.extra.split(",")):
            k, m = map(int, point.split(":"))
            run(b, k, m, f"k{k}m{m}@{b}")
    summary, bad = {}, results.get("infeasible", {})
    for b in a.budgets:
        done = lambda key: key not in bad and all(key in c for c in cells.values() if c["full"])  # noqa: E731
        kept = {str(k): sum(bool(c.get(f"k{k}@{b}")) for c in cells.values() if c["full"]) for k in KS
                if done(f"k{k}@{b}")}
        extra = {key.split("@")[0]: sum(bool(c.get(key)) for c in cells.values() if c["full"])
                 for key in sorted({x for c in cells.values() for x in c if x.startswith("k") and "m" in x
                                    and x.endswith(f"@{b}")}) if done(key)}
        p = pick(kept, full)
        summary[str(b)] = {"kept": kept, "pick": p, "pick_fits": p is not None and f"k{p}@{b}" not in bad,
                           "extra": extra}
    results["summary"] = {"full_recalled": full, "of": len(cells), "budgets": summary}

    def shown(b, k):
        key = f"k{k}@{b}"
        return "does not fit" if key in bad else summary[str(b)]["kept"].get(str(k), "not run")

    md = ["# Big heads picked on calibration needles (one step past the recall cliff)", "",
          f"The full cache recalls {full} of {len(cells)} held-out calibration needles; each cell counts "
          f"those kept (multiple m = {MULTIPLE}, {N_SINK} sinks, the default filter).", "",
          *common.md_table(["budget"] + [f"k = {k}" for k in KS] + ["rule's pick", "fits"],
                           [[b] + [shown(b, k) for k in KS] + [s["pick"], "yes" if s["pick_fits"] else "no"]
                            for b, s in summary.items()], "r" * (len(KS) + 3)), ""]
    if any(s["extra"] for s in summary.values()):
        md += ["Other points (outside the rule):", "",
               *common.md_table(["budget", "k, m", "kept"], [[b, x.replace("m", ", m = ").replace("k", "k = "), v]
                                                        for b, s in summary.items() for x, v in s["extra"].items()],
                                "rlr"), ""]
    common.write_results(OUT, results, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
