"""Cost of one RULER sample before and after the shared, teacher-forced runner, on the same sample.

"Before" is the RULER package as it was at commit ``--before`` (default :data:`BEFORE`: every row
compressed into its own cache object, every row decoded greedily in one batch padded to the whole
context, the LM head on every prefill position), loaded from git into a private module name so
that both run in one process; "after" is the checked-out runner
(:func:`qfilters_mlx.evaluation.ruler.runner.run_sample`). Both run on the same sample, the same
model, filters and settings (chunk 512, calib 128), alternating ``before, after, before, after``
per ``--repeats`` (odd repeats in the reverse order) so a change of machine load hits both alike;
the ratio of the paired times is the result, in wall-clock seconds and in the process's CPU
seconds (less sensitive to other jobs on the machine, though BLAS threads waiting for a core
count too).

Usage (from the repository root)::

    python bench/bench_ruler_sample_cost.py [--samples 2048/niah_single_2/0 2048/cwe/0] \
        [--which before after after_all_arms] [--repeats 1] [--tag NAME] \
        [--out bench/results/ruler_sample_cost.json]

"after" is the checked-out runner with the default arms (``qfilters``, ``knorm``, ``streaming_llm``),
"after_all_arms" with every arm of "before" (adding ``qfilters_online`` and ``random``), both as a
sample outside the greedy validation subset (greedy decoding for the full cache only). ``--tag``
names an invocation's runs in the table, so that runs of another checkout stay apart.

Writes ``--out`` (JSON: every timed run with its stages and the load average before and after) and
its ``.md`` (per sample, the paired ratios after / before); ``--report-only`` rewrites the ``.md``
from the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import common  # noqa: F401  (fast BLAS before MLX)
import mlx.core as mx
from mlx_lm import load

from qfilters_mlx.assets.prepare_model import prepare_model
from qfilters_mlx.assets.prompts import source_text
from qfilters_mlx.evaluation.ruler.haystack import essay_sentences
from qfilters_mlx.evaluation.ruler.prompt import fit, sample_tokens
from qfilters_mlx.evaluation.ruler.tasks import TASKS, Sources
from qfilters_mlx.filters.calibration import load_filters

BEFORE = "ee46291"
FILTERS = common.RESULTS / "smollm2_filters.safetensors"
RULER = "python/qfilters_mlx/evaluation/ruler"
ALL_ARMS = ("qfilters", "qfilters_online", "knorm", "streaming_llm", "random")


def before_package(rev: str):
    """The RULER package of commit ``rev`` as the module ``ruler_before`` (its imports of
    ``qfilters_mlx.evaluation.ruler`` rewritten; everything else it imports is the checkout's)."""
    root = Path(tempfile.mkdtemp(prefix="ruler_before_"))
    pkg = root / "ruler_before"
    pkg.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, RULER + "/"], cwd=common.ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=common.ROOT, check=True,
                              capture_output=True, text=True).stdout
        (pkg / Path(name).name).write_text(text.replace("qfilters_mlx.evaluation.ruler", "ruler_before"))
    sys.path.insert(0, str(root))
    return importlib.import_module("ruler_before.runner")


def write_markdown(out: Path, res: dict) -> None:
    """``out`` with ``.md``: per (sample, repeat) the seconds of each variant, the paired ratios
    after / before, the stages of "after" and the load averages."""
    runs = defaultdict(dict)
    for r in res["runs"]:
        runs[(r["sample"], r.get("tag", ""), r["repeat"])][r["variant"]] = r
    rows = []
    for (sample, tag, rep), v in sorted(runs.items(), key=lambda kv: (kv[0][1] != "", kv[0])):
        b, a, aa = v.get("before"), v.get("after"), v.get("after_all_arms")

        def cell(x, key="seconds"):
            return f"{x[key]:.1f}" if x and key in x else ""

        def ratio(x, key="seconds"):
            return f"{x[key] / b[key]:.2f}" if x and b and key in x and key in b else ""

        st = a["stages"] if a else {}
        rows.append([sample, tag or "first", rep, cell(b), cell(a), ratio(a), cell(aa), ratio(aa),
                     ratio(a, "cpu_seconds"), ratio(aa, "cpu_seconds"),
                     " / ".join(f"{st.get(k, 0):.1f}" for k in ("prefill", "forced", "greedy")),
                     f"{min(x['loadavg_start'][0] for x in v.values()):.1f}-"
                     f"{max(x['loadavg_end'][0] for x in v.values()):.1f}"])
    lines = ["# One RULER sample before and after the shared, teacher-forced runner", "",
             f"Command: `python bench/bench_ruler_sample_cost.py` (before: commit `{res['meta'].get('before')}`; "
             "after: the checkout measured, `meta.code` in the JSON). SmolLM2-135M-Instruct float32, chunk 512, "
             "2 CPU cores shared with other jobs (1-minute load average during each pair in the last column: "
             "2 means both cores busy).", "",
             *([f"Run: {res['meta']['note']}", ""] if res["meta"].get("note") else []),
             "*before*: the five arms (qfilters, qfilters_online, knorm, streaming_llm, random) at 4 ratios + "
             "the full cache, every row decoded greedily. *after*: the default arms (qfilters, knorm, "
             "streaming_llm), teacher-forced scoring of every row, greedy decoding of the full cache only (a "
             "sample outside the validation subset). *after, all arms*: the same five arms as before.", ""]
    lines += common.md_table(["sample", "runs", "repeat", "before s", "after s", "after / before", "after, all arms s",
                              "all arms / before", "after / before, CPU s", "all arms / before, CPU s",
                              "after: prefill / forced / greedy s", "load"], rows, "lllrrrrrrrll")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", nargs="+", default=["2048/niah_single_2/0", "2048/cwe/0"],
                    help="LENGTH/TASK/INDEX (the run's sample keys; seed 0)")
    ap.add_argument("--which", nargs="+", default=["before", "after", "after_all_arms"],
                    choices=["before", "after", "after_all_arms"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--before", default=BEFORE, help=f"commit of 'before' (default {BEFORE})")
    ap.add_argument("--out", default=str(common.RESULTS / "ruler_sample_cost.json"))
    ap.add_argument("--tag", default="", help="names this invocation's runs in the table (runs without one: 'first')")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the JSON")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        write_markdown(out, json.loads(out.read_text()))
        return

    model, tok = load(str(prepare_model()))
    mx.set_cache_limit(1 << 30)
    calibrated, _ = load_filters(str(FILTERS), model)
    sources = Sources(tuple(essay_sentences(source_text())))
    res = json.loads(out.read_text()) if out.exists() else {"runs": []}
    res["meta"] = common.run_meta(before=args.before, argv=sys.argv[1:])
    old = before_package(args.before) if "before" in args.which else None
    new = importlib.import_module("qfilters_mlx.evaluation.ruler.runner")

    for key in args.samples:
        length, task, index = key.split("/")
        length, index = int(length), int(index)
        sample, _ = fit(lambda m: TASKS[task](sources, f"0-{task}-{length}-{index}", m), tok, length)
        context, question = sample_tokens(tok, sample)
        for rep in range(args.repeats):
            variants = []
            if "before" in args.which:
                variants.append(("before", old, old.RulerSettings(compress_arms=ALL_ARMS)))
            if "after" in args.which:
                variants.append(("after", new, new.RulerSettings(validation_samples=0)))
            if "after_all_arms" in args.which:
                variants.append(("after_all_arms", new,
                                 new.RulerSettings(validation_samples=0, compress_arms=ALL_ARMS)))
            for name, mod, s in (variants if rep % 2 == 0 else variants[::-1]):
                load0 = os.getloadavg()
                record = {"index": index}
                c0 = time.process_time()
                t0 = time.perf_counter()
                mod.run_sample(model, tok, record, context, question, sample.outputs, sample.max_new_tokens,
                               s, calibrated=calibrated)
                sec = time.perf_counter() - t0
                cpu = time.process_time() - c0
                run = {"sample": key, "variant": name, "repeat": rep, "tag": args.tag, "code": res["meta"]["code"],
                       "seconds": sec, "cpu_seconds": cpu,
                       "stages": record.get("seconds", {}), "loadavg_start": load0,
                       "loadavg_end": os.getloadavg(), "context_tokens": len(context),
                       "question_tokens": len(question), "max_new_tokens": sample.max_new_tokens,
                       "rows": len(record["answers"]) if name == "before" else len(record.get("tf", {})),
                       "full_answer": record["answers"]["full"]}
                res["runs"].append(run)
                print(json.dumps(run), flush=True)
                out.write_text(json.dumps(res, indent=1) + "\n")
                write_markdown(out, res)


if __name__ == "__main__":
    main()
