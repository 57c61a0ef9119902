"""Pass-key recall beyond the recent window at 4x and 8x compression of the prompt: the full
cache, StreamingLLM, the library's default and the oracle (SmolLM2-135M-Instruct).

Prompts (:func:`qfilters_mlx.evaluation.recall.needle_prompt`): the instruction, about
:data:`CONTEXT` tokens of CPython's reference documentation (whole paragraphs from the first
paragraph after characters 200,000 / 215,000 / 230,000 / 245,000 of the joined
``pydoc_data.topics`` text, before the calibration text at 300,155), a 5-digit pass key at
depth 0.1 / 0.3 / 0.5 of it, the question, then the answer the full cache gives
(``"The secret pass key is "`` and the key), teacher-forced. Budgets 128 and 64: the prompt
(about 530 tokens) compressed about 4x and 8x; the key sits further from the question than
every arm's recent window (StreamingLLM's is budget - 4 tokens; the default's and the
oracle's budget/2).

Each (prompt, arm, budget) is one simulated streaming pass (:mod:`qfilters_mlx.evaluation.simulate`:
the first :data:`PREFIX` tokens in one call, then token by token: eviction runs while the prompt is
read, the strictest case; mlx-lm's 2,048-token prefill would show a prompt this short whole to its
own queries). A prompt counts as recalled when every key token of the answer is the model's
first choice (the argmax of the teacher-forced logits: what greedy decoding emits after that
answer prefix). Shares are counted on the prompts the full cache recalls (the arms are run only
on those), with exact (Clopper-Pearson) 95% intervals (``scipy.stats.binomtest``).

Arms: ``streaming_llm``; ``default`` (the filter ``for_model`` calibrates on first use, recent
budget/2); ``oracle`` (the default's keep rule, each key scored by the attention it receives in the
full-cache pass of the same sequence, question and answer included, from the queries after it left
the recent window: :func:`qfilters_mlx.evaluation.oracle.oracle_arms`); ``heads``
(``heads="calibrated"``: the per-head budgets and windows of
:func:`qfilters_mlx.cache.head_group_build.resolve_heads` at the budget, with the default's filter;
``--arms`` runs some arms only, keeping the others' cells); and, not run unless named in ``--arms``,
head groups whose big heads keep their tokens by another rule (``sim_arms.BIG_HEAD_RULES``:
``heads_norm`` the keys of lowest L2 norm, ``heads_window`` a recent window of their whole budget,
``heads_oracle`` the oracle's score inside the big heads, the ceiling for a score there). The
shares count the arms run on every prompt the full cache recalls.

Usage (resumable; ``--report`` rewrites the tables only)::

    python bench/bench_recall_beyond_window.py [--offsets 200000,215000] [--depths 0.1,0.3]
    python bench/bench_recall_beyond_window.py --kept   # is the needle in the cache at the answer?
    python bench/bench_recall_beyond_window.py --context 950 --budgets 256,128 \
        --out bench/results/recall_beyond_window_1k.json   # prompts of about 1,070 tokens
    python bench/bench_recall_beyond_window.py --arms heads   # head groups added to the results
    python bench/bench_recall_beyond_window.py --context 1400 --depths 0.1,0.3 --budgets 384,192 \
        --arms streaming_llm,default,heads --out bench/results/recall_beyond_window_long.json
    python bench/bench_recall_beyond_window.py --model qwen2.5-coder-0.5b \
        --out bench/results/recall_beyond_window_qwen.json   # another registered model
    python bench/bench_recall_beyond_window.py --context 2000 --depths 0.1,0.3,0.5,0.7 \
        --offsets 200000,230000 --budgets 256 \
        --arms streaming_llm,default,oracle,heads,heads_norm,heads_window,heads_oracle \
        --out bench/results/recall_big_heads.json   # what the big heads keep, by distance
    python bench/bench_recall_beyond_window.py ... --kept   # the same arguments: is the key in the cache,
        # and for head groups in their big heads, at the answer (a table by distance to the key)

Writes ``bench/results/recall_beyond_window.json`` and ``.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import common  # noqa: F401  (fast BLAS before MLX)
import mlx.core as mx
import numpy as np
from mlx_lm import load
from scipy.stats import binomtest

from sim_arms import BIG_HEAD_RULES, Arms, big_head_rows, heads_note
from qfilters_mlx.assets.models import get_model
from qfilters_mlx.assets.prepare_model import prepare_model
from qfilters_mlx.assets.prompts import source_text
from qfilters_mlx.evaluation.recall import full_predictions, key_recall, needle_prompt
from qfilters_mlx.evaluation.retrieval import pass_key
from qfilters_mlx.evaluation.simulate import simulated_predictions

CONTEXT, PREFIX = 400, 32
BUDGETS = (128, 64)
ARMS = ("streaming_llm", "default", "oracle", "heads", *BIG_HEAD_RULES)
DEFAULT_ARMS = ARMS[:4]
OFFSETS = (200_000, 215_000, 230_000, 245_000)
DEPTHS = (0.1, 0.3, 0.5)
OUT = common.RESULTS / "recall_beyond_window.json"


def run(a, results: dict, save) -> None:
    from qfilters_mlx.model_info import model_head_dim

    model, tokenizer = load(str(prepare_model(a.model)))
    arms = Arms(model, tokenizer, model_head_dim(model), results)
    text = source_text()
    for off in a.offsets:
        hay = text[text.index("\n\n", off) + 2:]
        for depth in a.depths:
            name = f"{off}@{depth}"
            p = needle_prompt(tokenizer, hay, a.context, depth, pass_key(off, a.context, depth))
            cell = results["prompts"].setdefault(name, {})
            cell.update(prompt_tokens=p.prompt_tokens, needle_distance=p.distance, key=p.key,
                        sequence_tokens=len(p.tokens))
            if "full" not in cell:
                nll, arg = full_predictions(model, p.tokens, PREFIX)
                ok, key_nll = key_recall(p, nll, arg, PREFIX)
                cell["full"] = {"recalled": ok, "key_nll": key_nll}
                save()
            if not cell["full"]["recalled"]:
                print(f"{name}: the full cache misses it; arms not run", flush=True)
                continue
            todo = [(arm, b) for b in a.budgets for arm in a.arms if f"{arm}@{b}" not in cell]
            masked = arms.for_tokens(p.tokens, todo)
            for arm, b in todo:
                tic = time.perf_counter()
                m = masked[arm, b]
                nll, arg = simulated_predictions(model, p.tokens, m, PREFIX)
                ok, key_nll = key_recall(p, nll, arg, PREFIX)
                cell[f"{arm}@{b}"] = {"recalled": ok, "key_nll": key_nll, "argmax_key": [arg[i - PREFIX] for i in
                                                                                          p.key_positions]}
                save()
                print(f"{name} {arm}@{b}: {'recalled' if ok else 'missed'} (key NLL {key_nll:.2f}, "
                      f"{time.perf_counter() - tic:.0f} s)", flush=True)


def needle_kept(model, tokenizer, a, results: dict, save) -> None:
    """Per counted prompt, arm and budget: the share of (layer, KV head, key token) where the
    needle's key tokens are in what the cache holds when the answer's first key token is
    predicted (:func:`~qfilters_mlx.evaluation.simulate.keep_masks` on the arm's scores of the
    full-cache keys: exact for StreamingLLM and the oracle, whose scores do not depend on
    eviction; for the default the keys of an evicting pass differ slightly from these)."""
    from qfilters_mlx.evaluation.simulate import keep_masks
    from qfilters_mlx.filters.window_capture import keys_and_queries
    from qfilters_mlx.model_info import model_head_dim

    arms = Arms(model, tokenizer, model_head_dim(model))
    text = source_text()
    for name, cell in results["prompts"].items():
        if not cell["full"]["recalled"] or "kept" in cell:
            continue
        off, depth = name.split("@")
        hay = text[text.index("\n\n", int(off)) + 2:]
        p = needle_prompt(tokenizer, hay, a.context, float(depth), cell["key"])
        (layers,) = keys_and_queries(model, [p.tokens[:-1]])
        masked = arms.for_tokens(p.tokens, [(arm, b) for b in a.budgets for arm in a.arms])
        t = p.key_positions[0] - 1  # the query that predicts the answer's first key token
        needle = range(p.needle_position, p.needle_position + len(p.key_positions))
        kept, held = {}, {}
        for b in a.budgets:
            for arm in a.arms:
                m = masked[arm, b]
                hits = []
                for layer, (keys, _, _) in enumerate(layers):
                    sc = np.array(m.scores(layer, mx.array(keys)[None]).astype(mx.float32))[0]
                    mask = keep_masks(sc, m.budget(layer), 4, m.windows(layer, keys.shape[0]), PREFIX)
                    hits.append(mask[:, t, list(needle)])
                held[arm] = np.stack(hits)  # [layers, KV heads, key tokens]
                kept[f"{arm}@{b}"] = float(held[arm].mean())
                big = np.array(big_head_rows(m, b, len(layers), layers[0][0].shape[0]))
                if big.any():  # head groups: the share in their big heads alone
                    kept[f"{arm}@{b} big"] = float(held[arm][big].mean())
            for arm in a.arms if "oracle" in a.arms else ():  # of the (layer, head, token) the oracle holds, the share this arm holds too
                kept[f"{arm}@{b} of oracle"] = float((held[arm] & held["oracle"]).sum() / max(1, held["oracle"].sum()))
        cell["kept"] = kept
        save()
        print(f"{name} needle kept: " + ", ".join(f"{k} {v:.2f}" for k, v in kept.items()), flush=True)


def arms_run(results: dict) -> list[str]:
    """The arms of :data:`ARMS` with a cell on some prompt."""
    return [arm for arm in ARMS if any(k.startswith(f"{arm}@") for c in results["prompts"].values() for k in c)]


def counted(results: dict, arms: list[str]) -> list[str]:
    """The prompts the full cache recalls on which every arm of ``arms`` has run at every budget."""
    P, budgets = results["prompts"], results["settings"]["budgets"]
    return [n for n, c in P.items() if c.get("full", {}).get("recalled")
            and all(f"{arm}@{b}" in c for arm in arms for b in budgets)]


def summary(results: dict) -> dict:
    """Per (arm, budget): recalled / prompts the full cache recalls, its exact 95% interval,
    and the median key NLL (nats), over the prompts where every arm run (:func:`arms_run`) has run."""
    P = results["prompts"]
    budgets, arms = results["settings"]["budgets"], arms_run(results)
    hits = [n for n, c in P.items() if c.get("full", {}).get("recalled")]
    done = counted(results, arms)
    out = {"prompts": len(P), "full_recalled": len(hits), "counted": len(done), "arms": arms, "cells": {}}
    for b in budgets:
        for arm in arms:
            k = sum(P[n][f"{arm}@{b}"]["recalled"] for n in done)
            ci = binomtest(k, len(done)).proportion_ci(0.95, method="exact") if done else None
            out["cells"][f"{arm}@{b}"] = {
                "recalled": k, "of": len(done), "low": ci.low if ci else None, "high": ci.high if ci else None,
                "median_key_nll": float(np.median([P[n][f"{arm}@{b}"]["key_nll"] for n in done])) if done else None,
                "needle_kept": (float(np.mean([P[n]["kept"][f"{arm}@{b}"] for n in done]))
                                if done and all(f"{arm}@{b}" in P[n].get("kept", {}) for n in done) else None),
                "needle_kept_big": (float(np.mean([P[n]["kept"][f"{arm}@{b} big"] for n in done]))
                                    if done and all(f"{arm}@{b} big" in P[n].get("kept", {}) for n in done)
                                    else None),
                "needle_kept_of_oracle": (
                    float(np.mean([P[n]["kept"][f"{arm}@{b} of oracle"] for n in done]))
                    if done and all(f"{arm}@{b} of oracle" in P[n].get("kept", {}) for n in done) else None)}
    out["median_full_key_nll"] = float(np.median([P[n]["full"]["key_nll"] for n in done])) if done else None
    return out


def markdown(results: dict, s: dict) -> str:
    P = results["prompts"]
    budgets = results["settings"]["budgets"]
    ptoks = [c["prompt_tokens"] for c in P.values()]
    dist = [c["needle_distance"] for c in P.values()]
    title = get_model(results.get("model")).title
    lines = [f"# Pass-key recall beyond the recent window ({title}, teacher-forced)", "",
             "Commands:", "", *[f"    {c}" for c in results["commands"]], "",
             f"{s['prompts']} prompts of {min(ptoks)}-{max(ptoks)} tokens (key {min(dist)}-{max(dist)} tokens before "
             f"the end of the prompt); the full cache recalls the key in {s['full_recalled']} of them; "
             f"shares below over the {s['counted']} of those where every arm ran. Default filters: "
             f"{re.sub(r'/tmp/[^ ]+ ', '', results.get('default_filters', '-'))}."
             + (f" {heads_note(results)}" if "heads" in results else ""), "",
             "Recalled / prompts the full cache recalls [exact 95% interval]; median NLL of the key's "
             f"tokens in nats (full cache: {s['median_full_key_nll']:.2f}); key kept: the share of (layer, KV "
             "head, key token) where the needle's key tokens are in the cache when the answer's first key "
             "token is predicted, and in brackets the share of the (layer, KV head, key token) the oracle keeps "
             "that the arm keeps too (means over prompts; `--kept`):", ""]
    rows, arms = [], s["arms"]
    for arm in arms:
        row = [arm]
        for b in budgets:
            c = s["cells"][f"{arm}@{b}"]
            kept = ("" if c["needle_kept"] is None else f"; key kept {c['needle_kept']:.0%}" + (
                "" if c["needle_kept_of_oracle"] is None else f" ({c['needle_kept_of_oracle']:.0%} of the oracle's)")
                + ("" if c["needle_kept_big"] is None else f", in the big heads {c['needle_kept_big']:.0%}"))
            row.append(f"{c['recalled']}/{c['of']} [{c['low']:.2f}, {c['high']:.2f}]; "
                       f"NLL {c['median_key_nll']:.2f}{kept}")
        rows.append(row)
    head = [f"budget {b} (x{np.mean(ptoks) / b:.1f})" for b in budgets]
    lines += common.md_table(["arm"] + head, rows)
    lines += ["", "Per prompt (offset@depth: key distance; R recalled, - missed; order: "
              + ", ".join(f"{arm}@{b}" for b in budgets for arm in arms) + "):", ""]
    rows = []
    for n, c in P.items():
        marks = " ".join(("R" if c[f"{arm}@{b}"]["recalled"] else "-") if f"{arm}@{b}" in c else "."
                         for b in budgets for arm in arms)
        rows.append([n, c["needle_distance"], "R" if c["full"]["recalled"] else "-", marks])
    lines += common.md_table(["prompt", "key distance", "full", "arms"], rows)
    if "heads" in results:
        lines += ["", *by_distance(results, s)]
    return "\n".join(lines) + "\n"


def by_distance(results: dict, s: dict) -> list[str]:
    """Lines of a table: per budget and arm, recalled / counted prompts whose key lies within the
    big heads' budget of the prompt's end and beyond it, with the share of the key's tokens the big
    heads hold (``--kept``) where it was measured."""
    P, rows = results["prompts"], []
    done = counted(results, s["arms"])
    for b in results["settings"]["budgets"]:
        if str(b) not in results["heads"]:
            continue
        big = max(x for row in results["heads"][str(b)]["budgets"] for x in row)
        bins = ([n for n in done if P[n]["needle_distance"] <= big], [n for n in done if P[n]["needle_distance"] > big])
        for arm in s["arms"]:
            cells = []
            for names in bins:
                k = sum(P[n][f"{arm}@{b}"]["recalled"] for n in names)
                inbig = [P[n]["kept"][f"{arm}@{b} big"] for n in names if f"{arm}@{b} big" in P[n].get("kept", {})]
                cells.append(f"{k}/{len(names)}" + (f"; key in the big heads {np.mean(inbig):.0%}"
                                                     if names and len(inbig) == len(names) else ""))
            rows.append([b, big, arm, *cells])
    head = ["budget", "big heads' budget", "arm", "key at most the big heads' budget back", "key further back"]
    if not rows:
        return []
    return ["Recalled by the distance back to the key (prompts the full cache recalls; key in the big heads: "
            "the share of (big layer-head, key token) held when the answer's first key token is predicted, "
            "`--kept`):", "", *common.md_table(head, rows)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--offsets", type=common.int_list, default=list(OFFSETS))
    p.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], default=list(DEPTHS))
    p.add_argument("--budgets", type=common.int_list, default=list(BUDGETS))
    p.add_argument("--context", type=int, default=CONTEXT, help="context tokens around the key")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(DEFAULT_ARMS), help="arms to run (of ARMS)")
    p.add_argument("--report", action="store_true")
    p.add_argument("--kept", action="store_true", help="only measure whether the needle is in the cache")
    common.add_model_arg(p)
    a = p.parse_args()
    if set(a.arms) - set(ARMS):
        p.error(f"--arms: unknown {sorted(set(a.arms) - set(ARMS))}; known: {', '.join(ARMS)}")
    out = common.Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", common.run_meta(python=sys.version.split()[0]))
    common.model_of(results, a.model, out)
    settings = {"context": a.context, "budgets": a.budgets, "prefix": PREFIX, "n_sink": 4}
    if results.setdefault("settings", settings) != settings and not a.report:
        raise SystemExit(f"{out} holds results of other settings ({results['settings']}); use another --out")
    results.setdefault("prompts", {})
    if not a.report:
        command = " ".join(["python bench/bench_recall_beyond_window.py", *sys.argv[1:]])
        if command not in results.setdefault("commands", []):
            results["commands"].append(command)
        if a.kept:
            model, tokenizer = load(str(prepare_model(a.model)))
            needle_kept(model, tokenizer, a, results, lambda: out.write_text(json.dumps(results)))
        else:
            run(a, results, lambda: out.write_text(json.dumps(results)))
    s = summary(results)
    results["summary"] = s
    out.write_text(json.dumps(results))
    if s["counted"]:
        out.with_suffix(".md").write_text(markdown(results, s))
        print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
