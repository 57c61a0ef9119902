"""The RULER leaderboard as a Markdown table and a plot (pure: text and figures)."""

from __future__ import annotations

__all__ = ["figure", "markdown"]

CONCLUSION_START = "<!-- conclusion -->"
CONCLUSION_END = "<!-- /conclusion -->"


def _ci(row, fmt: str = ".1f") -> str:
    lo, hi = row["average_ci95"]
    return f"{row['average']:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


METRIC_TEXT = {
    "forced_match": "teacher-forced match (x100: share of expected strings whose every token is the argmax "
                    "after the gold answer's prefix)",
    "loglik": "teacher-forced log-likelihood of the gold answer, nats per token (higher is better)",
    "string_match": "RULER's string_match_all of the greedy answer (x100; full cache: every sample, other rows: "
                    "the validation subset)",
}
SUBSET_TEXT = {"all": "all samples", "full_correct": "samples the full cache answers correctly"}


def _ratio_table(sub: list[dict], fmt: str) -> list[str]:
    ratios = sorted({r["compression_ratio"] for r in sub if r["method"] != "full"})
    full = next((r for r in sub if r["method"] == "full"), None)
    lines = ["| protocol | method | none (full cache) | " + " | ".join(f"{x:g}" for x in ratios) + " |",
             "|---|---|---|" + "---|" * len(ratios)]
    if full:
        lines.append("| both | full | " + _ci(full, fmt) + " |" + " |" * len(ratios))
    for proto in ("compress_once", "streaming"):
        for m in dict.fromkeys(r["method"] for r in sub if r["protocol"] == proto):
            cells = []
            for x in ratios:
                r = next((r for r in sub if r["protocol"] == proto and r["method"] == m
                          and r["compression_ratio"] == x), None)
                cells.append(_ci(r, fmt) if r else "")
            lines.append(f"| {proto} | {m} | | " + " | ".join(cells) + " |")
    return lines


def _separated(s) -> str:
    return "too few samples" if s is None else "yes" if s else "no"


def _samples_text(rows: list[dict]) -> str:
    n = {}
    for r in rows:
        for t, k in r["n_samples"].items():
            n[t] = max(n.get(t, 0), k)
    return ", ".join(f"{t} {k}" for t, k in n.items())


def _unfit_text(unfit: list[str]) -> str:
    if not unfit:
        return ""
    return (f" {len(unfit)} sample{'s' if len(unfit) > 1 else ''} did not fit this length even with the "
            f"smallest haystack and {'were' if len(unfit) > 1 else 'was'} left out: {', '.join(unfit)}.")


def markdown(board: dict, conclusion: str = "") -> str:
    """Per context length: sample counts and compute per stage; per metric and subset the average
    [95% interval] against compression ratio per (protocol, method); the paired differences per
    method pair (separated or not); the per-task table of the teacher-forced match; the agreement
    of the two scorings; ``conclusion`` (kept between ``<!-- conclusion -->`` markers so a rewrite
    preserves it)."""
    meta, rows = board["meta"], board["rows"]
    lines = ["# RULER (synthetic tasks) on " + meta.get("model", "the model"), ""]
    for c in meta.get("commands") or ([meta["command"]] if meta.get("command") else []):
        lines += [f"Command: `{c}`", ""]
    lines += [CONCLUSION_START, conclusion.strip(), CONCLUSION_END, ""]
    lines += ["Metrics: " + "; ".join(f"*{k}*: {v}" for k, v in METRIC_TEXT.items()) + ". Per task the mean over "
              "samples; *average* the mean over tasks with its 95% interval "
              f"({meta.get('bootstrap', 'bootstrap')}). `full` is kvpress's `no_press`; compress-once is "
              "kvpress's protocol (context compressed once by the ratio, question and answer outside); "
              "streaming keeps `int((1 - ratio) x context tokens)` through the whole prompt (library defaults: "
              "4 sinks, recent window budget/2).", ""]
    if meta.get("haystack"):
        lines += [f"Haystack prose: {meta['haystack']}.", ""]
    if meta.get("filters"):
        f = meta["filters"]
        lines += [f"`qfilters`: calibrated filters `{f['file']}` ({f.get('calibration_tokens')} tokens of "
                  f"{f.get('calibration_text')}); `qfilters_online`: filter estimated from the context's first "
                  "128 queries.", ""]
    secs, counts = meta.get("compute_seconds", {}), meta.get("samples", {})
    for length in sorted({r["data_dir"] for r in rows}, key=int):
        sub = [r for r in rows if r["data_dir"] == length]
        c, s = counts.get(length, {}), secs.get(length, {})
        stages = ", ".join(f"{k} {v / 60:.1f}" for k, v in s.items() if k != "total")
        lines += [f"## {length} tokens", "",
                  f"{c.get('samples', 0)} samples ({c.get('full_correct', 0)} answered correctly by the full "
                  f"cache, {c.get('validation', 0)} in the validation subset); samples per task: "
                  f"{_samples_text([r for r in sub if r['metric'] == 'forced_match' and r['subset'] == 'all'])}. "
                  f"Compute {s.get('total', 0) / 60:.1f} min (sum over samples, wall clock; per stage, min: "
                  f"{stages})." + _unfit_text(meta.get("does_not_fit", {}).get(length, [])), ""]
        for metric, subset, fmt in (("forced_match", "all", ".1f"), ("forced_match", "full_correct", ".1f"),
                                    ("loglik", "all", ".3f"), ("loglik", "full_correct", ".3f"),
                                    ("string_match", "all", ".1f")):
            part = [r for r in sub if r["metric"] == metric and r["subset"] == subset]
            if not part:
                continue
            lines += [f"### {metric}, {SUBSET_TEXT[subset]}", "",
                      f"{METRIC_TEXT[metric]}; samples per task: {_samples_text(part)}.", ""]
            lines += _ratio_table(part, fmt) + [""]
        pairs = [p for p in board.get("paired", []) if p["data_dir"] == length and p["metric"] != "string_match"]
        if pairs:
            lines += ["### Paired differences per method pair", "",
                      "Same samples for both methods; 95% interval; *separated*: the interval excludes 0 "
                      "(not judged below 10 samples).", "",
                      "| metric | subset | protocol | ratio | a - b | difference | samples | separated |",
                      "|---|---|---|---|---|---|---|---|"]
            for p in pairs:
                lo, hi = p["ci95"]
                fmt = ".3f" if p["metric"] == "loglik" else ".1f"
                lines.append(f"| {p['metric']} | {p['subset']} | {p['protocol']} | {p['compression_ratio']:g} | "
                             f"{p['a']} - {p['b']} | {p['difference']:+{fmt}} [{lo:+{fmt}}, {hi:+{fmt}}] | "
                             f"{p['n_samples']} | {_separated(p['separated'])} |")
            lines.append("")
        part = [r for r in sub if r["metric"] == "forced_match" and r["subset"] == "all"]
        if part:
            tasks = list(part[0]["n_samples"])
            lines += ["### Teacher-forced match per task (all samples)", "",
                      "| protocol | method | ratio | " + " | ".join(tasks) + " | average |",
                      "|---|---|---|" + "---|" * (len(tasks) + 1)]
            for r in part:
                lines.append(f"| {r['protocol']} | {r['method']} | {r['compression_ratio']:g} | "
                             + " | ".join(f"{r['scores'].get(t, float('nan')):.0f}" for t in tasks)
                             + f" | {r['average']:.1f} |")
            lines.append("")
    agree = board.get("agreement", {})
    if agree:
        lines += ["## Teacher-forced against greedy scoring", "",
                  "Every (sample, row) scored both ways: the full cache on every sample, every row on the "
                  "validation subset. *equal*: the same share of expected strings; right: share 1.", "",
                  "| rows | count | equal | both right | greedy only | forced only | both wrong |",
                  "|---|---|---|---|---|---|---|"]
        for g, d in agree.items():
            n = max(d["rows"], 1)
            lines.append(f"| {g} | {d['rows']} | {d['equal']} ({100 * d['equal'] / n:.0f}%) | {d['both_right']} | "
                         f"{d['greedy_only']} | {d['forced_only']} | {d['both_wrong']} |")
        lines.append("")
    return "\n".join(lines)


def figure(board: dict):
    """Average teacher-forced match (all samples) against compression ratio per method, one panel
    per context length (compress-once solid, streaming dashed, the full cache dotted), with 95%
    intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = board["rows"]
    lengths = sorted({r["data_dir"] for r in rows}, key=int)
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    colors = {}
    for ax, length in zip(axes[0], lengths):
        sub = [r for r in rows if r["data_dir"] == length and r["metric"] == "forced_match"
               and r["subset"] == "all"]
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
        ax.set_ylabel("teacher-forced match, all samples")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(board["meta"].get("model", ""))
    fig.tight_layout()
    return fig
