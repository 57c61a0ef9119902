"""``qfilters-mlx eval``: the command-line layer of the model-level evaluation.

Loads the model and the text, reads/writes the results files and prints
(only the command line does I/O: docs/testing.md, "Layout"); the measuring is in
:mod:`qfilters_mlx.evaluation`, the tables and plot in
:mod:`qfilters_mlx.evaluation.report`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from qfilters_mlx.commands.model_path import MODEL_HELP

PARTS = "score_quality,perplexity,retrieval,protocols"
"""Every measure, cheap ones first; ``protocols``: retrieval in the streaming and the
compress-once protocol (:mod:`qfilters_mlx.evaluation.protocols`)."""

TEXT_DESCRIPTION = (
    "CPython's reference documentation, pydoc_data/topics.py of Python {py} (the `topics` dict's "
    "values joined in sorted key order with blank lines; PSF documentation licence). Perplexity and "
    "score quality use its first tokens; retrieval contexts start at the first paragraph after "
    "character {offset}."
)


def add_parser(sub) -> None:
    """Add the ``eval`` subcommand to ``sub`` (an argparse subparsers object)."""
    ev = sub.add_parser(
        "eval",
        help="model-level evaluation: streaming perplexity, pass-key retrieval, score quality",
        description=(
            "Every arm (Q-Filters key-SVD sign +1/-1, L2Norm, random, each with recent 0, budget/4, "
            "budget/2; StreamingLLM; full cache) on SmolLM2-135M-Instruct and CPython's pydoc_data "
            "text. Resumable: cells already in --out are skipped."
        ),
    )
    ev.set_defaults(_parser=ev, _run=run)
    ev.add_argument("--model", default=None, help=MODEL_HELP)
    ev.add_argument("--out", default=None, metavar="JSON",
                    help="results file (default bench/results/eval_smollm2.json, or eval_quick.json "
                         "with --quick); the .md table and .png plot are written next to it")
    ev.add_argument("--quick", action="store_true",
                    help="small sizes (a few minutes) plus sanity checks; exit status 1 if one fails")
    ev.add_argument("--report-only", action="store_true",
                    help="rewrite the .md and .png from an existing --out without running")
    ev.add_argument("--parts", default=PARTS,
                    help="comma-separated measures to run (default: all, in this order; "
                         "'protocols' is retrieval in the streaming and compress-once protocols); "
                         "'segments' (not in the default): perplexity of --segment-arms on two "
                         "held-out segments with per-token NLLs and the bootstrap gap ratio to "
                         "StreamingLLM")
    ev.add_argument("--segment-arms", default=DEFAULT_SEGMENT_ARMS,
                    help=f"arms of the 'segments' part (default {DEFAULT_SEGMENT_ARMS})")
    ev.add_argument("--segment-scored", type=int, default=2048,
                    help="scored tokens per segment (default 2048)")
    ev.add_argument("--segments", default="A,B",
                    help="segments of the 'segments' part (default A,B; one per process lets two "
                         "processes share the work, each with its own --out)")
    ev.add_argument("--segment-prefix", type=int, default=128,
                    help="tokens prefilled in one call before the scored ones (default 128; a long "
                         "prefix scores tokens deep in the context at a fraction of the cost)")
    ev.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ev.add_argument("--filters", default=None, metavar="FILE",
                    help="filters from `qfilters-mlx calibrate` for the calibrated-filter arm, and, "
                         "when the file holds per-head recent windows, the per-head arm "
                         "(qfilters-perhead); without it those arms are left out (the online "
                         "query-filter and auto-sign arms always run)")


    from qfilters_mlx.commands import eval_ruler

    eval_ruler.add_parser(ev.add_subparsers(dest="suite", metavar="SUITE",
                                            help="'ruler': RULER's synthetic tasks (qfilters-mlx eval ruler -h)"))


DEFAULT_SEGMENT_ARMS = "streaming_llm,qfilters-calibrated@r1/2,qfilters-perhead"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path)


def _command(args) -> str:
    parts = ["qfilters-mlx", "eval"]
    if args.quick:
        parts.append("--quick")
    if args.out:
        parts += ["--out", args.out]
    if args.parts != PARTS:
        parts += ["--parts", args.parts]
    if "segments" in args.parts and args.segment_arms != DEFAULT_SEGMENT_ARMS:
        parts += ["--segment-arms", args.segment_arms]
    if "segments" in args.parts and args.segment_scored != 2048:
        parts += ["--segment-scored", str(args.segment_scored)]
    if "segments" in args.parts and args.segments != "A,B":
        parts += ["--segments", args.segments]
    if "segments" in args.parts and args.segment_prefix != 128:
        parts += ["--segment-prefix", str(args.segment_prefix)]
    if args.filters:
        parts += ["--filters", args.filters]
    return " ".join(shlex.quote(p) for p in parts)


def _write_report(out: Path, results: dict, command: str) -> None:
    import matplotlib.pyplot as plt

    from qfilters_mlx.evaluation.report import figure, markdown
    from qfilters_mlx.evaluation.segment_report import segment_figure, segment_markdown

    text = markdown(results, command) + "\n" if "settings" in results else f"Command: `{command}`\n\n"
    if "segments" in results:
        text += "\n" + segment_markdown(results) + "\n"
        fig = segment_figure(results)
        fig.savefig(out.with_name(out.stem + "_segments.png"), dpi=110)
        plt.close(fig)
    out.with_suffix(".md").write_text(text)
    if "settings" in results:
        fig = figure(results)
        fig.savefig(out.with_suffix(".png"), dpi=110)
        plt.close(fig)


def run(parser, args, blas_library: str | None = None) -> int:
    default = "bench/results/eval_quick.json" if args.quick else "bench/results/eval_smollm2.json"
    out = Path(args.out or default)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else {}
    command = _command(args)
    if args.report_only:
        if not results:
            parser.error(f"--report-only: {out} does not exist")
        _write_report(out, results, command)
        print(out.with_suffix(".md").read_text())
        return 0

    from qfilters_mlx.commands.model_path import resolve_model

    model_path = resolve_model(parser, args.model)

    import mlx.core as mx
    from mlx_lm import load

    from qfilters_mlx.filters.capture import capture_attention
    from qfilters_mlx.evaluation.arms import default_arms, query_arms
    from qfilters_mlx.evaluation.perplexity import streaming_nll
    from qfilters_mlx.evaluation.run import EvalSettings, check_quick, run_evaluation
    from qfilters_mlx.assets.prompts import source_text

    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = set(parts) - set(PARTS.split(",")) - {"segments"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}")
    settings = EvalSettings.quick_settings() if args.quick else EvalSettings.full()
    model, tokenizer = load(str(model_path))
    filters = None
    if args.filters:
        from qfilters_mlx.filters.calibration import load_filters

        try:
            filters, _ = load_filters(args.filters, model)
        except (OSError, ValueError) as err:
            parser.error(f"--filters: {err}")
    arms = default_arms() + query_arms(filters)
    if args.filters:
        from qfilters_mlx.evaluation.arms import perhead_arm
        from qfilters_mlx.filters.windows import load_windows

        try:
            windows = {b: load_windows(args.filters, b, settings.n_sink) for b in settings.budgets}
        except ValueError as err:
            windows = None
            print(f"note: no per-head arm ({err})", file=sys.stderr)
        if windows is not None:
            arms.append(perhead_arm(filters, windows))
    try:
        text = source_text()
    except RuntimeError as err:
        parser.error(str(err))
    results.setdefault("meta", {}).update({
        "model": str(model_path.name),
        "text": TEXT_DESCRIPTION.format(py=".".join(map(str, sys.version_info[:3])),
                                        offset=settings.retrieval_text_offset),
        "command": command,
    })

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=0, unit="call", dynamic_ncols=True, file=sys.stderr)

    def set_total(n):
        if bar is not None:
            bar.total = n
            bar.refresh()

    def progress(n, desc):
        if bar is not None:
            bar.set_description(desc, refresh=False)
            bar.update(n)

    times = results["meta"].setdefault("seconds", {})

    def save(r):
        times["total"] = times.get("total", 0.0) + (time.perf_counter() - save.t)
        save.t = time.perf_counter()
        _write_json(out, r)

    save.t = time.perf_counter()
    try:
        harness = tuple(p for p in parts if p not in ("segments", "protocols"))
        if harness:
            run_evaluation(model, tokenizer, text, settings, results, save=save, progress=progress,
                           set_total=set_total, capture=capture_attention, parts=harness, arms=arms,
                           filters=filters)
        if "segments" in parts:
            _run_segments(parser, args, model, tokenizer, text, settings, results, arms, save, progress,
                          set_total)
        if "protocols" in parts:
            from qfilters_mlx.evaluation.protocols import ProtocolSettings, run_protocols

            run_protocols(model, tokenizer, text, ProtocolSettings.quick() if args.quick
                          else ProtocolSettings(), results, filters=filters, save=save,
                          progress=lambda d: progress(0, d))
    except ValueError as err:
        parser.error(f"{out}: {err}")
    finally:
        if bar is not None:
            bar.close()

    status = 0
    if args.quick and "perplexity" in parts:
        from mlx_lm.models.cache import make_prompt_cache

        # Independent of the harness's full-cache path: plain mlx-lm KVCache, one token at a time.
        n = settings.ppl_prefix + settings.ppl_scored
        tokens = tokenizer.encode(text, add_special_tokens=False)[:n]
        nll = streaming_nll(model, tokens, make_prompt_cache(model), settings.ppl_prefix)
        full = results["perplexity"]["full"]["ppl"]
        stream = float(mx.exp(mx.array(sum(nll) / len(nll))).item())
        checks = {"full_matches_kvcache_streaming": abs(stream - full) <= 1e-3 * full}
        checks.update(check_quick(results))
        results["checks"] = {**checks, "kvcache_streaming_ppl": stream}
        _write_json(out, results)
        for name, ok in checks.items():
            print(f"check {name}: {'ok' if ok else 'FAILED'}")
        status = 0 if all(checks.values()) else 1
    _write_report(out, results, command)
    print(out.with_suffix(".md").read_text())
    print(f"results: {out}  table: {out.with_suffix('.md')}  plot: {out.with_suffix('.png')}")
    return status


def _run_segments(parser, args, model, tokenizer, text, settings, results, arms, save, progress, set_total):
    """The 'segments' part: the chosen arms on segments A and B (see evaluation.segments)."""
    from qfilters_mlx.evaluation.segments import SegmentSettings, run_segments

    names = [a.strip() for a in args.segment_arms.split(",") if a.strip()]
    by_name = {a.name: a for a in arms}
    missing = [n for n in names if n not in by_name]
    if missing:
        parser.error(f"--segment-arms: unknown or unavailable arms {missing} (the calibrated and "
                     "per-head arms need --filters; the per-head arm a file with windows)")
    sizes = settings.shared()
    if not args.quick:
        sizes.update(ppl_prefix=args.segment_prefix, ppl_scored=args.segment_scored)
    seg = SegmentSettings(**sizes, segments=tuple(x.strip() for x in args.segments.split(",") if x.strip()))
    set_total(seg.ppl_scored * len(seg.segments))
    run_segments(model, tokenizer, text, seg, [by_name[n] for n in names], results, save=save,
                 progress=progress)
