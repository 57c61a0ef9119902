"""``qfilters-mlx generate --compare``: one prompt through several caches, one table.

Each entry of the list is ``METHOD``, ``METHOD@BUDGET`` or either with ``+heads`` after the
method (``qfilters+heads@256``: the model's calibrated retrieval heads at their own budgets,
as ``--heads calibrated``); the model is loaded once,
each entry gets fresh caches (and fresh draft caches with ``--draft-model``) and the
same sampling flags. The table has, per entry: the answer's first line, whether it
contains the shipped prompt's pass key, kept tokens per layer, KV bytes kept (and
their share of the weights' bytes), prompt and generation tokens/s, peak memory.
"""

from __future__ import annotations

import sys

from qfilters_mlx.commands import cache_options, generation, options, summary
from qfilters_mlx.commands.model_path import resolve_model

__all__ = ["parse_entries", "run_compare"]

ANSWER_CHARS = 48
"""The answer column shows at most this many characters of the answer's first line."""


def parse_entries(parser, spec: str) -> list[tuple[str, int | None, str | None]]:
    """``"full,qfilters@512,qfilters+heads"`` -> ``[("full", None, None), ("qfilters", 512,
    None), ("qfilters", None, "calibrated")]``: method, budget and head groups (``+heads``: the
    model's calibrated retrieval heads, as ``--heads calibrated``); errors name ``--compare``."""
    from qfilters_mlx.scorers import scorer_class, scorer_names

    entries = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        method, _, budget = item.partition("@")
        method, plus, extra = method.partition("+")
        if plus and extra != "heads":
            parser.error(f"--compare: {item!r}: unknown option +{extra} (only +heads: the "
                         f"calibrated retrieval heads at their own budgets)")
        if method not in scorer_names():
            parser.error(f"--compare: unknown method {method!r} in {spec!r} (choose from "
                         f"{', '.join(scorer_names())}, optionally METHOD@BUDGET or METHOD+heads)")
        try:
            b = int(budget) if budget else None
        except ValueError:
            parser.error(f"--compare: budget of {item!r} is not an integer")
        if (b is not None or plus) and not scorer_class(method).evicts:
            parser.error(f"--compare: {item!r}: method {method} has no budget")
        entries.append((method, b, "calibrated" if plus else None))
    if not entries:
        parser.error(f"--compare: no method in {spec!r}")
    return entries


def _answer(text: str) -> str:
    line = " ".join(text.strip().split("\n", 1)[0].split()).replace("|", "/")
    return line if len(line) <= ANSWER_CHARS else line[:ANSWER_CHARS - 3] + "..."


def run_compare(parser, args, blas_library: str | None = None) -> int:
    """Run every entry of ``args.compare`` and print the table; returns the exit status."""
    if args.prompt_cache_file is not None:
        parser.error("--compare cannot continue from --prompt-cache-file (each entry needs "
                     "fresh caches)")
    entries = parse_entries(parser, args.compare)
    unused = set.intersection(*(set(cache_options.ignored_flags(args, m)) for m, _, _ in entries))
    for flag in sorted(unused):
        print(f"{parser.prog}: warning: {flag} does nothing for any of --compare "
              f"{args.compare} (ignored)", file=sys.stderr)
    configs = [cache_options.config_from_args(parser, args, method=m, budget=b) for m, b, _ in entries]
    builder = cache_options.builder_from_args(parser, args)
    for c in configs:
        options.check_quantized_kv_start(parser, args, c)
    text, shipped = generation.read_prompt(parser, args)
    model_path = resolve_model(parser, args.model)
    draft_path = resolve_model(parser, args.draft_model, "--draft-model") if args.draft_model else None

    import mlx.core as mx

    from qfilters_mlx import blas
    from qfilters_mlx.assets.prompts import PASS_KEY, answer_has_pass_key
    from qfilters_mlx.filters.capture import QueriesNotCaptured

    model, tokenizer = generation.load_model(parser, args, model_path)
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    draft_model = None
    if draft_path is not None:
        draft_model, draft_tokenizer = generation.load_model(parser, args, draft_path, "--draft-model")
    tokens = generation.build_prompt(parser, args, tokenizer, text)
    weights = summary.weight_bytes(model)
    rows = []
    for i, ((method, _, heads), config) in enumerate(zip(entries, configs)):
        heads = heads or cache_options.heads_from_args(args, config)
        label = (f"{method}{'+heads' if heads else ''}@{config.qfilters_budget}" if config.scorer.evicts
                 else method)
        if args.seed is not None:
            mx.random.seed(args.seed)  # every entry samples from the same state
        try:
            caches = builder.for_model(model, config, tokenizer=tokenizer, model_path=model_path,
                                       heads=heads)
            draft = None if draft_model is None else generation.build_draft(
                parser, args, draft_model, draft_tokenizer, tokenizer, config, builder,
                f"--compare {label}")
        except (ValueError, TypeError, OSError, RuntimeError) as err:
            parser.error(f"--compare {label}: {err}")
        progress = generation.prefill_progress(f"[{i + 1}/{len(entries)}] {label} prefill")
        print(f"[{i + 1}/{len(entries)}] {label}: {cache_options.describe_config(config, heads)}",
              file=sys.stderr, flush=True)
        try:
            r = generation.run_generation(model, tokenizer, tokens, caches, args, draft=draft,
                                          progress=progress)
        except QueriesNotCaptured as err:  # names the layers; raised before their caches grow
            parser.error(f"--compare {label}: {err}")
        s = summary.cache_summary(r.caches)
        rows.append([
            label,
            _answer(r.text),
            ("yes" if answer_has_pass_key(r.text) else "no") if shipped else "-",
            str(s["kept_tokens"]),
            f"{summary.human_bytes(s['kept_bytes'])} ({100.0 * s['kept_bytes'] / weights:.1f}%)",
            f"{r.prompt_tps:.0f}",
            f"{r.generation_tps:.1f}",
            f"{r.peak_memory / 2**20:.0f} MiB",
        ])
    header = ["cache", "answer", "key found" if shipped else "key", "kept tokens",
              "KV bytes (% of weights)", "prompt tok/s", "gen tok/s", "peak memory"]
    print(f"Model: {model_path} ({summary.human_bytes(weights)} of weights); "
          f"BLAS: {blas.describe(blas_library)}")
    print(f"Prompt: {len(tokens)} tokens"
          + (f", the shipped pass-key prompt (key {PASS_KEY})" if shipped else "")
          + f"; at most {args.max_tokens} generated tokens; kept tokens and KV bytes are per "
            f"model (max over layers / sum over layers) after generation")
    print(summary.table(header, rows))
    return 0
