"""Flags shared by ``generate`` and ``cache-prompt``: the model, the prompt, mlx-lm's
quantized-cache flags (refused) and the eviction cache.

The cache flags default to ``None`` so that the command can tell which ones the user
gave: :mod:`qfilters_mlx.commands.cache_options` fills in the library's defaults
(:mod:`qfilters_mlx.config`, one set for library and command line) and warns about
flags that do nothing for the chosen method.
"""

from __future__ import annotations

import argparse

from qfilters_mlx.config import (
    DEFAULT_BUDGET,
    DEFAULT_CALIB_TOKENS,
    DEFAULT_FILTER_SOURCE,
    DEFAULT_KEY_SIGN,
    DEFAULT_METHOD,
    DEFAULT_N_SINK,
    DEFAULT_RECENT_FRACTION,
    FILTER_SOURCES,
    METHODS,
)

__all__ = ["add_cache_args", "add_model_args", "add_prompt_args", "add_quantized_kv_args",
           "check_quantized_kv_args", "parse_sign"]


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
    group.add_argument("--model", default=None,
                       help="local mlx-lm model folder, or a Hugging Face id fetched as mlx-lm "
                            "does where the network allows (default: SmolLM2-135M-Instruct, "
                            "prepared with `qfilters-mlx prepare-model` on first use)")
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
    """mlx-lm's quantized-cache flags, accepted so that they can be refused with a reason."""
    for flag, text in (("--kv-bits", "bits of a quantized KV cache"),
                       ("--kv-group-size", "group size of a quantized KV cache"),
                       ("--quantized-kv-start", "step from which the KV cache is quantized")):
        group.add_argument(flag, type=int, default=None,
                           help=f"mlx-lm's {text}: refused (the eviction caches store K/V in "
                                f"the model's dtype; quantized storage is not implemented)")


def check_quantized_kv_args(parser, args) -> None:
    """Refuse mlx-lm's quantized-cache flags (they would be ignored by our caches)."""
    for flag in ("kv_bits", "kv_group_size", "quantized_kv_start"):
        if getattr(args, flag, None) is not None:
            parser.error(f"--{flag.replace('_', '-')}: quantized KV storage is not supported by "
                         f"the eviction caches yet (they keep K/V in the model's dtype; mlx-lm "
                         f"would silently skip them); leave the flag out")


def add_cache_args(group) -> None:
    """The eviction-cache flags (defaults: :mod:`qfilters_mlx.config`)."""
    from qfilters_mlx.backends.dispatch import BACKENDS

    group.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
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
                            f"library's default too, chosen from measurements (README, "
                            f"'Evaluation': on SmolLM2 recent budget/2 beat budget/4 and 0 for "
                            f"every score). Not used by streaming_llm and full")
    group.add_argument("--calib-tokens", type=int, default=None,
                       help=f"tokens the online qfilters filter is estimated from before it is "
                            f"frozen; nothing is evicted before (default {DEFAULT_CALIB_TOKENS})")
    group.add_argument("--filter-source", choices=FILTER_SOURCES, default=None,
                       help=f"online Q-Filter estimator: 'queries' (the paper's: SVD of the first "
                            f"--calib-tokens post-RoPE queries, sign fixed by the queries; "
                            f"default {DEFAULT_FILTER_SOURCE}) or 'keys' (SVD of the first keys; "
                            f"sign from --sign)")
    group.add_argument("--sign", type=parse_sign, default=None, metavar="{+1,-1,auto}",
                       help=f"sign of the filter score; 'auto' picks it per KV head from the "
                            f"first queries. Default: +1 with --filter-source queries, "
                            f"{DEFAULT_KEY_SIGN:+d} with keys (measured on SmolLM2, see README: "
                            f"the key-SVD direction points against the queries in most KV "
                            f"heads, and -1 ranked tokens by received attention better than +1 "
                            f"and than 'auto')")
    group.add_argument("--filters", default=None, metavar="FILE",
                       help="precomputed filters from `qfilters-mlx calibrate` (eviction starts "
                            "at once; --calib-tokens, --filter-source and --sign then do nothing)")
    group.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="eviction kernel backend (default auto)")
    group.add_argument("--max-rewind", type=int, default=None, metavar="N",
                       help="tokens a cache can rewind exactly after evicting (speculative "
                            "decoding's rejected drafts; default 0, or --num-draft-tokens with "
                            "--draft-model; must be at least --num-draft-tokens there)")
