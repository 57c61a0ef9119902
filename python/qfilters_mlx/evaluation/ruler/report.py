"""The RULER leaderboard as a Markdown table and a plot (pure: text and figures)."""

from __future__ import annotations

__all__ = ["figure", "markdown"]

CONCLUSION_START = "<!-- conclusion -->"
CONCLUSION_END = "<!-- /conclusion -->"


def _ci(row) -> str:
    lo, hi = row["average_ci95"]
    return f"{row['average']:.1f} [{lo:.1f}, {hi:.1f}]"


def markdown(board: dict, conclusion: str = "") -> str:
    """Tables per context length: the averages against compression ratio per (protocol,
    method), then every row's per-task scores; the paired differences; ``conclusion``
    (kept between ``<!-- conclusion -->`` markers so a rewrite preserves it)."""
    meta, rows = board["meta"], board["rows"]
    lines = ["# RULER (synthetic tasks) on " + meta.get("model", "the model"), ""]
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines += [CONCLUSION_START, conclusion.strip(), CONCLUSION_END, ""]
    lines += ["Scores: RULER's `string_match_all` (share of expected strings in the answer, x100), per task "
              "the mean over samples; *average* the mean over tasks with its 95% interval "
              f"({meta.get('bootstrap', 'bootstrap')}). `full` is kvpress's `no_press`; compress-once is "
              "kvpress's protocol (context compressed once by the ratio, question and answer outside); "
              "streaming keeps `int((1 - ratio) x context tokens)` through the whole prompt.", ""]
    if meta.get("haystack"):
        lines += [f"Haystack prose: {meta['haystack']}.", ""]
    if meta.get("filters"):
        f = meta["filters"]
        lines += [f"`qfilters`: calibrated filters `{f['file']}` ({f.get('calibration_tokens')} tokens of "
                  f"{f.get('calibration_text')}); `qfilters_online`: filter estimated from the context's first "
                  "128 queries.", ""]
    secs = meta.get("compute_seconds", {})
    for length in sorted({r["data_dir"] for r in rows}, key=int):
        sub = [r for r in rows if r["data_dir"] == length]
        n = sub[0]["n_samples"]
        lines += [f"## {length} tokens", "",
                  f"Samples per task: {', '.join(f'{t} {k}' for t, k in n.items())}; compute "
                  f"{secs.get(length, 0) / 60:.1f} min (sum over samples, wall clock).", "",
                  "Average score [95% interval] by compression ratio:", ""]
        ratios = sorted({r["compression_ratio"] for r in sub if r["method"] != "full"})
        full = next((r for r in sub if r["method"] == "full"), None)
        lines += ["| protocol | method | none (full cache) | " + " | ".join(f"{x:g}" for x in ratios) + " |",
                  "|---|---|---|" + "---|" * len(ratios)]
        if full:
            lines.append("| both | full | " + _ci(full) + " |" + " |" * len(ratios))
        for proto in ("compress_once", "streaming"):
            for m in dict.fromkeys(r["method"] for r in sub if r["protocol"] == proto):
                cells = []
                for x in ratios:
                    r = next((r for r in sub if r["protocol"] == proto and r["method"] == m
                              and r["compression_ratio"] == x), None)
                    cells.append(_ci(r) if r else "")
                lines.append(f"| {proto} | {m} | | " + " | ".join(cells) + " |")
        tasks = list(n)
        lines += ["", "Per task:", "", "| protocol | method | ratio | " + " | ".join(tasks) + " | average |",
                  "|---|---|---|" + "---|" * (len(tasks) + 1)]
        for r in sub:
            lines.append(f"| {r['protocol']} | {r['method']} | {r['compression_ratio']:g} | "
                         + " | ".join(f"{r['scores'].get(t, float('nan')):.0f}" for t in tasks)
                         + f" | {r['average']:.1f} |")
        pairs = [p for p in board.get("paired", []) if p["data_dir"] == length]
        if pairs:
            lines += ["", "Paired differences of the average (same samples; 95% interval):", "",
                      "| protocol | ratio | difference | value |", "|---|---|---|---|"]
            for p in pairs:
                lo, hi = p["ci95"]
                lines.append(f"| {p['protocol']} | {p['compression_ratio']:g} | {p['a']} - {p['b']} | "
                             f"{p['difference']:+.1f} [{lo:+.1f}, {hi:+.1f}] |")
        lines.append("")
    return "\n".join(lines)


def figure(board: dict):
    """Average score against compression ratio per method, one panel per context length
    (compress-once solid, streaming dashed, the full cache dotted), with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = board["rows"]
    lengths = sorted({r["data_dir"] for r in rows}, key=int)
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    colors = {}
    for ax, length in zip(axes[0], lengths):
        sub = [r for r in rows if r["data_dir"] == length]
        for proto, style in (("compress_once", "-o"), ("streaming", "--s")):
            for m in dict.fromkeys(r["method"] for r in sub if r["protocol"] == proto):
                pts = sorted((r["compression_ratio"], r["average"], *r["average_ci95"]) for r in sub
                             if r["protocol"] == proto and r["method"] == m)
                x, y, lo, hi = zip(*pts)
                c = colors.setdefault(m, f"C{len(colors)}")
                ax.plot(x, y, style, color=c, label=f"{m} ({proto.replace('_', '-')})")
                ax.fill_between(x, lo, hi, color=c, alpha=0.12)
        full = next((r for r in sub if r["method"] == "full"), None)
        if full:
            ax.axhline(full["average"], color="k", ls=":", label="full cache")
        ax.set_title(f"RULER, {length} tokens")
        ax.set_xlabel("compression ratio (fraction of context removed)")
        ax.set_ylabel("average score (string_match_all)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(board["meta"].get("model", ""))
    fig.tight_layout()
    return fig
