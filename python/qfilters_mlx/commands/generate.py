"""``qfilters-mlx generate``: mlx_lm.generate with a fixed-budget eviction cache, then a summary.

Flags mirror ``mlx_lm.generate`` (0.32) where they fit (``--adapter-path``,
``--trust-remote-code``, ``--draft-model``, ``--chat-template-config``,
``--use-default-chat-template``, ``--prompt-cache-file``, ``--max-kv-size`` as the
budget); mlx-lm's quantized-cache flags (``--kv-bits``) are passed to its generation. ``--compare`` runs the same
prompt through several caches and prints one table
(:mod:`qfilters_mlx.commands.compare`). For the shipped prompt the summary says
whether the answer contains its pass key.
"""

from __future__ import annotations

import sys

from qfilters_mlx.commands import cache_options, distributed, generation, options, questions, summary
from qfilters_mlx.commands.model_path import resolve_model

__all__ = ["add_parser", "check_generation_args", "run"]

# mlx_lm.generate's defaults (mlx-lm 0.32).
DEFAULT_MAX_TOKENS = 100
DEFAULT_PREFILL_STEP_SIZE = 2048
DEFAULT_NUM_DRAFT_TOKENS = 3
DEFAULT_COMPARE = "full,streaming_llm,qfilters"


def _str2bool(text: str) -> bool:
    """mlx_lm.generate's --verbose parsing: anything but 'false'/'f' is True."""
    return text.lower() not in ("false", "f")


def add_sampling_args(g) -> None:
    """mlx_lm.generate's sampling and length flags."""
    g.add_argument("--extra-eos-token", nargs="+", default=(), help="extra tokens that stop generation")
    g.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"maximum number of tokens to generate (default {DEFAULT_MAX_TOKENS})")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
    g.add_argument("--min-p", type=float, default=0.0, help="sampling min-p")
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    g.add_argument("--min-tokens-to-keep", type=int, default=1,
                   help="minimum tokens to keep for min-p sampling")
    g.add_argument("--seed", type=int, default=None,
                   help="PRNG seed (sampling, and the 'random' method's eviction)")
    g.add_argument("--verbose", type=_str2bool, default=True,
                   help="stream the text and print the summary when 'True'/'T'; only the "
                        "response when 'False'/'F'")
    g.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP_SIZE,
                   help=f"prompt tokens processed per model call (default {DEFAULT_PREFILL_STEP_SIZE})")


def add_parser(sub) -> None:
    """Add ``generate`` to ``sub`` (an argparse subparsers object)."""
    gen = sub.add_parser(
        "generate",
        help="generate text with an eviction KV cache (flags mirror mlx_lm.generate)",
        description="Generate with mlx-lm using a fixed-budget eviction KV cache, then print a "
                    "summary of cache size, bytes, compression and speed; --compare runs several "
                    "caches on the same prompt and prints one table.",
    )
    gen.set_defaults(_parser=gen, _run=run)
    g = gen.add_argument_group("model and prompt (as in mlx_lm.generate)")
    options.add_model_args(g)
    options.add_prompt_args(g)
    add_sampling_args(g)
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="a smaller model with the same tokenizer for speculative decoding; it "
                        "gets eviction caches with the same configuration")
    g.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                   help=f"tokens drafted per step with --draft-model (default {DEFAULT_NUM_DRAFT_TOKENS})")
    g.add_argument("--prompt-cache-file", default=None, metavar="FILE",
                   help="continue from a prompt cache written by `qfilters-mlx cache-prompt` (its "
                        "caches keep their own configuration; the cache flags are then ignored)")
    options.add_quantized_kv_args(g)
    c = gen.add_argument_group("KV-cache eviction")
    options.add_cache_args(c)
    options.add_heads_arg(c)
    questions.add_compress_args(c)
    c.add_argument("--compare", nargs="?", const=DEFAULT_COMPARE, default=None, metavar="LIST",
                   help=f"run the prompt through several caches and print one table (answer, "
                        f"pass key found, kept tokens, KV bytes, tokens/s, peak memory). LIST: "
                        f"comma-separated METHOD, METHOD@BUDGET, or either with +heads after the "
                        f"method (as --heads calibrated) (default {DEFAULT_COMPARE}); "
                        f"the other cache flags apply to every entry that uses them")


def check_generation_args(parser, args) -> None:
    """Numeric checks of the generation flags (``parser.error`` naming the flag)."""
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
    if getattr(args, "num_draft_tokens", 1) < 1:
        parser.error(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    options.check_quantized_kv_args(parser, args)


def _load_prompt_cache(parser, args):
    """``(caches, model folder)`` from ``--prompt-cache-file`` (mlx-lm's loader and metadata)."""
    from mlx_lm.models.cache import load_prompt_cache

    from qfilters_mlx.cache.build_report import eviction_caches

    try:
        caches, meta = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
    except (OSError, ValueError, KeyError, AttributeError, RuntimeError) as err:
        parser.error(f"--prompt-cache-file: cannot load {args.prompt_cache_file}: {err}")
    if not eviction_caches(caches):
        parser.error(f"--prompt-cache-file: {args.prompt_cache_file} holds no eviction caches "
                     f"(written by mlx_lm.cache_prompt?); write it with `qfilters-mlx cache-prompt`")
    model = args.model or meta.get("model")
    if args.model is not None and meta.get("model") and \
            str(resolve_model(parser, args.model)) != meta["model"]:
        parser.error(f"--model {args.model} differs from the model the prompt cache was made "
                     f"with ({meta['model']})")
    return caches, model


def run(parser, args, blas_library: str | None = None) -> int:
    """Run ``generate`` (or the comparison mode); returns the exit status.

    Under ``mlx.launch`` (a world group of more than one rank) the model is sharded
    over the ranks and only rank 0 prints (:mod:`qfilters_mlx.commands.distributed`).
    """
    check_generation_args(parser, args)
    questions.check_combinations(parser, args)
    world = distributed.group()
    if world.size() > 1:
        distributed.check_args(parser, args, world.size())
    with distributed.only_rank0_prints(world.rank()):
        return _run(parser, args, blas_library, world)


def _run(parser, args, blas_library, world) -> int:
    if args.compare is not None:
        from qfilters_mlx.commands.compare import run_compare

        return run_compare(parser, args, blas_library)
    if args.prompt_cache_file is not None:
        for flag in cache_options.ignored_flags(args, "full"):
            print(f"{parser.prog}: warning: {flag} does nothing with --prompt-cache-file (the "
                  f"file's caches keep their configuration)", file=sys.stderr)
        config = None
    else:
        cache_options.warn_ignored(parser, args)
        config = questions.compress_config(parser, args, cache_options.config_from_args(parser, args))
        options.check_quantized_kv_start(parser, args, config)
        if args.context_file is not None:  # questions outside the compression
            return questions.run_questions(parser, args, config, blas_library)
    text, shipped = generation.read_prompt(parser, args)
    loaded = None
    if args.prompt_cache_file is not None:
        loaded, model_name = _load_prompt_cache(parser, args)
        model_path = resolve_model(parser, model_name)
    else:
        model_path = resolve_model(parser, args.model)
    draft_path = resolve_model(parser, args.draft_model, "--draft-model") if args.draft_model else None

    import mlx.core as mx

    from qfilters_mlx.cache.builder import KVCacheBuilder
    from qfilters_mlx.filters.capture import QueriesNotCaptured

    sharded = world.size() > 1
    if sharded:
        distributed.shared_seed(args.seed)
    elif args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = (distributed.load_sharded(parser, args, model_path) if sharded
                        else generation.load_model(parser, args, model_path))
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    tokens = generation.build_prompt(parser, args, tokenizer, text, suffix_of_cached=loaded is not None)
    try:
        # a file's caches keep their build options; the draft's follow them
        builder = KVCacheBuilder() if loaded is not None else cache_options.builder_from_args(parser, args)
        caches = loaded if loaded is not None else builder.for_model(
            model, config, tokenizer=tokenizer, model_path=model_path,
            heads=cache_options.heads_from_args(args, config))
        config = config or next(c.config for c in caches if hasattr(c, "config"))
        draft = None
        if draft_path is not None:
            draft_model, draft_tokenizer = generation.load_model(parser, args, draft_path, "--draft-model")
            draft = generation.build_draft(parser, args, draft_model, draft_tokenizer, tokenizer,
                                           config, builder)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        parser.error(f"--filters {args.filters}: {err}" if args.filters else str(err))
    if loaded is not None and len(loaded) != len(model.layers):
        parser.error(f"--prompt-cache-file: {len(loaded)} layer caches for a model with "
                     f"{len(model.layers)} layers")

    if args.verbose:
        print("=" * 10, flush=True)
    on_text = (lambda t: print(t, end="", flush=True)) if args.verbose else None
    progress = (generation.prefill_progress(min_tokens=args.prefill_step_size)
                if args.verbose and world.rank() == 0 else None)
    try:
        result = generation.run_generation(model, tokenizer, tokens, caches, args, draft=draft,
                                           on_text=on_text, progress=progress)
    except QueriesNotCaptured as err:  # names the layers; raised before their caches grow
        parser.error(str(err))
    if not args.verbose:
        print(result.text)
        return 0
    print()
    print("=" * 10)
    lines = _summary_lines(model, model_path, config, builder.options_for(config).backend, result,
                           shipped, blas_library, args)
    summary.print_lines(lines + (distributed.kv_lines(result.caches) if sharded else []))
    return 0


def _summary_lines(model, model_path, config, backend, result, shipped, blas_library, args) -> list:
    from qfilters_mlx import blas
    from qfilters_mlx.assets.prompts import PASS_KEY, answer_has_pass_key

    s = summary.cache_summary(result.caches)
    weights = summary.weight_bytes(model)
    backends = sorted({c.backend.name for c in result.caches if hasattr(c, "backend")})
    heads = None if args.prompt_cache_file else cache_options.heads_from_args(args, config)
    from qfilters_mlx.cache.builder import describe

    lines = [
        ("Model", str(model_path)),
        ("Layers", describe(result.caches)),
        ("BLAS", blas.describe(blas_library)),
        ("Cache config", f"{cache_options.describe_config(config, heads)} backend={backend} "
                         f"({','.join(backends) or 'none'})"),
    ]
    if getattr(args, "kv_bits", None) is not None:
        n = sum(hasattr(c, "bits") for c in result.caches)
        lines.append(("KV storage", f"{args.kv_bits}-bit, group size {args.kv_group_size}, from token "
                                    f"{args.quantized_kv_start}: {n} of {len(result.caches)} caches quantized"))
    if args.prompt_cache_file:
        lines.append(("Prompt cache file", args.prompt_cache_file))
    if args.draft_model:
        lines.append(("Draft model", f"{args.draft_model} ({args.num_draft_tokens} tokens per step)"))
    if shipped:
        found = answer_has_pass_key(result.text)
        lines.append(("Pass key found", f"{'yes' if found else 'no'} (the shipped prompt's key is "
                                        f"{PASS_KEY}; --method full shows what the model does "
                                        f"without eviction)"))
    lines += [
        ("Prompt tokens", f"{result.prompt_tokens}"),
        ("Generated tokens", f"{result.generation_tokens} (finish: {result.finish_reason or 'none'})"),
        ("Tokens seen per layer", f"{s['tokens_seen']}"),
        ("Kept tokens per layer", f"{s['kept_tokens']} (max over {s['layers']} layers)"),
        ("KV bytes kept", f"{summary.kv_in_context(s['kept_bytes'], weights)} ({s['kept_bytes']} bytes)"),
        ("KV bytes full", f"{summary.kv_in_context(s['full_bytes'], weights)} ({s['full_bytes']} bytes)"),
        ("Compression ratio", summary.compression_text(s, config.method)),
        ("Prompt speed", f"{result.prompt_tps:.1f} tokens/s"),
        ("Generation speed", f"{result.generation_tps:.1f} tokens/s"),
        ("Total time", f"{result.seconds:.2f} s"),
        ("Peak memory", f"{result.peak_memory / 1e9:.3f} GB ({result.peak_memory} bytes)"),
    ]
    return lines
