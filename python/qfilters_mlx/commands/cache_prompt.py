"""``qfilters-mlx cache-prompt``: prefill a prompt into eviction caches and save them to a file.

As ``mlx_lm.cache_prompt``: the prompt goes through the chat template with the user
message left open (``continue_final_message=True``), is fed with ``generate_step``
(``max_tokens=0``, with a prefill progress line) and the caches are written with
mlx-lm's ``save_prompt_cache`` and the metadata mlx-lm's generate reads (``model``,
``tokenizer_config``), plus ``qfilters_config`` (the cache configuration as text).
``qfilters-mlx generate --prompt-cache-file FILE --prompt "..."`` continues from it;
so does mlx-lm's own ``load_prompt_cache`` after ``import qfilters_mlx.cache``.
"""

from __future__ import annotations

import json
import sys

from qfilters_mlx.commands import cache_options, generation, options
from qfilters_mlx.commands.model_path import resolve_model

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Add ``cache-prompt`` to ``sub`` (an argparse subparsers object)."""
    cp = sub.add_parser(
        "cache-prompt",
        help="prefill a prompt into eviction caches and save them (mlx_lm.cache_prompt)",
        description="Feed a prompt through the model with eviction caches and write them with "
                    "mlx-lm's save_prompt_cache; `qfilters-mlx generate --prompt-cache-file FILE` "
                    "continues from the file.",
    )
    cp.set_defaults(_parser=cp, _run=run)
    g = cp.add_argument_group("model and prompt (as in mlx_lm.cache_prompt)")
    options.add_model_args(g)
    options.add_prompt_args(g)
    g.add_argument("--prompt-cache-file", required=True, metavar="FILE",
                   help="the .safetensors file to write")
    g.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt tokens processed per model call (default 2048)")
    g.add_argument("--seed", type=int, default=None, help="seed of the 'random' method's eviction")
    options.add_quantized_kv_args(g)
    eviction = cp.add_argument_group("KV-cache eviction")
    options.add_cache_args(eviction)
    options.add_heads_arg(eviction)


def run(parser, args, blas_library: str | None = None) -> int:
    """Run ``cache-prompt``; returns the exit status."""
    if args.prefill_step_size < 1:
        parser.error(f"--prefill-step-size must be >= 1, got {args.prefill_step_size}")
    if args.seed is not None and args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    options.check_quantized_kv_args(parser, args)
    cache_options.warn_ignored(parser, args)
    config = cache_options.config_from_args(parser, args)
    options.check_quantized_kv_start(parser, args, config)
    text, _ = generation.read_prompt(parser, args)
    model_path = resolve_model(parser, args.model)

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import save_prompt_cache

    from qfilters_mlx.filters.observe import observe_queries

    model, tokenizer = generation.load_model(parser, args, model_path)
    tokens = generation.build_prompt(parser, args, tokenizer, text, continue_final=True)
    heads = cache_options.heads_from_args(args, config)
    try:
        caches = cache_options.builder_from_args(parser, args).for_model(
            model, config, tokenizer=tokenizer, model_path=model_path, heads=heads)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        parser.error(str(err))
    progress = generation.prefill_progress()
    with observe_queries(model, caches):
        for _ in generate_step(mx.array(tokens), model, max_tokens=0, prompt_cache=caches,
                               prefill_step_size=args.prefill_step_size,
                               prompt_progress_callback=progress, **generation.kv_quantization(args)):
            pass
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB", file=sys.stderr)
    tokenizer_config = {"trust_remote_code": True} if args.trust_remote_code else {}
    described = cache_options.describe_config(config, heads)
    metadata = {"model": str(model_path), "tokenizer_config": json.dumps(tokenizer_config),
                "qfilters_config": described}
    save_prompt_cache(args.prompt_cache_file, caches, metadata)
    print(f"Wrote {args.prompt_cache_file}: {len(tokens)} prompt tokens, "
          f"{described}")
    return 0
