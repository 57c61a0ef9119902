"""Flags shared by ``generate`` and ``cache-prompt``: the model, the prompt, mlx-lm's
quantized-cache flags (``--kv-bits``, passed to mlx-lm) and the eviction cache.

The cache flags default to ``None`` so that the command can tell which ones the user
gave: :mod:`qfilters_mlx.commands.cache_options` fills in the library's defaults
(:mod:`qfilters_mlx.config`, one set for library and command line) and warns about
flags that do nothing for the chosen method.
"""

from __future__ import annotations

import argparse
import sys

from qfilters_mlx.commands.model_path import MODEL_HELP

from qfilters_mlx.config import (
    DEFAULT_BUDGET,
    DEFAULT_CALIB_TOKENS,
    DEFAULT_FILTER_SOURCE,
    DEFAULT_KEY_SIGN,
    DEFAULT_METHOD,
    DEFAULT_N_SINK,
    DEFAULT_RECENT_FRACTION,
    DEFAULT_KV_GROUP_SIZE,
    FILTER_SOURCES,
    KV_BITS,
    KV_GROUP_SIZES,
)

DEFAULT_QUANTIZED_KV_START = 5000
"""mlx-lm's ``--quantized-kv-start`` default (``mlx_lm.generate.DEFAULT_QUANTIZED_KV_START``)."""

__all__ = ["add_cache_args", "add_heads_arg", "add_model_args", "add_prompt_args", "add_quantized_kv_args",
           "check_quantized_kv_args", "check_quantized_kv_start", "parse_sign"]


def parse_sign(text: str) -> int | str:
    """``--sign``'s type: +1, -1 or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be +1, -1 or auto, got {text!r}") from None
    if value not in (1, -1):
        raise argparse.ArgumentTypeError(f"must be +1, -1 or auto, got {text!r}")
    return value


def recent_arg(text: str) -> int | str:
    """``--recent``: an int, or ``calibrated`` (per-head windows from the filters file)."""
    if text == "calibrated":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'calibrated', got {text!r}") from None


def add_model_args(group) -> None:
    """``--model``, ``--adapter-path``, ``--trust-remote-code`` (as mlx_lm.generate)."""
    group.add_argument("--model", default=None, help=MODEL_HELP)
    group.add_argument("--adapter-path", default=None, metavar="DIR",
                       help="LoRA adapters to apply to the model (mlx_lm.load's adapter_path)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="allow the tokenizer/model to run code from the model folder")


def add_prompt_args(group) -> None:
    """``--prompt`` / ``--prompt-file`` (exclusive), ``--system-prompt`` and the chat template flags."""
    prompt = group.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", "-p", default=None,
                        help="message to the model ('-' reads stdin; default: the shipped "
                             "~2,300-token pass-key retrieval prompt built from CPython's "
                             "pydoc_data reference text)")
    prompt.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="read the message from a UTF-8 text file")
    group.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    group.add_argument("--ignore-chat-template", action="store_true",
                       help="use the raw prompt without the tokenizer's chat template")
    group.add_argument("--use-default-chat-template", action="store_true",
                       help="use the tokenizer's default chat template when it has none of its own")
    group.add_argument("--chat-template-config", default=None, metavar="JSON",
                       help="extra keyword arguments for apply_chat_template, as a JSON object")


def add_quantized_kv_args(group) -> None:
    """mlx-lm's quantized-cache flags, as ``mlx_lm.generate`` spells them: passed to mlx-lm's
    generation, which converts each cache with ``to_quantized`` once it holds
    ``--quantized-kv-start`` tokens (``QuantizedQFiltersKVCache``: kept K/V quantized)."""
    group.add_argument("--kv-bits", type=int, default=None,
                       help="bits of the stored K/V (2, 4 or 8; default: not quantized): the kept "
                            "rows are stored as mlx-lm's QuantizedKVCache stores them; the scores "
                            "still come from the full-precision keys")
    group.add_argument("--kv-group-size", type=int, default=None,
                       help=f"group size of the K/V quantization (default {DEFAULT_KV_GROUP_SIZE})")
    group.add_argument("--quantized-kv-start", type=int, default=None, metavar="N",
                       help=f"quantize the caches once they have seen N tokens (default "
                            f"{DEFAULT_QUANTIZED_KV_START}, mlx-lm's; at least --calib-tokens with "
                            f"the query filter)")


def check_quantized_kv_args(parser, args) -> None:
    """Check the quantized-cache flags and fill in mlx-lm's defaults (``parser.error``
    naming the flag); a flag that does nothing without ``--kv-bits`` is a warning."""
    bits, group, start = (getattr(args, f, None) for f in ("kv_bits", "kv_group_size", "quantized_kv_start"))
    if bits is None:
        for flag, value in (("--kv-group-size", group), ("--quantized-kv-start", start)):
            if value is not None:
                print(f"{parser.prog}: warning: {flag} does nothing without --kv-bits", file=sys.stderr)
    elif bits not in KV_BITS:
        parser.error(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {bits}")
    if group is not None and group not in KV_GROUP_SIZES:
        parser.error(f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {group}")
    if start is not None and start < 0:
        parser.error(f"--quantized-kv-start must be >= 0, got {start}")
    if bits is not None and getattr(args, "draft_model", None) is not None:
        parser.error("--kv-bits with --draft-model: a quantized eviction cache cannot rewind "
                     "rejected drafts (max_rewind must be 0)")
    args.kv_group_size = DEFAULT_KV_GROUP_SIZE if group is None else group
    args.quantized_kv_start = DEFAULT_QUANTIZED_KV_START if start is None else start


def check_quantized_kv_start(parser, args, config) -> None:
    """With ``--kv-bits`` and the query filter (``config.needs_queries``):
    ``--quantized-kv-start`` must be at least ``--calib-tokens`` (a cache cannot be
    quantized while it waits for the queries of its filter)."""
    if getattr(args, "kv_bits", None) is not None and config is not None and config.needs_queries \
            and args.quantized_kv_start < config.qfilters_calib_tokens:
        parser.error(f"--quantized-kv-start {args.quantized_kv_start} is below --calib-tokens "
                     f"{config.qfilters_calib_tokens}: the query filter must be estimated before the "
                     f"caches are quantized")


def add_cache_args(group) -> None:
    """The eviction-cache flags (defaults: :mod:`qfilters_mlx.config`)."""
    from qfilters_mlx.backends.dispatch import BACKENDS
    from qfilters_mlx.scorers import scorer_names

    group.add_argument("--method", choices=scorer_names(), default=DEFAULT_METHOD,
                       help=f"eviction method (default {DEFAULT_METHOD}; 'full' keeps everything)")
    group.add_argument("--budget", type=int, default=None,
                       help=f"tokens kept per layer and KV head, sinks and recent window included "
                            f"(default {DEFAULT_BUDGET})")
    group.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                       help="mlx-lm's flag, here the same as --budget N: mlx-lm's "
                            "RotatingKVCache(max_size=N) keeps 4 sinks and the last N-4 tokens, "
                            "which is --method streaming_llm --budget N; with another method it "
                            "is that method's budget")
    group.add_argument("--n-sink", type=int, default=None,
                       help=f"first positions never evicted (default {DEFAULT_N_SINK})")
    group.add_argument("--recent", type=recent_arg, default=None,
                       help=f"last positions never evicted, or 'calibrated': the per-head windows "
                            f"stored in the --filters file for this budget (`qfilters-mlx "
                            f"calibrate`). Default: budget * "
                            f"{DEFAULT_RECENT_FRACTION:g} (at most budget - n_sink - 1), the "
                            f"library's default too, chosen from measurements (docs/"
                            f"evaluation.md: on SmolLM2 recent budget/2 beat budget/4 and 0 for "
                            f"every score). Not used by streaming_llm and full")
    group.add_argument("--calib-tokens", type=int, default=None,
                       help=f"tokens the online filters (--filter-source queries or keys) are "
                            f"estimated from before they are frozen; nothing is evicted before "
                            f"(default {DEFAULT_CALIB_TOKENS})")
    group.add_argument("--filter-source", choices=FILTER_SOURCES, default=None,
                       help=f"where the Q-Filter comes from: 'calibrated' (default "
                            f"{DEFAULT_FILTER_SOURCE}: the paper's query filter of this model, "
                            f"found by model identity or calibrated once on first use and stored "
                            f"in $QFILTERS_MLX_HOME/filters), or online: 'queries' (the paper's "
                            f"SVD of the first --calib-tokens post-RoPE queries) or 'keys' (SVD of "
                            f"the first keys; sign from --sign)")
    group.add_argument("--sign", type=parse_sign, default=None, metavar="{+1,-1,auto}",
                       help=f"sign of the online filters' score; 'auto' picks it per KV head from "
                            f"the first queries. Default: +1 with --filter-source queries, "
                            f"{DEFAULT_KEY_SIGN:+d} with keys (measured on SmolLM2, see docs/configuration.md: "
                            f"the key-SVD direction points against the queries in most KV "
                            f"heads, and -1 ranked tokens by received attention better than +1 "
                            f"and than 'auto')")
    group.add_argument("--filters", default=None, metavar="FILE",
                       help="your own filters from `qfilters-mlx calibrate` (eviction starts "
                            "at once; --calib-tokens, --filter-source and --sign then do nothing)")
    group.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="eviction kernel backend (default auto)")
    group.add_argument("--max-rewind", type=int, default=None, metavar="N",
                       help="tokens a cache can rewind exactly after evicting (speculative "
                            "decoding's rejected drafts; default 0, or --num-draft-tokens with "
                            "--draft-model; must be at least --num-draft-tokens there)")


def add_heads_arg(group) -> None:
    """``--heads``: head groups at their own budgets (commands whose caches are not stored by a
    server: ``generate``, ``cache-prompt``)."""
    group.add_argument("--heads", choices=["calibrated"], default=None,
                       help="KV heads at their own budgets, at the same bytes: 'calibrated' gives "
                            "the model's retrieval heads (ranked once on needles in the "
                            "calibration text, stored beside its filter) 4 times the budget and "
                            "the other heads what is left (docs/head-groups.md, where its "
                            "measurements are). Default: every head at --budget")
