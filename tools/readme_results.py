"""Regenerate README.md's result tables from the committed results (or check them).

README.md marks every generated block::

    <!-- results: bench/results/eval_smollm2.json#Streaming perplexity -->
    ...generated markdown...
    <!-- /results -->

The source after ``#`` names what is rendered:

- ``eval_*.json#<title>``: the section of the evaluation report
  (:func:`qfilters_mlx.evaluation.report.markdown`, the text ``qfilters-mlx eval``
  writes next to its JSON) whose ``### `` heading starts with ``<title>``;
- ``eval_*.json#segments``: :func:`qfilters_mlx.evaluation.segment_report.segment_markdown`;
- ``*.safetensors#windows``: the per-head windows a filters file holds (rule, mean window,
  share of heads at 0 and at ``budget - n_sink``, and the calibration measures of the
  chosen windows against budget/2 and StreamingLLM, from its ``recent_summary``);
- ``mutation.json#table``: the per-module mutation scores (``tools/mutation_report.py``'s
  :func:`table`).

Usage (from the repository root, the installed package)::

    python tools/readme_results.py            # rewrite README.md's blocks
    python tools/readme_results.py --check    # exit 1 naming the stale blocks

``tests/test_readme_results.py`` runs the check, so README's tables cannot drift from the
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


def render(src: str, what: str) -> str:
    """The generated markdown of one block."""
    path = REPO / src
    if what == "windows":
        return windows_table(path)
    results = json.loads(path.read_text())
    if what == "table":
        if str(REPO / "tools") not in sys.path:
            sys.path.insert(0, str(REPO / "tools"))
        from mutation_report import table

        return table(results)
    if what == "segments":
        from qfilters_mlx.evaluation.segment_report import segment_markdown

        return segment_markdown(results).strip("\n") + "\n"
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only report stale blocks (exit 1 if any)")
    p.add_argument("--readme", default=str(REPO / "README.md"))
    a = p.parse_args()
    readme = Path(a.readme)
    new, stale = regenerate(readme.read_text())
    if a.check:
        for s in stale:
            print(f"stale README block: {s} (run python tools/readme_results.py)", file=sys.stderr)
        return 1 if stale else 0
    readme.write_text(new)
    print(f"{len(stale)} block(s) rewritten" + (": " + ", ".join(stale) if stale else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
