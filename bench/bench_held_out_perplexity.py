"""Held-out perplexity under streaming eviction on six segments, prose and Python source:
StreamingLLM, the library's default and the oracle, pooled gap ratios and memory-equivalence.

What a user asks of the default (``KVCacheConfig()``: the calibrated query filter from 2,048
tokens of the calibration text, 4 sinks, recent window budget/2): is it ever worse than the
StreamingLLM that mlx-lm gives for free (``RotatingKVCache``), and what StreamingLLM budget does
it equal? Every cell is streaming eviction simulated in one forward pass
(:mod:`qfilters_mlx.evaluation.simulate`: the per-token NLLs of the caches fed token by token,
tested): a 128-token first call, then token by token, 896 scored tokens per segment (1,024-token
segments: on this shared 2-core machine a 2,048-token cell costs about 90 s, a 1,024-token one
about a third of it; at budget 512 eviction then runs in the last 511 tokens only).

Segments (1,024 tokens each, disjoint from the calibration text, characters 300,155 to 360,155
of the joined ``pydoc_data.topics`` text, :func:`qfilters_mlx.assets.prompts.calibration_text`):

* ``prose-0``, ``prose-100k``, ``prose-150k``: CPython's reference documentation (the joined
  ``pydoc_data.topics`` text) from its start (segment A of ``qfilters-mlx eval``), from the first
  paragraph after character 100,000 (segment B) and after character 150,000;
* ``code-dataclasses``, ``code-difflib``, ``code-argparse``: the standard library's source of
  those modules (this Python's), from the first top-level ``def`` or ``class`` line.

Arms: ``streaming_llm`` (4 sinks + budget - 4 recent tokens); ``default`` (the filter
``for_model`` calibrates on first use, made here in a fresh filters home exactly as a first use
does); ``oracle`` (the default's keep rule, each key scored by the attention it receives in the
full-cache pass from the queries after it has left the recent window, summed over its GQA group:
:func:`qfilters_mlx.evaluation.oracle.oracle_arms`; it sees the future, a ceiling for every
score fixed at insertion); ``heads`` (``heads="calibrated"``: the per-head budgets and recent
windows :func:`qfilters_mlx.cache.head_group_build.resolve_heads` gives at the budget, the model's
stored retrieval-head ranking through the rule of docs/head-groups.md, with the default's filter;
``--arms heads`` adds it to a results file without rerunning the others).

Cell rule (:func:`cell_fails`): a (segment, budget) cell fails when the arm's perplexity exceeds
StreamingLLM's by more than 10% of StreamingLLM's gap (its perplexity minus the full cache's)
plus 0.5% of the full cache's perplexity.

Statistics (:mod:`qfilters_mlx.evaluation.pooled`): per budget the pooled gap ratio to StreamingLLM
(perplexity points lost to the full cache, summed over the six segments, over StreamingLLM's) and
the same over all budgets together, with 95% segments-then-blocks bootstrap intervals (blocks of 64 tokens,
2,000 resamples); per cell the single-segment gap ratio; the memory-equivalence factor (the
StreamingLLM budget matching the arm's pooled perplexity at B, over B).

Usage (resumable: cells in the output are kept; ``--report`` rewrites the tables only)::

    python bench/bench_held_out_perplexity.py [--segments prose-0,code-difflib] [--budgets 64,128]
    python bench/bench_held_out_perplexity.py --tokens 2048 --budgets 512 \
        --out bench/results/held_out_perplexity_2k.json   # budget 512 with eviction over 1,536 tokens
    python bench/bench_held_out_perplexity.py --tokens 2048 --budgets 512 --arms heads \
        --out bench/results/held_out_perplexity_2k.json   # the same texts, head groups added
    python bench/bench_held_out_perplexity.py --model qwen2.5-coder-0.5b \
        --out bench/results/held_out_perplexity_qwen.json   # another registered model

Writes ``bench/results/held_out_perplexity.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time

import common  # noqa: F401  (fast BLAS before MLX)
import numpy as np
from mlx_lm import load

from qfilters_mlx.assets.models import get_model
from qfilters_mlx.assets.prepare_model import prepare_model
from qfilters_mlx.assets.prompts import calibration_text, source_text
from qfilters_mlx.evaluation.bootstrap import gap_ratio
from qfilters_mlx.evaluation.perplexity import full_cache_nll, perplexity
from qfilters_mlx.evaluation.pooled import equivalent_budget, pooled_ratio_bootstrap
from qfilters_mlx.evaluation.simulate import simulated_nll
from sim_arms import N_SINK, Arms, config, default_filters, heads_note  # noqa: F401  (the other benches' names)

PREFIX, TOKENS = 128, 1024
BUDGETS = (64, 128, 256, 512)
ARMS = ("streaming_llm", "default", "oracle", "heads")
BASE_ARMS = ARMS[:3]  # every results file has these; ``heads`` where it was run
SEGMENTS = ("prose-0", "prose-100k", "prose-150k", "code-dataclasses", "code-difflib", "code-argparse")
CELL_BAR = 1.10  # no single (segment, budget) gap ratio above this
CELL_GAP, CELL_FULL = 0.10, 0.005  # the cell rule's allowance: of StreamingLLM's gap, of the full ppl
OUT = common.RESULTS / "held_out_perplexity.json"


def segment_text(name: str) -> tuple[str, str]:
    """``(text, where)`` of a named segment (its first ``--tokens`` tokens are used)."""
    if name.startswith("prose-"):
        at = int(name[len("prose-"):].replace("k", "000"))
        text = source_text()
        start = 0 if at == 0 else text.index("\n\n", at) + 2
        if at and start >= calibration_text_start() - 20_000:
            raise ValueError(f"{name}: too close to the calibration text")
        return text[start:start + 40_000], f"pydoc_data.topics (sorted, joined) from character {start}"
    if name.startswith("code-"):
        module = name[len("code-"):]
        path = importlib.util.find_spec(module).origin
        src = open(path, encoding="utf-8").read()
        starts = [i for i in (src.find("\ndef "), src.find("\nclass ")) if i >= 0]
        start = min(starts) + 1
        where = f"Lib/{os.path.basename(path)} from character {start} (first top-level def/class)"
        return src[start:start + 40_000], where
    raise ValueError(f"unknown segment {name!r}")


def calibration_text_start() -> int:
    """Character where the calibration text starts in the joined documentation text."""
    _, source = calibration_text()
    return int(source.split("chars ")[1].split("..")[0])


def cell_fails(ppl: float, streaming_ppl: float, full_ppl: float) -> bool:
    """The cell rule: ``ppl > streaming_ppl + 0.10 * (streaming_ppl - full_ppl) + 0.005 * full_ppl``."""
    return ppl > streaming_ppl + CELL_GAP * (streaming_ppl - full_ppl) + CELL_FULL * full_ppl


def run(a, results: dict, save) -> None:
    from qfilters_mlx.model_info import model_head_dim

    model, tokenizer = load(str(prepare_model(a.model)))
    arms = Arms(model, tokenizer, model_head_dim(model), results)
    for seg in a.segments:
        text, where = segment_text(seg)
        ids = tokenizer.encode(text, add_special_tokens=False)[:a.tokens]
        if len(ids) < a.tokens:
            raise ValueError(f"{seg}: {len(ids)} tokens, {a.tokens} needed")
        cells = results["segments"].setdefault(seg, {})
        results["segment_sources"][seg] = where
        if "full" not in cells:
            nll = full_cache_nll(model, ids, PREFIX)
            cells["full"] = {"ppl": perplexity(nll), "nll": [round(x, 5) for x in nll]}
            save()
        todo = [(arm, b) for b in a.budgets for arm in a.arms if f"{arm}@{b}" not in cells]
        tic = time.perf_counter()
        masked = arms.for_tokens(ids, todo)
        print(f"{seg} arms for {todo} (oracle scores, default filters): {time.perf_counter() - tic:.0f} s",
              flush=True)
        for arm, b in todo:
            tic = time.perf_counter()
            m = masked[arm, b]
            nll = simulated_nll(model, ids, m, PREFIX)
            cells[f"{arm}@{b}"] = {"arm": arm, "budget": b, "ppl": perplexity(nll),
                                   "recent": m.windows(0, 1)[0], "nll": [round(x, 5) for x in nll]}
            save()
            print(f"{seg} {arm}@{b}: {cells[f'{arm}@{b}']['ppl']:.3f} ({time.perf_counter() - tic:.0f} s)",
                  flush=True)


def complete(results: dict) -> tuple[list, list, list]:
    """The segments with every arm of :data:`BASE_ARMS` measured at every budget any cell has
    (in :data:`SEGMENTS` order), those budgets, and the arms measured on all of them."""
    segs = results.get("segments", {})
    budgets = sorted({c["budget"] for cells in segs.values() for k, c in cells.items() if k != "full"})
    done = [s for s in SEGMENTS if s in segs and "full" in segs[s]
            and all(f"{arm}@{b}" in segs[s] for arm in BASE_ARMS for b in budgets)]
    arms = [arm for arm in ARMS if done and all(f"{arm}@{b}" in segs[s] for s in done for b in budgets)]
    return done, budgets, arms


def statistics(results: dict) -> dict:
    """Pooled ratios with intervals, per-cell ratios and memory-equivalence (JSON-ready)."""
    segs, budgets, arms = complete(results)
    S = results["segments"]
    full = [S[s]["full"]["nll"] for s in segs]
    cells = {(arm, b): [S[s][f"{arm}@{b}"]["nll"] for s in segs] for arm in arms for b in budgets}
    pooled = pooled_ratio_bootstrap(cells, full, block=64, n_boot=2000, seed=0)
    per_cell = {arm: {s: {b: gap_ratio(S[s][f"{arm}@{b}"]["nll"], S[s][f"streaming_llm@{b}"]["nll"],
                                       S[s]["full"]["nll"]) for b in budgets} for s in segs}
                for arm in arms if arm != "streaming_llm"}
    ppl = {arm: {b: float(np.exp(np.mean([np.mean(x) for x in cells[(arm, b)]]))) for b in budgets} for arm in arms}
    full_ppl = float(np.exp(np.mean([np.mean(x) for x in full])))
    sl = [ppl["streaming_llm"][b] for b in budgets]
    equiv = {arm: {b: equivalent_budget(budgets, sl, ppl[arm][b]) for b in budgets}
             for arm in arms if arm != "streaming_llm"} if len(budgets) > 1 else None
    fails = {arm: {s: {b: cell_fails(S[s][f"{arm}@{b}"]["ppl"], S[s][f"streaming_llm@{b}"]["ppl"],
                                      S[s]["full"]["ppl"]) for b in budgets} for s in segs} for arm in per_cell}
    return {"segments": segs, "budgets": budgets, "arms": arms, "cell_fails": fails, "pooled": pooled,
            "per_cell": per_cell, "ppl": ppl, "full_ppl": full_ppl, "equivalent_budget": equiv}


def markdown(results: dict, st: dict) -> str:
    budgets, segs, arms = st["budgets"], st["segments"], st["arms"]
    rivals = arms[1:]
    title = get_model(results.get("model")).title
    heads = heads_note(results) if "heads" in arms else ""
    lines = [f"# Held-out perplexity: StreamingLLM, the default, the oracle"
             f"{', head groups' if 'heads' in arms else ''} ({title})", "",
             "Commands:", "", *[f"    {c}" for c in results["commands"]], "",
             f"Simulated streaming eviction, {PREFIX}-token first call then token by token, "
             f"{results['settings']['tokens'] - PREFIX} scored tokens per segment, 4 sinks; "
             "default and oracle: recent window budget/2. "
             f"Default filters: {re.sub(r'/tmp/[^ ]+ ', '', results.get('default_filters', '-'))}." + (f" {heads}" if heads else ""), "",
             "Segments: " + "; ".join(f"`{s}`: {results['segment_sources'][s]}" for s in segs) + ".", "",
             "Perplexity pooled over the segments (exp of the mean NLL of all scored tokens):", ""]
    rows = [["full cache"] + [f"{st['full_ppl']:.3f}"] * len(budgets)]
    rows += [[arm] + [f"{st['ppl'][arm][b]:.3f}" for b in budgets] for arm in arms]
    lines += common.md_table(["arm"] + [f"budget {b}" for b in budgets], rows, "l" + "r" * len(budgets))
    lines += ["", "Pooled gap ratio to StreamingLLM [95% segments-then-blocks bootstrap interval] "
              "(below 1: fewer perplexity points lost than StreamingLLM):", ""]
    rows = []
    for arm in rivals:
        p = st["pooled"][arm]
        rows.append([arm] + [f"{p[b][0]:.3f} [{p[b][1]:.3f}, {p[b][2]:.3f}]" for b in budgets]
                    + [f"{p['all'][0]:.3f} [{p['all'][1]:.3f}, {p['all'][2]:.3f}]"])
    lines += common.md_table(["arm"] + [f"budget {b}" for b in budgets] + ["all budgets"], rows)
    if st["equivalent_budget"]:
        lines += ["", "Memory-equivalence: the StreamingLLM budget with the arm's pooled perplexity at B, "
                  "as a multiple of B (interpolated in log budget; * extrapolated beyond the measured budgets):",
                  ""]
        rows = []
        for arm in rivals:
            e = st["equivalent_budget"][arm]
            rows.append([arm] + [f"x{e[b][0] / b:.2f}{'*' if e[b][1] else ''} ({e[b][0]:.0f})" for b in budgets])
        lines += common.md_table(["arm"] + [f"budget {b}" for b in budgets], rows)
    lines += ["", "Gap ratio to StreamingLLM per segment (point estimates):", ""]
    rows = []
    for arm in rivals:
        for s in segs:
            r = st["per_cell"][arm][s]
            rows.append([arm, s] + [f"{r[b]:.2f}" for b in budgets])
    lines += common.md_table(["arm", "segment"] + [f"budget {b}" for b in budgets], rows)
    S = results["segments"]
    lines += ["", f"Perplexity per segment, full cache / {' / '.join(arms)}:", ""]
    rows = [[s, f"{S[s]['full']['ppl']:.2f}"] + [" / ".join(f"{S[s][f'{arm}@{b}']['ppl']:.2f}" for arm in arms)
                                                 for b in budgets] for s in segs]
    lines += common.md_table(["segment", "full"] + [f"budget {b}" for b in budgets], rows)
    d = st["pooled"]["default"]
    worst = max((st["per_cell"]["default"][s][b], s, b) for s in segs for b in budgets)
    ok_pool, ok_cell = d["all"][2] <= 1.0, worst[0] <= CELL_BAR
    lines += ["", f"G1 for the default (pooled upper bound <= 1.0, no cell above {CELL_BAR:.2f}): "
              f"pooled over all budgets {d['all'][0]:.3f}, upper bound {d['all'][2]:.3f} "
              f"({'met' if ok_pool else 'not met'}); worst cell {worst[0]:.2f} ({worst[1]}, budget {worst[2]}) "
              f"({'met' if ok_cell else 'not met'}); per budget, upper bounds "
              + ", ".join(f"{b}: {d[b][2]:.3f}" for b in budgets)
              + f". **G1 {'met' if ok_pool and ok_cell else 'not met'}.**", ""]
    lines += [f"Cell rule: a cell fails when the arm's perplexity exceeds StreamingLLM's by more than "
              f"{CELL_GAP:.0%} of StreamingLLM's gap (StreamingLLM - full) plus {CELL_FULL:.1%} of the full "
              "cache's perplexity (allowed: the largest perplexity that passes):", ""]
    rows = [[arm, s, f"b{b}", f"{S[s]['full']['ppl']:.3f}", f"{S[s][f'streaming_llm@{b}']['ppl']:.3f}",
             f"{S[s][f'streaming_llm@{b}']['ppl'] * (1 + CELL_GAP) - S[s]['full']['ppl'] * (CELL_GAP - CELL_FULL):.3f}",
             f"{S[s][f'{arm}@{b}']['ppl']:.3f}", "fail" if st["cell_fails"][arm][s][b] else "pass"]
            for arm in rivals for b in budgets for s in segs]
    lines += common.md_table(["arm", "segment", "budget", "full", "StreamingLLM", "allowed", "arm", "cell"], rows)
    lines += [""] + [f"- {arm}: {sum(f for c in st['cell_fails'][arm].values() for f in c.values())} of "
                     f"{len(segs) * len(budgets)} cells fail; pooled gap ratio {st['pooled'][arm]['all'][0]:.3f} "
                     f"[{st['pooled'][arm]['all'][1]:.3f}, {st['pooled'][arm]['all'][2]:.3f}]" for arm in rivals] + [""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--segments", type=lambda s: s.split(","), default=list(SEGMENTS))
    p.add_argument("--budgets", type=common.int_list, default=list(BUDGETS))
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per segment (prefix included)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS), help="arms to run (of ARMS)")
    p.add_argument("--report", action="store_true", help="only rewrite the tables from the results")
    common.add_model_arg(p)
    a = p.parse_args()
    if set(a.arms) - set(ARMS):
        p.error(f"--arms: unknown {sorted(set(a.arms) - set(ARMS))}; known: {', '.join(ARMS)}")
    for s in a.segments:
        segment_text(s)  # unknown names refused before the model loads
    out = common.Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", common.run_meta(python=sys.version.split()[0]))
    common.model_of(results, a.model, out)
    settings = {"prefix": PREFIX, "tokens": a.tokens, "n_sink": N_SINK}
    if results.setdefault("settings", settings) != settings and not a.report:
        raise SystemExit(f"{out} holds results of other settings ({results['settings']}); use another --out")
    results.setdefault("segments", {})
    results.setdefault("segment_sources", {})
    if not a.report:
        command = " ".join(["python bench/bench_held_out_perplexity.py", *sys.argv[1:]])
        if command not in results.setdefault("commands", []):
            results["commands"].append(command)

        def save():
            out.write_text(json.dumps(results))

        run(a, results, save)
    segs, _, _ = complete(results)
    if segs:
        st = statistics(results)
        results["statistics"] = json.loads(json.dumps(st, default=float))
        out.write_text(json.dumps(results))
        out.with_suffix(".md").write_text(markdown(results, st))
        print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
