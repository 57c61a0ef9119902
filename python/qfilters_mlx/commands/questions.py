"""``qfilters-mlx generate --context-file F --question Q [...] --compression-ratio R``:
questions outside the compression, as kvpress's pipeline answers them.

The context is prefilled once (chat template opened, the user message up to the
question), the caches are compressed once (:func:`qfilters_mlx.compress_caches`), and
each question (with the rest of the template) is answered by mlx-lm's
``stream_generate`` from its own deep copy of the compressed caches, so no question
is ever compressed and no question sees another. ``--compression-ratio`` with a plain
``--prompt`` compresses the prompt at its end instead (``CompressOnce(at="prompt_end")``:
the question is then inside the compression).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

__all__ = ["add_compress_args", "check_combinations", "compress_config", "run_questions", "split_prompt"]

_MARK = "\x00QFILTERS_QUESTION\x00"


def add_compress_args(group) -> None:
    """The compress-once flags of ``generate``."""
    group.add_argument("--compression-ratio", type=float, default=None, metavar="R",
                       help="compress once instead of evicting at every call: remove the fraction "
                            "R of the tokens per layer and KV head (kvpress's compression_ratio), "
                            "then append without eviction. With --prompt: at the end of the "
                            "prompt (its last token excepted); with --context-file: after the "
                            "context, before each question")
    group.add_argument("--growth", type=int, default=None, metavar="N",
                       help="with compress-once: tokens the cache may grow by after the "
                            "compression before it evicts again (default: no limit)")
    group.add_argument("--context-file", default=None, metavar="PATH",
                       help="a UTF-8 context, prefilled once and compressed once (by "
                            "--compression-ratio, else to --budget tokens); each --question is "
                            "answered from a copy of the compressed cache")
    group.add_argument("--question", action="append", default=None, metavar="Q",
                       help="a question about --context-file (repeatable)")


def check_combinations(parser, args) -> None:
    """Refuse the compress-once flags where ``generate`` would not use them."""
    given = [f for f, v in (("--compression-ratio", args.compression_ratio), ("--growth", args.growth),
                            ("--context-file", args.context_file)) if v is not None]
    for flag, other in (("--compare", args.compare), ("--prompt-cache-file", args.prompt_cache_file)):
        if given and other is not None:
            parser.error(f"{given[0]} cannot be used with {flag}")
    if args.question and args.context_file is None:
        parser.error("--question needs --context-file")


def compress_config(parser, args, config):
    """``config`` in compress-once mode when the flags ask for it (else unchanged);
    errors go to ``parser.error`` naming the flag."""
    ratio, growth = args.compression_ratio, args.growth
    if args.context_file is None and ratio is None:
        if growth is not None:
            parser.error("--growth needs --compression-ratio or --context-file")
        return config
    if not config.scorer.evicts:
        for flag, v in (("--compression-ratio", ratio), ("--growth", growth)):
            if v is not None:
                print(f"{parser.prog}: warning: {flag} does nothing with --method {config.method} "
                      "(ignored)",
                      file=sys.stderr)
        return config
    if ratio is not None and not 0.0 <= ratio < 1.0:
        parser.error(f"--compression-ratio must be in [0, 1) (the fraction removed), got {ratio}")
    if growth is not None and growth < 0:
        parser.error(f"--growth must be >= 0, got {growth}")
    at = "manual" if args.context_file is not None else "prompt_end"
    try:
        from qfilters_mlx.config import CompressOnce

        return replace(config, mode=CompressOnce(ratio=ratio, growth=growth, at=at),
                       qfilters_recent=args.recent)
    except (TypeError, ValueError) as err:
        parser.error(str(err))


def split_prompt(tokenizer, context: str, questions: list[str], *, system_prompt=None,
                 ignore_chat_template=False, template_kwargs=None) -> tuple[list, list]:
    """``(context tokens, [question tokens])``: the chat-template prompt of the user message
    ``context + "\\n\\n" + question`` cut before the question (kvpress's context/question
    split); each question's tokens carry the rest of the template (the generation prompt)."""
    if ignore_chat_template or not tokenizer.has_chat_template:
        head, tail = context + "\n\n", ""
        ctx = tokenizer.encode(head)
    else:
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": context + "\n\n" + _MARK})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
        head, tail = text.split(_MARK)
        ctx = tokenizer.encode(head, add_special_tokens=False)
    return ctx, [tokenizer.encode(q + tail, add_special_tokens=False) for q in questions]


def _check(parser, args) -> None:
    if not args.question:
        parser.error("--context-file needs at least one --question")
    for flag, given in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                        ("--compare", args.compare), ("--draft-model", args.draft_model),
                        ("--prompt-cache-file", args.prompt_cache_file)):
        if given is not None:
            parser.error(f"{flag} cannot be used with --context-file (the context and "
                         f"--question make the prompt)")
    if any(not q.strip() for q in args.question):
        parser.error("--question: empty question")


def run_questions(parser, args, config, blas_library=None) -> int:
    """Prefill ``--context-file`` once, compress once, answer every ``--question`` from a copy."""
    from qfilters_mlx.commands import generation
    from qfilters_mlx.commands.model_path import resolve_model

    _check(parser, args)
    try:
        context = Path(args.context_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        parser.error(f"--context-file: cannot read {args.context_file}: {err}")
    if not context.strip():
        parser.error(f"--context-file: {args.context_file} is empty (or only whitespace)")
    model_path = resolve_model(parser, args.model)

    import mlx.core as mx

    from qfilters_mlx.cache.compression import compress_caches
    from qfilters_mlx.commands import cache_options
    from qfilters_mlx.filters.observe import observe_queries

    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = generation.load_model(parser, args, model_path)
    kwargs = json.loads(args.chat_template_config) if args.chat_template_config else None
    ctx, qs = split_prompt(tokenizer, context, args.question, system_prompt=args.system_prompt,
                           ignore_chat_template=args.ignore_chat_template, template_kwargs=kwargs)
    try:
        caches = cache_options.builder_from_args(parser, args).for_model(
            model, config, tokenizer=tokenizer, model_path=model_path,
            heads=cache_options.heads_from_args(args, config))
    except (ValueError, TypeError, OSError) as err:
        parser.error(str(err))
    tic = time.perf_counter()
    with observe_queries(model, caches):
        for s in range(0, len(ctx), args.prefill_step_size):
            model(mx.array(ctx[s:s + args.prefill_step_size])[None], cache=caches)
            mx.eval([c.state for c in caches])
    prefill_s = time.perf_counter() - tic
    tic = time.perf_counter()
    try:
        kept = compress_caches(caches) if config.scorer.evicts else [len(ctx)]
    except ValueError as err:
        parser.error(f"--context-file: {err}")
    mx.eval([c.state for c in caches])
    compress_s = time.perf_counter() - tic
    if args.verbose:
        print(f"Context: {len(ctx)} tokens, prefilled in {prefill_s:.2f} s; kept {max(kept)} per "
              f"layer and KV head after compressing once ({compress_s * 1e3:.1f} ms); "
              f"{config.method} ({describe(config)})")
    for i, (question, tokens) in enumerate(zip(args.question, qs)):
        copies = copy.deepcopy(caches)
        result = generation.run_generation(model, tokenizer, tokens, copies, args)
        if args.verbose:
            print("=" * 10)
            print(f"Question {i + 1}: {question}")
            print(f"Answer: {result.text}")
            print(f"({result.prompt_tokens} question tokens, {result.generation_tokens} generated, "
                  f"{result.generation_tps:.1f} tokens/s, cache {max(c.size() for c in copies)} "
                  f"tokens per layer at the end)")
        else:
            print(result.text)
    return 0


def describe(config) -> str:
    from qfilters_mlx.commands.cache_options import describe_config

    if not config.scorer.evicts:
        return describe_config(config)
    mode = config.mode
    ratio, growth = getattr(mode, "ratio", None), getattr(mode, "growth", None)
    target = f"compression_ratio={ratio}" if ratio is not None else f"budget={config.qfilters_budget}"
    growth = "unbounded" if growth is None else growth
    return (f"{target} n_sink={config.qfilters_n_sink} recent={config.qfilters_recent} "
            f"growth={growth}")
