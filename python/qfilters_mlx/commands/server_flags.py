"""The flags of ``qfilters-mlx server`` (:mod:`.server`): the cache flags of
``qfilters-mlx generate``, the mlx-lm flags the command reads, and the serving flags it adds.
Every other flag goes to ``mlx_lm.server`` unchanged."""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_DISK_BYTES", "DEFAULT_PROMPT_CACHE_SIZE", "cache_parser"]

DEFAULT_PROMPT_CACHE_SIZE = 30
"""Stored conversations kept (mlx-lm's default is 10 for full caches)."""

DEFAULT_DISK_BYTES = 20 * 10**9
"""Bytes the files of ``--prompt-cache-dir`` may take unless ``--prompt-cache-disk-bytes`` says."""


def cache_parser() -> argparse.ArgumentParser:
    """The cache flags (and the mlx-lm flags this command reads) of ``qfilters-mlx server``."""
    from qfilters_mlx.commands import options

    p = argparse.ArgumentParser(prog="qfilters-mlx server", add_help=False,
                                description="mlx_lm.server with eviction caches: the cache flags "
                                            "below, then every mlx_lm.server flag")
    options.add_cache_args(p.add_argument_group("KV-cache eviction"))
    p.add_argument("--model", default=None, help=options.MODEL_HELP)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--adapter-path", default=None)
    p.add_argument("--seed", type=int, default=None, help="seed of --method random")
    s = p.add_argument_group("serving")
    s.add_argument("--allow-model-switch", action="store_true",
                   help="let requests name another model, draft model or adapters (mlx-lm loads "
                        "them by path; off by default: such requests get 400)")
    s.add_argument("--allowed-origins", default="",
                   help="comma-separated origins allowed by CORS (default: none; '*' for any)")
    s.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body (default 8 MiB; larger: 413)")
    s.add_argument("--prompt-cache-size", type=int, default=None, metavar="N",
                   help=f"stored conversations kept for reuse (mlx-lm's flag; default "
                        f"{DEFAULT_PROMPT_CACHE_SIZE} here: each holds at most the budget plus the "
                        f"rewind journal, twice when its answer is longer than --max-rewind)")
    s.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="also keep stored conversations as files in DIR (created mode 0700; one "
                        "server per folder), reused after they leave memory and after a restart")
    s.add_argument("--prompt-cache-disk-bytes", type=_size, default=None, metavar="N",
                   help=f"bytes the files in --prompt-cache-dir may take (suffixes K, M, G: powers "
                        f"of 1000; default {DEFAULT_DISK_BYTES // 10**9} G); past it the least "
                        f"recently used files are removed")
    s.add_argument("--allow-chat-template", action="store_true",
                   help="let requests bring their own chat template (chat_template, or "
                        "chat_template_kwargs.chat_template); off by default: such requests get 400")
    s.add_argument("--max-prompt-tokens", type=_positive, default=None, metavar="N",
                   help="longest prompt in tokens (default: the model's context, "
                        "max_position_embeddings; longer: 400)")
    s.add_argument("--max-tokens-limit", type=_positive, default=None, metavar="N",
                   help="largest max_tokens a request may ask (always at most the model's "
                        "context minus the prompt; more: 400 naming the cap)")
    s.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names accepted besides the loopback names "
                        "(default: none; '*' for any; others: 403)")
    s.add_argument("--max-connections", type=_positive, default=None, metavar="N",
                   help="connections served at once (default 64; more: 503)")
    s.add_argument("--body-timeout", type=_seconds, default=None, metavar="S",
                   help="seconds a client has to send a request body (default 60; slower: 408)")
    return p


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _size(text: str) -> int:
    """argparse type: a byte count >= 1, with an optional suffix K, M or G (powers of 1000)."""
    t = text.strip().upper().removesuffix("B")
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if scale > 1 else t) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 20G, 500M)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {text}")
    return n


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    import math

    s = float(text)
    if not (math.isfinite(s) and s > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return s
