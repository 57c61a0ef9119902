"""``qfilters-mlx calibrate``: offline query-derived filters written to a safetensors file."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from qfilters_mlx.commands.model_path import MODEL_HELP, resolve_model
from qfilters_mlx.filters.default_filters import encode_quietly

__all__ = ["add_parser", "encode_quietly", "progress_chunks", "run"]

DEFAULT_CALIB_TEXT_TOKENS = 4096
DEFAULT_CALIB_SAMPLES = 4096
DEFAULT_CHUNK = 1024
DEFAULT_WINDOW_CHUNK = 2048
DEFAULT_WINDOW_BUDGETS = (64, 128, 256, 512)


def add_parser(sub) -> None:
    """Add ``calibrate`` to ``sub`` (an argparse subparsers object)."""
    cal = sub.add_parser(
        "calibrate",
        help="estimate query-derived Q-Filters offline and write them to a safetensors file",
        description=(
            "Run the model over calibration text, collect post-RoPE queries of every layer and "
            "query head, and write the paper's filters [n_layers, n_kv_heads, head_dim] "
            "(top singular vector per query head, oriented so queries project positively, "
            "averaged over each GQA group) with model metadata."
        ),
    )
    cal.set_defaults(_parser=cal, _run=run)
    cal.add_argument("--model", default=None, help=MODEL_HELP)
    cal.add_argument("--text", default=None, metavar="FILE",
                     help="UTF-8 calibration text (default: a span of CPython's pydoc_data "
                          "reference text disjoint from the evaluation text and the shipped prompt)")
    cal.add_argument("--out", required=True, metavar="FILTERS.safetensors", help="output file")
    cal.add_argument("--tokens", type=int, default=DEFAULT_CALIB_TEXT_TOKENS,
                     help=f"calibration tokens (default {DEFAULT_CALIB_TEXT_TOKENS})")
    cal.add_argument("--samples", type=int, default=DEFAULT_CALIB_SAMPLES,
                     help=f"at most this many query rows per head (default {DEFAULT_CALIB_SAMPLES})")
    cal.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                     help=f"tokens per independent forward pass (default {DEFAULT_CHUNK})")
    cal.add_argument("--window-budgets", default=None,
                     metavar="B1,B2,...",
                     help="budgets to calibrate per-head recent windows for (stored with the filters, "
                          "used by qfilters_recent='calibrated' / --recent calibrated); '' for none "
                          f"(default {','.join(map(str, DEFAULT_WINDOW_BUDGETS))}, less those the "
                          "calibration sequences are too short for, said on stderr)")
    cal.add_argument("--window-chunk", type=int, default=DEFAULT_WINDOW_CHUNK,
                     help="tokens per forward pass of the window search (the same calibration tokens; "
                          f"default {DEFAULT_WINDOW_CHUNK})")
    cal.add_argument("--window-n-sink", type=int, default=4, help="sinks the windows are calibrated for")
    cal.add_argument("--window-rule", choices=("output", "mass", "decoded"), default="output",
                     help="what a window is chosen by: least attention-output error (default), most "
                          "captured attention mass (the first rule, kept for comparison), or least NLL of "
                          "the first --window-chunk tokens decoded with simulated eviction (one window per "
                          "group of consecutive layers, searched bottom-up; 10 to 12 minutes per budget for "
                          "SmolLM2-135M on 2 CPU cores)")
    cal.add_argument("--filters-from", default=None, metavar="FILE",
                     help="take the filters from this earlier `calibrate` output (same model, checked) "
                          "instead of estimating them again; only the per-head windows are computed")


def progress_chunks(chunks: list, stream=None):
    """Yield ``chunks``, printing ``Calibrating: n/N tokens (tok/s)`` on stderr as each is done."""
    stream = stream or sys.stderr
    total = sum(len(c) for c in chunks)
    done, tic = 0, time.perf_counter()
    for chunk in chunks:
        yield chunk
        done += len(chunk)
        rate = done / max(time.perf_counter() - tic, 1e-9)
        print(f"\rCalibrating: {done}/{total} tokens ({rate:.0f} tok/s)", end="", file=stream,
              flush=True)
    print("\nEstimating the filters (one SVD per layer and query head)...", file=stream, flush=True)


def run(parser, args, blas_library: str | None = None) -> int:
    """Run ``calibrate``; returns the exit status.

    Under ``mlx.launch`` the model is sharded over the ranks; each rank estimates its
    KV heads' filters, they are gathered, and rank 0 writes one whole-model file (what
    one process writes, see :func:`qfilters_mlx.filters.calibration.calibrate_filters`).
    """
    if args.tokens < 1 or args.samples < 1 or args.chunk < 1 or args.window_chunk < 1:
        parser.error("--tokens, --samples, --chunk and --window-chunk must be >= 1")
    args.window_budgets_given = args.window_budgets is not None
    if args.window_budgets is None:
        args.window_budgets = ",".join(map(str, DEFAULT_WINDOW_BUDGETS))
    try:
        budgets = tuple(int(b) for b in args.window_budgets.split(",") if b.strip())
    except ValueError:
        parser.error(f"--window-budgets: not a comma-separated list of ints: {args.window_budgets!r}")
    if any(b <= args.window_n_sink for b in budgets) or args.window_n_sink < 0:
        parser.error("--window-budgets: every budget must exceed --window-n-sink (>= 0)")
    if args.text is not None:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"--text: {err}")
        source = args.text
    else:
        from qfilters_mlx.assets.prompts import calibration_text

        text, source = calibration_text()
    model_path = resolve_model(parser, args.model)

    from qfilters_mlx.commands import distributed

    world = distributed.group()
    with distributed.only_rank0_prints(world.rank()):
        return _calibrate(parser, args, text, source, model_path, world, budgets)


def _measured_windows(parser, args, model, ids, filters, budgets: tuple):
    """Windows by a full-cache measure (``--window-rule output|mass``), as
    :func:`~qfilters_mlx.filters.windows.window_tensors` stores them; the summary on stderr."""
    from qfilters_mlx.filters.window_capture import keys_and_queries
    from qfilters_mlx.filters.windows import calibrate_windows, window_tensors

    wchunks = [ids[i:i + args.window_chunk] for i in range(0, len(ids), args.window_chunk)]
    try:
        w, summary = calibrate_windows(keys_and_queries(model, wchunks), filters,
                                       n_sink=args.window_n_sink, budgets=budgets, rule=args.window_rule)
    except ValueError as err:
        parser.error(f"--window-budgets: {err}")
    for b in budgets:
        m = summary[b]
        print(f"  budget {b}: mean window {m['mean_window']:.1f} (0: {m['share_zero']:.0%} of heads, "
              f"budget - n_sink: {m['share_full']:.0%}); captured attention mass {m['mass_chosen']:.4f} "
              f"vs {m['mass_half']:.4f} at budget/2, {m['mass_streaming']:.4f} StreamingLLM; "
              f"attention-output error {m['output_chosen']:.4g} vs {m['output_half']:.4g}, "
              f"{m['output_streaming']:.4g}", file=sys.stderr)
    return window_tensors(w, budgets, args.window_n_sink, summary, rule=args.window_rule)


def _decoded_windows(parser, args, model, ids, filters, budgets: tuple):
    """Windows by the decoded loss (``--window-rule decoded``:
    :func:`~qfilters_mlx.evaluation.decoded_windows.search_windows` on ``ids``), as
    :func:`~qfilters_mlx.filters.windows.window_tensors` stores them; progress on stderr."""
    import numpy as np

    from qfilters_mlx.evaluation.decoded_windows import DECODED_PREFIX, decoded_summary, min_tokens, search_windows
    from qfilters_mlx.filters.windows import window_tensors

    unfit = [b for b in budgets if len(ids) < min_tokens(b)]
    if unfit:  # every budget checked before the first (long) search
        parser.error(f"--window-rule decoded: budgets {', '.join(map(str, unfit))} need more calibration "
                     f"tokens than {len(ids)}: at least max({DECODED_PREFIX}, budget + 1) + 2")
    rows, summary = [], {}
    for b in budgets:
        try:
            w, trace = search_windows(model, ids, filters, b, args.window_n_sink,
                                      progress=lambda line: print(line, file=sys.stderr, flush=True))
        except (ValueError, RuntimeError) as err:  # a model the simulation cannot mask, named
            parser.error(f"--window-rule decoded: {err}")
        rows.append(w)
        summary[b] = decoded_summary(w, trace)
        print(f"  budget {b}: mean NLL {trace['start_nll']:.4f} at the default window -> "
              f"{trace['nll']:.4f}; windows per group of layers {summary[b]['groups']}", file=sys.stderr)
    return window_tensors(np.stack(rows), budgets, args.window_n_sink, summary, rule="decoded")


def _calibrate(parser, args, text, source, model_path, world, budgets: tuple) -> int:
    """Load (sharded over the ranks under ``mlx.launch``), calibrate, write (rank 0)."""
    from mlx_lm import load

    from qfilters_mlx.commands import distributed
    from qfilters_mlx.filters.calibration import calibrate_filters, save_filters

    if world.size() > 1:
        model, tokenizer = distributed.load_sharded(parser, args, model_path)
    else:
        model, tokenizer = load(str(model_path))
    ids = encode_quietly(tokenizer, text)[: args.tokens]
    if len(ids) < 2:
        parser.error("--text: too little text")
    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    tic = time.perf_counter()
    if args.filters_from:
        from qfilters_mlx.filters.calibration import load_filters

        try:
            filters, _ = load_filters(args.filters_from, model)
        except (OSError, ValueError) as err:
            parser.error(f"--filters-from: {err}")
    else:
        try:
            filters = calibrate_filters(model, progress_chunks(chunks) if world.rank() == 0 else chunks,
                                        samples=args.samples)
        except ValueError as err:  # QueriesNotCaptured names the layers; shapes that do not fit
            parser.error(str(err))
    windows, info = None, {}
    longest = min(len(ids), args.window_chunk)
    if budgets and not args.window_budgets_given:
        # Default budgets the calibration text is too short to simulate are dropped, said.
        if args.window_rule == "decoded":
            from qfilters_mlx.evaluation.decoded_windows import DECODED_PREFIX, min_tokens

            need, what = min_tokens, f"max({DECODED_PREFIX}, budget + 1) + 2"
        else:
            need, what = (lambda b: b + 2), "budget + 2"
        short = [b for b in budgets if longest < need(b)]
        budgets = tuple(b for b in budgets if longest >= need(b))
        if short:
            print(f"Per-head recent windows: budgets {', '.join(map(str, short))} skipped (the "
                  f"calibration sequences hold {longest} tokens; a budget needs at least {what})",
                  file=sys.stderr, flush=True)
    if budgets and world.size() > 1:
        print("Per-head recent windows are not chosen under mlx.launch (each rank sees only its "
              "KV heads): the file holds the filters only; run `qfilters-mlx calibrate "
              "--filters-from FILE` in one process to add them.", file=sys.stderr, flush=True)
    elif budgets:
        import numpy as np

        print("Choosing per-head recent windows (budgets "
              f"{', '.join(map(str, budgets))}, rule {args.window_rule})...", file=sys.stderr, flush=True)
        if args.window_rule == "decoded":
            windows = _decoded_windows(parser, args, model, ids[:args.window_chunk], np.array(filters), budgets)
        else:
            windows = _measured_windows(parser, args, model, ids, np.array(filters), budgets)
    if args.filters_from:
        info["filters_from"] = args.filters_from
    save_filters(args.out, filters, model, windows=windows, calibration_text=source,
                 calibration_tokens=len(ids), samples_per_head=args.samples, model_path=str(model_path),
                 **info)
    ranks = f" ({world.size()} ranks, tensor parallel; rank 0 wrote)" if world.size() > 1 else ""
    print(f"Wrote {args.out}: filters {tuple(filters.shape)} from {len(ids)} tokens of {source} "
          f"in {time.perf_counter() - tic:.1f} s{ranks}")
    return 0
