"""``qfilters-mlx server``: mlx-lm's HTTP server (``mlx_lm.server``) with eviction caches.

Every flag of ``mlx_lm.server`` is passed to its own ``main`` unchanged (same
HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``; same batching flags ``--decode-concurrency`` and
``--prompt-concurrency``; binding defaults to 127.0.0.1). This module adds the
cache flags (:func:`qfilters_mlx.commands.options.add_cache_args`) and, around
mlx-lm's ``main``:

* :class:`QFiltersModelProvider` (mlx-lm's ``ModelProvider``): after a model is
  loaded, :meth:`KVCacheBuilder.install` makes ``model.make_cache()`` build
  fresh eviction caches for every request; they batch through
  :class:`~qfilters_mlx.cache.batch.BatchQFiltersCache`, so the server keeps
  batching (``is_batchable``);
* :class:`LoggingPromptCache` (mlx-lm's ``LRUPromptCache``, the prompt-cache
  reuse across requests): logs each finished request's tokens seen, kept
  tokens and KV bytes (against a full cache) when its cache is stored.

The configuration is printed at start, and the log names the filter in use and where it came
from. The default is the library's: the model's calibrated query filter, found or made once by
:meth:`KVCacheBuilder.install` (:mod:`qfilters_mlx.filters.default_filters`). The opt-in online
query filters (``--filter-source queries``, ``--sign auto``) cannot run here (mlx-lm builds and
batches the caches itself, outside ``observe_queries``) and are refused.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

__all__ = ["LoggingPromptCache", "QFiltersModelProvider", "add_parser", "request_summary", "run"]

_CONFIG = None  # the KVCacheConfig the server installs (set by run)


def add_parser(sub) -> None:
    """Add ``server`` to ``sub``; the arguments after ``server`` (``args.server_args``, set by
    :func:`qfilters_mlx.commands.cli.main`) are parsed by :func:`run`."""
    sp = sub.add_parser(
        "server", add_help=False,
        help="mlx_lm.server with eviction caches (same flags and HTTP API, plus the cache flags)",
        description="Start mlx-lm's HTTP server with Q-Filters eviction caches.")
    sp.set_defaults(_run=run, _parser=sp, passes_through=True)  # cli.main sets server_args


def cache_parser() -> argparse.ArgumentParser:
    """The cache flags (and the mlx-lm flags this command reads) of ``qfilters-mlx server``."""
    from qfilters_mlx.commands import options

    p = argparse.ArgumentParser(prog="qfilters-mlx server", add_help=False,
                                description="mlx_lm.server with eviction caches: the cache flags "
                                            "below, then every mlx_lm.server flag")
    options.add_cache_args(p.add_argument_group("KV-cache eviction"))
    p.add_argument("--model", default=None, help="model folder or HF id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--seed", type=int, default=None, help="seed of --method random")
    return p


def request_summary(caches, prompt_tokens: int) -> str:
    """One log line for a finished request: tokens seen, kept and KV bytes of its caches."""
    ours = [c for c in caches if hasattr(c, "tokens_kept")]
    if not ours:
        return f"request done: {prompt_tokens} tokens, no eviction caches"
    kv = sum(c.nbytes for c in ours)
    full = sum(c.full_seq_bytes for c in ours)
    kept = max(c.tokens_kept for c in ours)
    return (f"request done: {ours[0].tokens_seen} tokens seen, {kept} kept per layer and KV head "
            f"({len(ours)} layers), KV {kv / 1e6:.2f} MB (a full cache: {full / 1e6:.2f} MB)")


def _classes():
    """mlx-lm's server classes with our additions (imported late: mlx is heavy)."""
    import mlx_lm.server as server
    from mlx_lm.models.cache import make_prompt_cache

    from qfilters_mlx.cache.builder import KVCacheBuilder

    class QFiltersModelProvider(server.ModelProvider):
        """mlx-lm's ``ModelProvider`` that installs eviction caches on every loaded model."""

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            super()._load(model_path, adapter_path, draft_model_path)
            folder = model_path if isinstance(model_path, str) and Path(model_path).is_dir() else None
            report = KVCacheBuilder.install(self.model, _CONFIG, tokenizer=self.tokenizer,
                                            model_path=folder)
            logging.info(f"qfilters-mlx: {report.summary()}")
            if self.draft_model is not None:
                draft = KVCacheBuilder.install(self.draft_model, _CONFIG, tokenizer=self.tokenizer)
                logging.info(f"qfilters-mlx: draft model: {draft.summary()}")
            self.is_batchable = self.draft_model is None and all(
                hasattr(c, "merge") for c in make_prompt_cache(self.model))

    class LoggingPromptCache(server.LRUPromptCache):
        """mlx-lm's prompt cache that logs each finished request's cache (see :func:`request_summary`)."""

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            if cache_type == "assistant":
                logging.info(f"qfilters-mlx: {request_summary(prompt_cache, len(tokens))}")
            return super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    return server, QFiltersModelProvider, LoggingPromptCache


def __getattr__(name):  # QFiltersModelProvider / LoggingPromptCache, built on first use
    if name in ("QFiltersModelProvider", "LoggingPromptCache"):
        _, provider, prompt_cache = _classes()
        return provider if name == "QFiltersModelProvider" else prompt_cache
    raise AttributeError(name)


def _config(parser, args):
    from qfilters_mlx.commands.cache_options import config_from_args, describe_config, warn_ignored

    if args.method == "qfilters" and args.filters is None:
        if args.filter_source == "queries" or args.sign == "auto":
            parser.error("--filter-source queries and --sign auto estimate the filter from observed "
                         "queries, which mlx_lm.server's own batching cannot deliver: use the "
                         "default (the calibrated query filter), --filters FILE from "
                         "`qfilters-mlx calibrate`, or --filter-source keys")
    warn_ignored(parser, args)
    config = config_from_args(parser, args)
    return config, describe_config(config)


def run(parser, args, blas_library: str | None = None) -> int:
    """Parse the cache flags, print them, and run ``mlx_lm.server.main`` with the rest."""
    global _CONFIG
    from qfilters_mlx.commands.model_path import resolve_model

    argv = list(args.server_args)
    ours = cache_parser()
    if "-h" in argv or "--help" in argv:
        ours.print_help()
        print("\nmlx_lm.server flags:\n")
    cache_args, rest = ours.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    _CONFIG, described = _config(ours, cache_args)
    if cache_args.draft_model is not None:
        rest += ["--draft-model", cache_args.draft_model,
                 "--num-draft-tokens", str(cache_args.num_draft_tokens)]
    if "-h" not in argv and "--help" not in argv:
        rest += ["--model", str(resolve_model(ours, cache_args.model))]
    else:
        rest.append("--help")
    server, provider, prompt_cache = _classes()
    print(f"qfilters-mlx server: KV cache {described} backend={_CONFIG.qfilters_backend}"
          f"{' (BLAS: ' + blas_library + ')' if blas_library else ''}", file=sys.stderr, flush=True)
    server.ModelProvider, server.LRUPromptCache = provider, prompt_cache
    old_argv = sys.argv
    sys.argv = ["qfilters-mlx server", *rest]
    try:
        server.main()
    finally:
        sys.argv = old_argv
    return 0
