"""Tables and plot of the two-segment perplexity run (:mod:`.segments`), with the gap
ratio to StreamingLLM and its block-bootstrap interval (:mod:`.bootstrap`). Pure:
returns text / figures."""

from __future__ import annotations

from qfilters_mlx.evaluation.bootstrap import gap_ratio_ci

__all__ = ["TARGET_RATIO", "ratio_table", "segment_figure", "segment_markdown"]

BLOCK = 64
"""Bootstrap block length in tokens (NLLs of nearby tokens are correlated); shorter runs use
an eighth of their tokens."""
TARGET_RATIO = 0.8
"""The target of the per-head arm: its perplexity gap to the full cache at most 0.8x StreamingLLM's
(docs/evaluation.md, "Two held-out segments, gap ratio to StreamingLLM")."""


def ratio_table(results) -> dict:
    """``{segment: {arm: {budget: {"ppl", "gap", "ratio", "low", "high"}}}}`` for every
    evicting arm but StreamingLLM (whose ratio is 1 by definition)."""
    out = {}
    for seg, cells in results.get("segments", {}).items():
        full = cells.get("full")
        if full is None:
            continue
        rows = out.setdefault(seg, {})
        for key, c in cells.items():
            if key == "full" or c.get("method") == "streaming_llm":
                continue
            sl = cells.get(f"streaming_llm@{c['budget']}")
            if sl is None:
                continue
            block = min(BLOCK, max(1, len(full["nll"]) // 8))
            r, lo, hi = gap_ratio_ci(c["nll"], sl["nll"], full["nll"], block=block)
            rows.setdefault(c["arm"], {})[c["budget"]] = {"ppl": c["ppl"], "gap": c["gap"], "ratio": r,
                                                          "low": lo, "high": hi}
    return out


def segment_markdown(results) -> str:
    """Per segment: perplexity (gap) per arm and budget, then the gap ratio to
    StreamingLLM with its 95% interval, then whether the per-head arm meets the bar."""
    s = results.get("segments_settings", {})
    spans = results.get("segment_spans", {})
    table = ratio_table(results)
    budgets = list(s.get("budgets", []))
    lines = [f"### Two held-out segments ({s.get('ppl_scored')} scored tokens each, prefix "
             f"{s.get('ppl_prefix')}, n_sink {s.get('n_sink')})", ""]
    for seg, cells in results.get("segments", {}).items():
        span = spans.get(seg)
        where = f" (characters {span[0]}..{span[1]})" if span else ""
        full = cells["full"]["ppl"]
        lines += [f"Segment {seg}{where}: full cache **{full:.3f}**. Cells: perplexity (gap to full); "
                  "below it the gap ratio to StreamingLLM [95% block-bootstrap interval].", "",
                  "| arm | " + " | ".join(f"budget {b}" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        arms = []
        for k, c in cells.items():
            if k != "full" and c["arm"] not in arms:
                arms.append(c["arm"])
        for a in arms:
            row = []
            for b in budgets:
                c = cells.get(f"{a}@{b}") if a != "streaming_llm" else cells.get(f"streaming_llm@{b}")
                if c is None:
                    row.append("-")
                    continue
                cell = f"{c['ppl']:.2f} ({c['gap']:+.2f})"
                r = table.get(seg, {}).get(a, {}).get(b)
                if r is not None:
                    cell += f"<br>x{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
                row.append(cell)
            lines.append(f"| {a} | " + " | ".join(row) + " |")
        lines.append("")
    ph = {seg: rows.get("qfilters-perhead", {}) for seg, rows in table.items()}
    if any(ph.values()):
        lines.append(f"Per-head arm against the bar (gap <= {TARGET_RATIO}x StreamingLLM's):")
        lines.append("")
        for seg, rows in ph.items():
            for b in budgets:
                r = rows.get(b)
                if r is None:
                    continue
                verdict = "meets" if r["ratio"] <= TARGET_RATIO else "misses"
                lines.append(f"- segment {seg}, budget {b}: x{r['ratio']:.2f} [{r['low']:.2f}, "
                             f"{r['high']:.2f}]: {verdict} the bar")
        lines.append("")
    return "\n".join(lines)


def segment_figure(results):
    """Gap ratio to StreamingLLM vs budget, one panel per segment, 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = ratio_table(results)
    fig, axes = plt.subplots(1, max(1, len(table)), figsize=(5.5 * max(1, len(table)), 4), squeeze=False)
    for ax, (seg, rows) in zip(axes[0], sorted(table.items())):
        for arm, per_b in sorted(rows.items()):
            bs = sorted(per_b)
            r = [per_b[b]["ratio"] for b in bs]
            err = [[per_b[b]["ratio"] - per_b[b]["low"] for b in bs],
                   [per_b[b]["high"] - per_b[b]["ratio"] for b in bs]]
            ax.errorbar(bs, r, yerr=err, marker="o", capsize=3, label=arm)
        ax.axhline(1.0, color="gray", lw=1, label="StreamingLLM")
        ax.axhline(TARGET_RATIO, color="gray", lw=1, ls="--", label=f"{TARGET_RATIO}x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per layer and KV head)")
        ax.set_ylabel("perplexity gap / StreamingLLM's gap")
        ax.set_title(f"Segment {seg}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
