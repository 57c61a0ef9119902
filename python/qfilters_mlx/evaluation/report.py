"""Tables and plots of an evaluation results dict (pure: returns text / figures)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

__all__ = ["figure", "markdown", "ppl_verdicts"]


def _ppl_cells(results, budgets):
    p = results["perplexity"]
    return [c for k, c in p.items() if k != "full" and c.get("budget") in budgets]


def ppl_verdicts(results) -> dict[int, dict]:
    """Per budget: StreamingLLM's perplexity, the best scored arm, and every
    scored arm that beats StreamingLLM (lower perplexity)."""
    out = {}
    for b in results["settings"]["budgets"]:
        cells = _ppl_cells(results, [b])
        sl = next((c for c in cells if c["method"] == "streaming_llm"), None)
        scored = [c for c in cells if c["method"] in ("qfilters", "l2norm")]
        if sl is None or not scored:
            continue
        best = min(scored, key=lambda c: c["ppl"])
        out[b] = {
            "streaming_llm": sl["ppl"],
            "best": best["arm"],
            "best_ppl": best["ppl"],
            "beats": sorted((c["arm"] for c in scored if c["ppl"] < sl["ppl"]),
                            key=lambda a: next(c["ppl"] for c in scored if c["arm"] == a)),
        }
    return out


def _spearman_summary(results):
    """{cached: {method: (mean rho, fraction of heads > 0, n heads)}}."""
    out = {}
    for cached, per_layer in results.get("score_quality", {}).items():
        acc = defaultdict(list)
        for layer in per_layer.values():
            for method, rhos in layer.items():
                acc[method].extend(r for r in rhos if r is not None and not math.isnan(r))
        out[cached] = {m: (float(np.mean(v)), float(np.mean(np.array(v) > 0)), len(v))
                       for m, v in acc.items() if v}
    return out


def _retrieval_budgets(settings) -> list[int]:
    """Budgets of the retrieval table (older results files ran every budget)."""
    return list(settings.get("retrieval_budgets", settings["budgets"]))


def markdown(results, command: str = "") -> str:
    """The markdown report: perplexity, verdicts, retrieval, score quality."""
    s = results["settings"]
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    meta = results.get("meta", {})
    if meta.get("text"):
        lines += [f"Text: {meta['text']}", ""]
    p = results["perplexity"]
    full = p.get("full")
    budgets = list(s["budgets"])
    if full:
        lines += [f"### Streaming perplexity ({full['n_scored']} scored tokens, prefix {s['ppl_prefix']}, "
                  f"n_sink {s['n_sink']}, calib {s['calib_tokens']} keys)", "",
                  f"Full cache: **{full['ppl']:.3f}**. Cells: perplexity (gap to full).", ""]
        arms = []
        for c in _ppl_cells(results, budgets):
            if c["arm"] not in arms:
                arms.append(c["arm"])
        lines.append("| arm | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        lines.append("|---|" + "---|" * len(budgets))
        for a in arms:
            row = []
            for b in budgets:
                c = p.get(f"{a}@{b}")
                row.append("n/a" if c is None else f"{c['ppl']:.2f} (+{c['gap']:.2f})")
            lines.append(f"| {a} | " + " | ".join(row) + " |")
        lines.append("")
        lines.append("`@rF`: recent window = F x budget (4 sinks always kept); streaming_llm keeps "
                     "4 sinks + budget-4 recent tokens.")
        lines.append("")
        for b, v in ppl_verdicts(results).items():
            if v["beats"]:
                lines.append(f"- Budget {b}: StreamingLLM {v['streaming_llm']:.2f}; beaten by "
                             + ", ".join(f"{a} ({p[f'{a}@{b}']['ppl']:.2f})" for a in v["beats"]) + ".")
            else:
                lines.append(f"- Budget {b}: StreamingLLM {v['streaming_llm']:.2f}; **no scored method "
                             f"beats it** (best: {v['best']} {v['best_ppl']:.2f}).")
        lines.append("")

    r = results.get("retrieval", {})
    if r:
        contexts = sorted({c["context"] for c in r.values()})
        n_prompts = len({(c["context"], c["depth"]) for c in r.values()})
        lines += [f"### Pass-key retrieval ({n_prompts} prompts: contexts {contexts} tokens, depths "
                  f"{list(s['retrieval_depths'])}, prefill chunk {s['retrieval_chunk']}, greedy "
                  f"{s['retrieval_answer_tokens']} tokens)", "",
                  "Cells: correct / prompts (per context: " + ", ".join(map(str, contexts)) + ").", ""]
        budgets = _retrieval_budgets(s)
        lines.append("| arm | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        lines.append("|---|" + "---|" * len(budgets))
        by = defaultdict(list)
        for c in r.values():
            by[(c["arm"], c["budget"])].append(c)

        def cell(cs):
            per = [sum(x["correct"] for x in cs if x["context"] == ctx) for ctx in contexts]
            tot = [sum(1 for x in cs if x["context"] == ctx) for ctx in contexts]
            return (f"{sum(per)}/{sum(tot)} (" + ", ".join(f"{a}/{t}" for a, t in zip(per, tot)) + ")")

        if by.get(("full", None)):
            lines.append("| full | " + " | ".join([cell(by[("full", None)])] * len(budgets)) + " |")
        arms = sorted({a for a, b in by if a != "full"})
        for a in arms:
            lines.append(f"| {a} | " + " | ".join(cell(by[(a, b)]) if by.get((a, b)) else "n/a"
                                                for b in budgets) + " |")
        lines.append("")

    sq = _spearman_summary(results)
    if sq:
        lines += [f"### Score quality (Spearman, score of a cached token vs attention it receives from "
                  f"the next {s['sq_window']} queries, averaged over the GQA group; sinks excluded)", ""]
        cached = sorted(sq, key=int)
        methods = list(next(iter(sq.values())))
        lines.append("| method | " + " | ".join(f"{c} cached: mean rho (heads > 0)" for c in cached) + " |")
        lines.append("|---|" + "---|" * len(cached))
        for m in methods:
            lines.append(f"| {m} | " + " | ".join(
                f"{sq[c][m][0]:+.3f} ({100 * sq[c][m][1]:.0f}% of {sq[c][m][2]})" for c in cached) + " |")
        lines.append("")
    from qfilters_mlx.evaluation.protocols import protocols_markdown

    lines.append(protocols_markdown(results))
    return "\n".join(lines)


def figure(results):
    """A matplotlib figure: perplexity vs budget, retrieval accuracy, Spearman per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    s = results["settings"]
    budgets = list(s["budgets"])
    p = results["perplexity"]
    ax = axes[0]
    fams = defaultdict(dict)
    for c in _ppl_cells(results, budgets):
        fams[c["arm"]][c["budget"]] = c["ppl"]
    styles = {"0": ":", "1/4": "--", "1/2": "-", None: "-"}
    for arm, pts in sorted(fams.items()):
        bs = sorted(pts)
        frac = arm.split("@r")[1] if "@r" in arm else None
        lw = 2.5 if arm == "streaming_llm" else 1.3
        ax.plot(bs, [pts[b] for b in bs], styles.get(frac, "-"), marker="o", lw=lw, label=arm)
    if "full" in p:
        ax.axhline(p["full"]["ppl"], color="k", lw=1, label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (tokens per layer and KV head)")
    ax.set_ylabel("streaming perplexity")
    ax.set_title("Perplexity (line style: recent 0 / 1/4 / 1/2 of budget)")
    ax.legend(fontsize=6, ncol=2)

    ax = axes[1]
    budgets = _retrieval_budgets(results["settings"])
    r = results.get("retrieval", {})
    acc = defaultdict(list)
    for c in r.values():
        acc[(c["arm"], c["budget"])].append(c["correct"])
    arms = sorted({a for a, _ in acc if a != "full"})
    width = 0.8 / max(1, len(arms))
    for i, a in enumerate(arms):
        ys = [np.mean(acc[(a, b)]) if acc.get((a, b)) else np.nan for b in budgets]
        ax.bar(np.arange(len(budgets)) + i * width, ys, width, label=a)
    if acc.get(("full", None)):
        ax.axhline(np.mean(acc[("full", None)]), color="k", lw=1, label="full cache")
    ax.set_xticks(np.arange(len(budgets)) + 0.4 - width / 2, [str(b) for b in budgets])
    ax.set_xlabel("budget")
    ax.set_ylabel("pass-key accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("Retrieval")
    ax.legend(fontsize=7)

    ax = axes[2]
    sq = results.get("score_quality", {})
    if sq:
        cached = max(sq, key=int)
        per_layer = sq[cached]
        layers = sorted(per_layer, key=int)
        for m in per_layer[layers[0]]:
            ys = [np.nanmean(np.array(per_layer[l][m], dtype=float)) for l in layers]
            ax.plot([int(l) for l in layers], ys, marker=".", label=m)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"Score quality, {cached} cached tokens")
    ax.set_xlabel("layer")
    ax.set_ylabel("Spearman rho (mean over KV heads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
