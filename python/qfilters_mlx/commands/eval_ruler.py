"""``qfilters-mlx eval ruler``: RULER's synthetic tasks over every arm, kvpress's result shape.

The command-line layer: loads the model, the haystack text and the calibrated filters,
keeps one JSON file per sample (``PREFIX_samples/{length}/{task}-{index}.json``: a rerun
continues where a run stopped) and writes the leaderboard JSON, the Markdown table and the
plot (``PREFIX.json`` / ``.md`` / ``.png``). The measuring is in
:mod:`qfilters_mlx.evaluation.ruler`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from qfilters_mlx.commands.model_path import MODEL_HELP

__all__ = ["SampleStore", "add_parser", "run"]

DEFAULT_OUT = "bench/results/ruler_smollm2"
QUICK_OUT = "bench/results/ruler_quick"


def add_parser(sub) -> None:
    """Add ``ruler`` to ``sub`` (the ``eval`` command's subparsers)."""
    from qfilters_mlx.evaluation.ruler.arms import COMPRESS_ARMS, DEFAULT_COMPRESS_ARMS, STREAMING_ARMS
    from qfilters_mlx.evaluation.ruler.tasks import TASKS

    p = sub.add_parser(
        "ruler",
        help="RULER's synthetic tasks (generated offline) over every arm, in kvpress's result shape",
        description=(
            "Generate RULER's synthetic tasks (needle in a haystack, variable tracking, common- and "
            "frequent-words extraction; not the QA tasks, which need downloads) for the model's "
            "tokenizer and chat template, answer them with the full cache and every arm at every "
            "compression ratio (compress-once: kvpress's protocol; streaming: a budget of "
            "(1 - ratio) x context tokens through the whole prompt), from one shared prefill per sample. "
            "Every row is scored by the teacher-forced log-likelihood of the gold answer (and whether "
            "greedy decoding would write each expected string); the full cache, and every row of the "
            "validation subset, also by greedy decoding and RULER's string_match_all. Writes kvpress-style "
            "leaderboard rows over all samples and over the samples the full cache answers correctly, "
            "with bootstrap 95%% intervals and paired intervals per method pair. Resumable: samples "
            "already in PREFIX_samples/ are skipped."),
    )
    p.set_defaults(_parser=p, _run=run)
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--filters", default=None, metavar="FILE",
                   help="calibrated filters from `qfilters-mlx calibrate` for the 'qfilters' arm "
                        "(needed when that arm runs)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="context lengths in tokens, prompt + answer (default 2048 4096; --quick 512)")
    p.add_argument("--ratios", type=float, nargs="+", default=None,
                   help="compression ratios, the fraction of context tokens removed (default "
                        "0.25 0.5 0.75 0.875; --quick 0 0.5)")
    p.add_argument("--samples", type=int, default=None, help="samples per task and length (default 10; --quick 1)")
    p.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS), metavar="TASK",
                   help=f"tasks (default all: {' '.join(TASKS)})")
    p.add_argument("--protocols", nargs="+", default=["compress_once"], choices=["compress_once", "streaming"],
                   help="protocols (default compress_once; streaming costs one prefill per arm and ratio)")
    p.add_argument("--arms", nargs="+", default=None, choices=[a.name for a in COMPRESS_ARMS], metavar="ARM",
                   help=f"compress-once arms (default {' '.join(DEFAULT_COMPRESS_ARMS)}; also: "
                        f"{' '.join(a.name for a in COMPRESS_ARMS if a.name not in DEFAULT_COMPRESS_ARMS)})")
    p.add_argument("--streaming-arms", nargs="+", default=list(STREAMING_ARMS),
                   choices=[a.name for a in COMPRESS_ARMS], metavar="ARM",
                   help=f"streaming arms (default {' '.join(STREAMING_ARMS)})")
    p.add_argument("--streaming-ratios", type=float, nargs="+", default=None,
                   help="the streaming protocol's ratios (default: those of --ratios)")
    p.add_argument("--streaming-samples", choices=["full_correct", "all"], default="full_correct",
                   help="streaming rows on the samples the full cache answers correctly (default) or on all")
    p.add_argument("--validation-samples", type=int, default=None,
                   help="sample indices below this are decoded greedily in every row, to check the "
                        "teacher-forced scoring (default 1; --quick: every sample)")
    p.add_argument("--seed", type=int, default=0, help="task generation seed (default 0)")
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens per call (default 512)")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help=f"results prefix (default {DEFAULT_OUT}, --quick {QUICK_OUT}): PREFIX.json, "
                        ".md, .png and PREFIX_samples/")
    p.add_argument("--quick", action="store_true",
                   help="a tiny configuration plus exact checks (full cache = plain mlx-lm greedy "
                        "generation; ratio 0 = full cache for every compress-once arm; expected "
                        "answers occur in their contexts); exit status 1 if one fails")
    p.add_argument("--report-only", action="store_true", help="rewrite PREFIX.json/.md/.png from the samples")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class SampleStore:
    """One JSON file per sample under ``folder`` (``{length}/{task}-{index}.json``), written
    atomically (temporary file, then rename)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _path(self, key: str) -> Path:
        length, task, index = key.split("/")
        return self.folder / length / f"{task}-{index}.json"

    def load(self, key: str) -> dict | None:
        p = self._path(key)
        return json.loads(p.read_text()) if p.exists() else None

    def save(self, key: str, record: dict) -> None:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, p)

    def records(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.folder.glob("*/*.json"))]


def _settings(args):
    from qfilters_mlx.evaluation.ruler.arms import DEFAULT_COMPRESS_ARMS
    from qfilters_mlx.evaluation.ruler.runner import RulerSettings
    from qfilters_mlx.evaluation.ruler.tasks import TASKS

    q = args.quick
    return RulerSettings(
        lengths=tuple(args.lengths or ((512,) if q else (2048, 4096))),
        ratios=tuple(args.ratios or ((0.0, 0.5) if q else (0.25, 0.5, 0.75, 0.875))),
        samples=args.samples or (1 if q else 10),
        tasks=tuple(args.tasks or TASKS),
        protocols=tuple(args.protocols),
        compress_arms=tuple(args.arms or DEFAULT_COMPRESS_ARMS),
        streaming_arms=tuple(args.streaming_arms),
        streaming_ratios=None if args.streaming_ratios is None else tuple(args.streaming_ratios),
        streaming_samples=args.streaming_samples,
        validation_samples=(args.validation_samples if args.validation_samples is not None
                            else (args.samples or 1) if q else 1),
        seed=args.seed, chunk=args.chunk, calib_tokens=32 if q else 128,
    )


def _write_report(prefix: Path, records: list[dict], meta: dict) -> None:
    import matplotlib.pyplot as plt

    from qfilters_mlx.evaluation.ruler.leaderboard import leaderboard
    from qfilters_mlx.evaluation.ruler.report import CONCLUSION_END, CONCLUSION_START, figure, markdown

    board = leaderboard(records, meta)
    md = prefix.with_suffix(".md")
    old = md.read_text() if md.exists() else ""
    conclusion = ""
    if CONCLUSION_START in old and CONCLUSION_END in old:
        conclusion = old.split(CONCLUSION_START, 1)[1].split(CONCLUSION_END, 1)[0]
    tmp = prefix.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(board, indent=1))
    os.replace(tmp, prefix.with_suffix(".json"))
    md.write_text(markdown(board, conclusion))
    fig = figure(board)
    fig.savefig(prefix.with_suffix(".png"), dpi=110)
    plt.close(fig)


def _meta(model_name: str, command: str, filters: str | None, filters_meta: dict) -> dict:
    from qfilters_mlx.evaluation.ruler.haystack import HAYSTACK_OFFSET

    return {
        "model": model_name, "command": command,
        "haystack": (f"CPython {'.'.join(map(str, sys.version_info[:3]))} pydoc_data.topics (values joined in "
                     f"sorted key order), sentences from the first paragraph after character {HAYSTACK_OFFSET} "
                     "to the end; disjoint from the perplexity, retrieval and calibration text"),
        "filters": {"file": filters, "calibration_text": filters_meta.get("calibration_text"),
                    "calibration_tokens": filters_meta.get("calibration_tokens")} if filters else None,
    }


def _command(argv_args) -> str:
    return " ".join(shlex.quote(a) for a in ["qfilters-mlx", "eval", "ruler", *argv_args])


def run(parser, args, blas_library: str | None = None) -> int:
    prefix = Path(args.out or (QUICK_OUT if args.quick else DEFAULT_OUT))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    store = SampleStore(prefix.parent / (prefix.name + "_samples"))
    command = _command(sys.argv[sys.argv.index("ruler") + 1:] if "ruler" in sys.argv else [])
    if args.samples is not None and args.samples < 1:
        parser.error("--samples must be >= 1")
    if args.validation_samples is not None and args.validation_samples < 0:
        parser.error("--validation-samples must be >= 0")
    settings = _settings(args)
    if any(not 0.0 <= r < 1.0 for r in settings.ratios + (settings.streaming_ratios or ())):
        parser.error("--ratios, --streaming-ratios: every ratio must be in [0, 1)")
    if args.report_only:
        records = store.records()
        if not records:
            parser.error(f"--report-only: no samples in {store.folder}")
        old = json.loads(prefix.with_suffix(".json").read_text()) if prefix.with_suffix(".json").exists() else {}
        meta = old.get("meta") or {}
        if not meta:  # (a run that never reached its end wrote no leaderboard yet)
            import mlx.core as mx

            fmeta = mx.load(args.filters, return_metadata=True)[1] if args.filters else {}
            name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct-f32"
            meta = _meta(name, command.replace(" --report-only", ""), args.filters, fmeta)
        _write_report(prefix, records, meta)
        print(prefix.with_suffix(".md").read_text())
        return 0

    from qfilters_mlx.commands.model_path import resolve_model

    model_path = resolve_model(parser, args.model)
    from mlx_lm import load

    from qfilters_mlx.assets.prompts import source_text
    from qfilters_mlx.evaluation.ruler.haystack import essay_sentences
    from qfilters_mlx.evaluation.ruler.runner import run_ruler
    from qfilters_mlx.evaluation.ruler.tasks import Sources, quick_tasks

    import mlx.core as mx

    model, tokenizer = load(str(model_path))
    # Each sample allocates and frees its rows' kept keys/values: keep at most 1 GiB of freed
    # buffers for reuse instead of MLX's default (its memory limit).
    mx.set_cache_limit(1 << 30)
    calibrated, filters_meta = None, {}
    streaming = settings.streaming_arms if "streaming" in settings.protocols else ()
    if "qfilters" in settings.compress_arms + streaming:
        if args.filters is None:
            parser.error("the 'qfilters' arm needs --filters FILE (write one with `qfilters-mlx calibrate "
                         "--out FILE`), or leave the arm out with --arms / --streaming-arms")
        from qfilters_mlx.filters.calibration import load_filters

        try:
            calibrated, filters_meta = load_filters(args.filters, model)
        except (OSError, ValueError) as err:
            parser.error(f"--filters: {err}")
    try:
        text = source_text()
    except RuntimeError as err:
        parser.error(str(err))
    sources = Sources(tuple(essay_sentences(text)))
    tasks = quick_tasks() if args.quick else None
    meta = _meta(model_path.name, command, args.filters, filters_meta)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(settings.lengths) * settings.samples * len(settings.tasks), unit="sample",
                   dynamic_ncols=True, file=sys.stderr)

    def progress(desc):
        if bar is not None:
            bar.set_description(desc, refresh=False)
            bar.update(1)

    tic = time.perf_counter()
    try:
        run_ruler(model, tokenizer, sources, settings, tasks=tasks, calibrated=calibrated, load=store.load,
                  save=store.save, progress=progress)
    except ValueError as err:
        parser.error(str(err))
    finally:
        if bar is not None:
            bar.close()
    meta["last_run_seconds"] = time.perf_counter() - tic
    status = 0
    if args.quick:
        from qfilters_mlx.evaluation.ruler.checks import quick_checks

        checks = quick_checks(model, tokenizer, sources, settings, store.records(), tasks=tasks)
        meta["checks"] = checks
        for name, ok in checks.items():
            print(f"check {name}: {'ok' if ok else 'FAILED'}")
        status = 0 if all(checks.values()) else 1
    _write_report(prefix, store.records(), meta)
    print(prefix.with_suffix(".md").read_text())
    print(f"results: {prefix.with_suffix('.json')}  table: {prefix.with_suffix('.md')}  "
          f"plot: {prefix.with_suffix('.png')}  samples: {store.folder}")
    return status
