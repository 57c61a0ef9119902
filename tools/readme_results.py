"""Regenerate the result tables of README.md and docs/*.md from the committed results (or check them).

README.md and the pages of docs/ mark every generated block::

    <!-- results: bench/results/eval_smollm2.json#Streaming perplexity -->
    ...generated markdown...
    <!-- /results -->

The source after ``#`` names what is rendered:

- ``eval_*.json#<title>``: the section of the evaluation report
  (:func:`qfilters_mlx.evaluation.report.markdown`, the text ``qfilters-mlx eval``
  writes next to its JSON) whose ``### `` heading starts with ``<title>``;
- ``eval_*.json#segments``: :func:`qfilters_mlx.evaluation.segment_report.segment_markdown`
  without its ``### `` heading (the page around the block names it);
- ``*.safetensors#windows``: the per-head windows a filters file holds (rule, mean window,
  share of heads at 0 and at ``budget - n_sink``, and the calibration measures of the
  chosen windows against budget/2 and StreamingLLM, from its ``recent_summary``);
- ``mutation.json#table``: the per-module mutation scores (``tools/mutation_report.py``'s
  :func:`table`);
- ``eval_*.json#tradeoff``: the front page's table: the full cache, StreamingLLM and the
  calibrated query filter (recent budget/2) at every budget, with each budget's share of the
  full cache's tokens at the end of the scored text;
- ``*.md#table`` (``#table 2``, ...): the first (second, ...) Markdown table of a committed
  results file, as the benchmark wrote it.

Usage (from the repository root, the installed package)::

    python tools/readme_results.py            # rewrite the blocks of README.md and docs/*.md
    python tools/readme_results.py --check    # exit 1 naming the stale blocks

``tests/project/test_readme_results.py`` runs the check, so the tables cannot drift from the
committed results.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: (?P<src>[^#\s]+)#(?P<what>[^>]+?) -->\n)(?P<body>.*?)(<!-- /results -->)",
                   re.S)


def report_section(results: dict, title: str) -> str:
    """The ``### title...`` section of the evaluation report of ``results``, without its heading."""
    from qfilters_mlx.evaluation.report import markdown

    parts = re.split(r"^### ", markdown(results), flags=re.M)
    for part in parts[1:]:
        if part.startswith(title):
            return part.split("\n", 1)[1].strip("\n") + "\n"
    raise ValueError(f"the report has no section starting with {title!r}")


def windows_table(path: Path) -> str:
    """Markdown table of the per-head windows stored in a filters file."""
    from safetensors import safe_open

    with safe_open(str(path), "numpy") as f:
        meta = f.metadata()
    if "recent_summary" not in meta:
        raise ValueError(f"{path} holds no per-head window summary")
    summary = json.loads(meta["recent_summary"])
    n_sink = int(meta["recent_n_sink"])
    rows = ["| budget | rule | mean window | heads at 0 / at budget - n_sink | captured attention mass: "
            "chosen / budget/2 / StreamingLLM | attention-output error: chosen / budget/2 / StreamingLLM |",
            "|---|---|---|---|---|---|"]
    for b, s in sorted(summary.items(), key=lambda kv: int(kv[0])):
        err = (f"{s['output_chosen']:.4g} / {s['output_half']:.4g} / {s['output_streaming']:.4g}"
               if "output_chosen" in s else "-")
        rows.append(f"| {b} | {s.get('rule', 'mass')} | {s['mean_window']:.1f} | {s['share_zero']:.0%} / "
                    f"{s['share_full']:.0%} | {s['mass_chosen']:.3f} / {s['mass_half']:.3f} / "
                    f"{s['mass_streaming']:.3f} | {err} |")
    return "\n".join(rows) + f"\n\n(n_sink {n_sink}; budget/2: the grid window nearest budget/2.)\n"


def markdown_table(path: Path, what: str) -> str:
    """The n-th Markdown table of a results file (``what``: ``"table"`` or ``"table N"``)."""
    n = int(what.split()[1]) if " " in what else 1
    tables, current = [], []
    for line in path.read_text().splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if not 1 <= n <= len(tables):
        raise ValueError(f"{path.name} has {len(tables)} table(s), no table {n}")
    return "\n".join(tables[n - 1]) + "\n"


TRADEOFF_ARMS = (("StreamingLLM", "streaming_llm@{b}"),
                 ("Q-Filters, calibrated query filter", "qfilters-calibrated@r1/2@{b}"))


def tradeoff_table(results: dict) -> str:
    """Perplexity of the full cache, StreamingLLM and the calibrated filter per budget, with the
    budget's share of the tokens the full cache holds at the end of the scored text."""
    budgets = results["settings"]["budgets"]
    ppl = results["perplexity"]
    total = results["settings"]["ppl_prefix"] + results["settings"]["ppl_scored"]
    rows = ["| | full cache | " + " | ".join(f"budget {b}" for b in budgets) + " |",
            "|---|---:|" + "---:|" * len(budgets),
            f"| KV cache (tokens kept, share of {total:,}) | 100% | "
            + " | ".join(f"{b / total:.1%}" for b in budgets) + " |"]
    for label, key in TRADEOFF_ARMS:
        rows.append(f"| perplexity, {label} | {ppl['full']['ppl']:.2f} | "
                    + " | ".join(f"{ppl[key.format(b=b)]['ppl']:.2f}" for b in budgets) + " |")
    return "\n".join(rows) + "\n"


def render(src: str, what: str) -> str:
    """The generated markdown of one block."""
    path = REPO / src
    if what == "windows":
        return windows_table(path)
    if path.suffix == ".md":
        return markdown_table(path, what)
    results = json.loads(path.read_text())
    if what == "table":
        if str(REPO / "tools") not in sys.path:
            sys.path.insert(0, str(REPO / "tools"))
        from mutation_report import table

        return table(results)
    if what == "tradeoff":
        return tradeoff_table(results)
    if what == "segments":
        from qfilters_mlx.evaluation.segment_report import segment_markdown

        text = segment_markdown(results).strip("\n")
        # without the report's own heading: four blocks on one page would share its anchor
        return re.sub(r"\A### [^\n]*\n+", "", text) + "\n"
    return report_section(results, what)


def regenerate(text: str) -> tuple[str, list[str]]:
    """``(new README text, names of the blocks that changed)``."""
    stale = []

    def sub(m):
        body = render(m["src"], m["what"])
        if body != m["body"]:
            stale.append(f"{m['src']}#{m['what']}")
        return m.group(1) + body + m.group(5)

    return BLOCK.sub(sub, text), stale


def documents() -> list[Path]:
    """README.md and every page of docs/ (the files that may hold generated blocks)."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only report stale blocks (exit 1 if any)")
    p.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/*.md")
    a = p.parse_args()
    status = 0
    for path in a.files or documents():
        new, stale = regenerate(path.read_text())
        if a.check:
            for s in stale:
                print(f"stale block in {path.name}: {s} (run python tools/readme_results.py)", file=sys.stderr)
            status |= bool(stale)
            continue
        path.write_text(new)
        print(f"{path.name}: {len(stale)} block(s) rewritten" + (": " + ", ".join(stale) if stale else ""))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
