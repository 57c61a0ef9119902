"""Scores from keys and values, and retrieval heads with their own budgets, judged on G1 (held-out
perplexity against StreamingLLM) and G2 (pass-key recall beyond the recent window), in the
simulator (SmolLM2-135M-Instruct).

G1 and G2 are those of ``bench_held_out_perplexity.py`` and ``bench_recall_beyond_window.py``,
whose results files give the full cache, StreamingLLM, the default and the oracle on the same
tokens (the same simulator, settings and segments / prompts, read from those files); this bench
runs only its own arms (``--arms``, every one of the default's keep rule: 4 sinks, recent window
budget/2, the filter ``for_model`` calibrates on first use, unless said):

* ``value-mix``: the filter's score plus ``log ||v||`` (each standardized by its running mean and
  std per head: :mod:`qfilters_mlx.evaluation.kv_scores`), the filter weighted by how much the
  token moves the output;
* ``novelty``: KeyDiff's key novelty, ``-cos(k, mean of the keys so far)``, alone;
* ``novelty-mix``: the filter's score plus the novelty (standardized as ``value-mix``);
* ``heads-needle-<m>``, ``heads-far-<m>``: retrieval heads with their own budgets at the same total
  (:mod:`qfilters_mlx.evaluation.retrieval_heads`): the top heads by the attention the answer gives
  the needle on 6 calibration pass-key prompts (offsets 170,000 and 185,000, depths 0.1/0.3/0.5,
  disjoint from G2's) or by the attention beyond 128 tokens back on the first 1,024 tokens of the
  calibration text get ``m`` times the budget as sinks and a recent window; every other head half
  the budget as sinks and a recent window (plus the tokens left over, so the budgets sum to
  ``n_layers * n_kv_heads * budget``); ``heads-needle-<m>x<k>``: the top ``k`` heads get ``m``
  times the budget, the other heads share what is left; a trailing ``q``: the other heads keep
  the default's rule (recent window half their budget, the rest by the filter).

Usage (resumable; ``--report`` rewrites the tables only)::

    python bench/bench_kv_directions.py --part g2 [--arms value-mix,novelty] [--budgets 128,64]
    python bench/bench_kv_directions.py --part g1 [--segments prose-0] [--budgets 64,128,256,512]

Writes ``bench/results/kv_directions.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import common  # noqa: F401  (fast BLAS before MLX)
import numpy as np
from mlx_lm import load
from scipy.stats import binomtest

import bench_held_out_perplexity as g1
import bench_recall_beyond_window as g2
from qfilters_mlx.assets.prepare_model import prepare_model
from qfilters_mlx.assets.prompts import calibration_text, source_text
from qfilters_mlx.evaluation.bootstrap import gap_ratio
from qfilters_mlx.evaluation.kv_scores import kv_score_arm
from qfilters_mlx.evaluation.perplexity import perplexity
from qfilters_mlx.evaluation.pooled import equivalent_budget, pooled_ratio_bootstrap
from qfilters_mlx.evaluation.recall import full_predictions, key_recall, needle_prompt
from qfilters_mlx.evaluation.retrieval import pass_key
from qfilters_mlx.evaluation.retrieval_heads import far_mass, split_budgets
from qfilters_mlx.filters.head_ranking import needle_attention
from qfilters_mlx.evaluation.simulate import MaskedArm, simulated_nll, simulated_predictions

OUT = common.RESULTS / "kv_directions.json"
G1_FILE, G2_FILE = common.RESULTS / "held_out_perplexity.json", common.RESULTS / "recall_beyond_window.json"
SCORES = {"value-mix": {"filter": 1.0, "value": 1.0}, "novelty": {"novelty": 1.0},
          "novelty-mix": {"filter": 1.0, "novelty": 1.0}}
ARMS = ("value-mix", "novelty", "novelty-mix", "heads-far-4", "heads-needle-4", "heads-needle-4q",
        "heads-needle-4x3q", "heads-needle-8x3q", "heads-needle-4x6q",
        "heads-needle-4x8q", "heads-needle-8x8q")
CALIB_OFFSETS, CALIB_DEPTHS = (170_000, 185_000), (0.1, 0.3, 0.5)


class Directions:
    """Builds this bench's arms on one model (the head rankings measured once, kept in
    ``results["rankings"]``)."""

    def __init__(self, model, tokenizer, results: dict):
        from qfilters_mlx.model_info import model_head_dim

        self.model, self.tokenizer, self.results = model, tokenizer, results
        self.base = g1.Arms(model, tokenizer, model_head_dim(model), results)

    def ranking(self, measure: str) -> np.ndarray:
        r = self.results.setdefault("rankings", {})
        if measure not in r:
            tic = time.perf_counter()
            if measure == "needle":
                text, runs = source_text(), []
                for off in CALIB_OFFSETS:
                    hay = text[text.index("\n\n", off) + 2:]
                    for d in CALIB_DEPTHS:
                        p = needle_prompt(self.tokenizer, hay, g2.CONTEXT, d, pass_key(off, g2.CONTEXT, d))
                        if key_recall(p, *full_predictions(self.model, p.tokens, g2.PREFIX), g2.PREFIX)[0]:
                            runs.append(needle_attention(self.model, p))
                r[measure] = {"values": np.mean(runs, axis=0).tolist(), "prompts": len(runs)}
            elif measure == "far":
                ids = self.tokenizer.encode(calibration_text()[0], add_special_tokens=False)[:1024]
                r[measure] = {"values": far_mass(self.model, ids, 128, g1.N_SINK).tolist(), "tokens": len(ids)}
            else:
                raise ValueError(f"unknown head measure {measure!r}")
            r[measure]["seconds"] = round(time.perf_counter() - tic, 1)
        return np.array(r[measure]["values"])

    def arm(self, name: str, budget: int) -> MaskedArm:
        cfg = g1.config("default", budget, self.base.hd)
        filters = self.base.default_filters()
        if name in SCORES:
            return kv_score_arm(cfg, SCORES[name], filters)
        if name.startswith("heads-"):
            _, measure, m = name.split("-")
            mult, _, k = m.rstrip("q").partition("x")
            big = int(mult) * budget
            budgets, recents, top = split_budgets(self.ranking(measure), budget, big, None if k else budget // 2,
                                                  g1.N_SINK, heads=int(k) if k else None)
            if m.endswith("q"):  # the small heads keep the default's rule: recent half, the rest by the filter
                recents = tuple(tuple(r if x == big else x // 2 for r, x in zip(rr, bb))
                                for rr, bb in zip(recents, budgets))
            self.results.setdefault("heads", {})[f"{name}@{budget}"] = {"big": top, "total": int(np.sum(budgets))}
            return MaskedArm(cfg, filters=filters, budgets=budgets, recents=recents)
        raise ValueError(f"unknown arm {name!r}")


def _missing(cell: dict, a):
    """``(arm, budget, key)`` of the arms x budgets of ``a`` that ``cell`` has no result for yet."""
    for arm in a.arms:
        for b in a.budgets:
            if f"{arm}@{b}" not in cell:
                yield arm, b, f"{arm}@{b}"


def run_g2(a, d: Directions, results: dict, save) -> None:
    base = json.loads(G2_FILE.read_text())
    text = source_text()
    cells = results.setdefault("g2", {})
    for name, ref in base["prompts"].items():
        if not ref["full"]["recalled"]:
            continue
        off, depth = name.split("@")
        p = needle_prompt(d.tokenizer, text[text.index("\n\n", int(off)) + 2:], base["settings"]["context"],
                          float(depth), ref["key"])
        cell = cells.setdefault(name, {})
        for arm, b, key in _missing(cell, a):
            tic = time.perf_counter()
            nll, arg = simulated_predictions(d.model, p.tokens, d.arm(arm, b), g2.PREFIX)
            ok, key_nll = key_recall(p, nll, arg, g2.PREFIX)
            cell[key] = {"recalled": ok, "key_nll": key_nll}
            save()
            print(f"{name} {key}: {'R' if ok else '-'} key NLL {key_nll:.2f} "
                  f"({time.perf_counter() - tic:.0f} s)", flush=True)


def run_g1(a, d: Directions, results: dict, save) -> None:
    cells = results.setdefault("g1", {})
    for seg in a.segments:
        ids = d.tokenizer.encode(g1.segment_text(seg)[0], add_special_tokens=False)[:g1.TOKENS]
        cell = cells.setdefault(seg, {})
        for arm, b, key in _missing(cell, a):
            tic = time.perf_counter()
            nll = simulated_nll(d.model, ids, d.arm(arm, b), g1.PREFIX)
            cell[key] = {"ppl": perplexity(nll), "nll": [round(x, 5) for x in nll]}
            save()
            print(f"{seg} {key}: {perplexity(nll):.3f} ({time.perf_counter() - tic:.0f} s)", flush=True)


def g1_summary(results: dict) -> dict:
    """Per arm with every G1 cell of the baseline file's segments and budgets: the pooled gap ratio
    to StreamingLLM with its interval, per budget and over all, and the worst single cell."""
    base = json.loads(G1_FILE.read_text())
    S, segs, budgets = base["segments"], base["statistics"]["segments"], base["statistics"]["budgets"]
    mine = results.get("g1", {})
    arms = ["default", "oracle"] + [x for x in ARMS if all(f"{x}@{b}" in mine.get(s, {}) for s in segs
                                                              for b in budgets)]
    nll = {(x, b): [(S[s] if x in ("streaming_llm", "default", "oracle") else mine[s])[f"{x}@{b}"]["nll"] for s in segs]
           for x in arms + ["streaming_llm"] for b in budgets}
    full = [S[s]["full"]["nll"] for s in segs]
    pooled = pooled_ratio_bootstrap(nll, full, block=64, n_boot=2000, seed=0)
    out = {"segments": segs, "budgets": budgets, "arms": {}, "cells": {}}
    for x in arms:
        worst = max((gap_ratio(nll[x, b][i], nll["streaming_llm", b][i], full[i]), segs[i], b)
                    for i in range(len(segs)) for b in budgets)
        sl = [float(np.exp(np.mean([np.mean(n) for n in nll["streaming_llm", b]]))) for b in budgets]
        ppl = [float(np.exp(np.mean([np.mean(n) for n in nll[x, b]]))) for b in budgets]
        equiv = [equivalent_budget(budgets, sl, q) for q in ppl]
        out["arms"][x] = {"pooled": {str(k): v for k, v in pooled[x].items()}, "worst_cell": worst,
                          "over_bar": sum(gap_ratio(nll[x, b][i], nll["streaming_llm", b][i], full[i]) > g1.CELL_BAR
                                          for i in range(len(segs)) for b in budgets),
                          "equivalent": [(e / b, ext) for (e, ext), b in zip(equiv, budgets)]}
    for x in ARMS:  # every (segment, budget) cell run, complete or not
        for s in segs:
            got = {b: gap_ratio(mine[s][f"{x}@{b}"]["nll"], S[s][f"streaming_llm@{b}"]["nll"], S[s]["full"]["nll"])
                   for b in budgets if f"{x}@{b}" in mine.get(s, {})}
            if got:
                out["cells"].setdefault(x, {})[s] = got
    return out


def g2_summary(results: dict) -> dict:
    """Per (arm, budget): recalled / prompts the full cache recalls (every arm run), exact 95%
    interval; the baseline file's StreamingLLM, default and oracle beside."""
    base = json.loads(G2_FILE.read_text())
    P, mine = base["prompts"], results.get("g2", {})
    hits = [n for n, c in P.items() if c["full"]["recalled"]]
    out = {"full_recalled": len(hits), "of": len(P), "cells": {}}
    for b in base["settings"]["budgets"]:
        for arm in list(g2.ARMS) + list(ARMS):
            src = {n: (P[n] if arm in g2.ARMS else mine.get(n, {})) for n in hits}
            if not all(f"{arm}@{b}" in src[n] for n in hits):
                continue
            k = sum(src[n][f"{arm}@{b}"]["recalled"] for n in hits)
            ci = binomtest(k, len(hits)).proportion_ci(0.95, method="exact")
            out["cells"][f"{arm}@{b}"] = {"recalled": k, "of": len(hits), "low": ci.low, "high": ci.high}
    return out


def markdown(results: dict) -> str:
    lines = ["# Scores from keys and values, retrieval heads: G1 and G2 (SmolLM2-135M-Instruct, simulated)", "",
             "Commands:", "", *[f"    {c}" for c in results.get("commands", [])], ""]
    s1, s2 = results.get("g1_summary"), results.get("g2_summary")
    if s2:
        bs = sorted({int(k.split("@")[1]) for k in s2["cells"]}, reverse=True)
        lines += [f"G2: pass keys recalled beyond the recent window / the {s2['full_recalled']} prompts (of "
                  f"{s2['of']}) the full cache recalls [exact 95% interval] (StreamingLLM, default, oracle: "
                  "`recall_beyond_window.json`):", ""]
        arms = list(dict.fromkeys(k.split("@")[0] for k in s2["cells"]))
        rows = [[arm] + [(lambda c: f"{c['recalled']}/{c['of']} [{c['low']:.2f}, {c['high']:.2f}]" if c else "-")(
            s2["cells"].get(f"{arm}@{b}")) for b in bs] for arm in arms]
        lines += common.md_table(["arm"] + [f"budget {b}" for b in bs], rows) + [""]
    if s1:
        lines += [f"G1: pooled gap ratio to StreamingLLM over {len(s1['segments'])} held-out segments [95% "
                  "segments-then-blocks bootstrap interval], and the worst single (segment, budget) cell "
                  "(default, oracle: `held_out_perplexity.json`; G1 asks an upper bound <= 1.0 and no cell "
                  f"above {g1.CELL_BAR:.2f}):", ""]
        rows = []
        for arm, v in s1["arms"].items():
            p, w = v["pooled"], v["worst_cell"]
            rows.append([arm] + [f"{p[str(b)][0]:.3f} [{p[str(b)][1]:.3f}, {p[str(b)][2]:.3f}]"
                                 for b in s1["budgets"] + ["all"]]
                        + [f"{w[0]:.2f} ({w[1]}, {w[2]})", f"{v['over_bar']}",
                           " / ".join(f"x{e:.2f}{'*' if ext else ''}" for e, ext in v["equivalent"])])
        lines += common.md_table(["arm"] + [f"budget {b}" for b in s1["budgets"]]
                                 + ["all budgets", "worst cell", f"cells > {g1.CELL_BAR:.2f}",
                                    "memory-equivalence " + " / ".join(str(b) for b in s1["budgets"])], rows)
        lines += ["", "(memory-equivalence: the StreamingLLM budget with the arm's pooled perplexity at B, over B; "
                  "* extrapolated beyond the measured budgets)", ""]
    if s1 and s1["cells"]:
        bs = s1["budgets"]
        lines += ["G1 per (segment, budget) cell: gap ratio to StreamingLLM (point estimates; every cell run, "
                  "complete arms or not):", ""]
        rows = [[arm, seg] + [f"{c[str(b)]:.2f}" if str(b) in c else "-" for b in bs]
                for arm, per in s1["cells"].items() for seg, c in per.items()]
        lines += common.md_table(["arm", "segment"] + [f"budget {b}" for b in bs], rows) + [""]
    if results.get("rankings"):
        lines += ["Head measures: " + "; ".join(f"{k}: {v.get('prompts', v.get('tokens'))} "
                                                f"{'prompts' if 'prompts' in v else 'tokens'}, {v['seconds']} s"
                                                for k, v in results["rankings"].items()) + ".", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("g1", "g2"), default="g2")
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS))
    p.add_argument("--segments", type=lambda s: s.split(","), default=list(g1.SEGMENTS))
    p.add_argument("--budgets", type=common.int_list, default=None)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--report", action="store_true")
    a = p.parse_args()
    a.budgets = a.budgets or (list(g2.BUDGETS) if a.part == "g2" else list(g1.BUDGETS))
    out = common.Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", common.run_meta(python=sys.version.split()[0]))
    if not a.report:
        command = " ".join(["python bench/bench_kv_directions.py", *sys.argv[1:]])
        if command not in results.setdefault("commands", []):
            results["commands"].append(command)
        model, tokenizer = load(str(prepare_model()))
        d = Directions(model, tokenizer, results)
        (run_g1 if a.part == "g1" else run_g2)(a, d, results, lambda: out.write_text(json.dumps(results)))
    results["g1_summary"] = json.loads(json.dumps(g1_summary(results), default=float))
    results["g2_summary"] = g2_summary(results)
    out.write_text(json.dumps(results))
    out.with_suffix(".md").write_text(markdown(results))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
