"""``qfilters-mlx server``: mlx-lm's HTTP server (``mlx_lm.server``) with eviction caches.

Every flag of ``mlx_lm.server`` is passed to its own ``main`` unchanged (same
HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``; same batching flags ``--decode-concurrency`` and
``--prompt-concurrency``; binding defaults to 127.0.0.1). This module adds the
cache flags (:func:`qfilters_mlx.commands.options.add_cache_args`) and, around
mlx-lm's ``main``:

* :class:`QFiltersModelProvider` (mlx-lm's ``ModelProvider``): loads the served
  model before the server answers (a bad model or ``--filters`` file stops the
  start), then :meth:`KVCacheBuilder.install` makes ``model.make_cache()`` build
  fresh eviction caches for every request; they batch through
  :class:`~qfilters_mlx.cache.batch.BatchQFiltersCache`, so the server keeps
  batching (``is_batchable``);
* ``StoredConversations`` (mlx-lm's ``LRUPromptCache``, :mod:`.server_cache`):
  reuses stored conversations without asking a cache for a rewind it cannot do, and
  rewinds only to call boundaries the prompt's cold run also has (warm equals cold), keeps
  each stored cache at its budget plus its rewind journal (per conversation at most a
  prompt checkpoint and its answer, usually the answer alone), bounds what is stored by
  ``--prompt-cache-size`` and ``--prompt-cache-bytes`` whenever an entry is stored, and
  logs each finished request's tokens, bytes, and the bytes all stored caches hold;
* the request checks and the restarting generation loop of :mod:`.server_http`
  and :mod:`.server_requests`: every body is checked before generation (400 naming
  the field); requests naming another ``model``, ``draft_model`` or ``adapters``
  are refused unless ``--allow-model-switch`` (every alias of what is served is
  ``default_model``); a client's own chat template unless ``--allow-chat-template``;
  prompts over the model's context unless ``--max-prompt-tokens`` raises it, and
  ``max_tokens`` over the context left (or ``--max-tokens-limit``); POST bodies that are
  not JSON (415), a ``Host`` that is not loopback or ``--allowed-hosts`` (403), bodies
  slower than ``--body-timeout`` (408), connections beyond ``--max-connections`` (503);
  CORS allows no origin unless ``--allowed-origins`` names them.

Prompts are processed in calls of ``--prefill-step-size`` tokens (mlx-lm's flag, 2,048 by
default) at the same positions as ``mlx_lm.generate`` and ``qfilters-mlx generate``, so
a greedy answer is the library's. The caches rewind :data:`DEFAULT_MAX_REWIND` tokens
exactly unless ``--max-rewind`` says otherwise (``--num-draft-tokens`` at least, with a
draft model; 0 with ``--kv-bits``, whose caches cannot rewind).

The configuration is printed at start, and the log names the filter in use and where it came
from. The default is the library's: the model's calibrated query filter, found or made once by
:meth:`KVCacheBuilder.install` (:mod:`qfilters_mlx.filters.default_filters`). The opt-in online
query filters (``--filter-source queries``, ``--sign auto``) cannot run here (mlx-lm builds and
batches the caches itself, outside ``observe_queries``) and are refused.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from qfilters_mlx.commands.server_flags import DEFAULT_DISK_BYTES, DEFAULT_PROMPT_CACHE_SIZE, cache_parser
from qfilters_mlx.commands.server_memory import map_large_blocks

__all__ = ["DEFAULT_MAX_REWIND", "QFiltersModelProvider", "StoredConversations", "add_parser", "answer_journal",
           "context_length", "run"]

_CONFIG = None  # the KVCacheConfig the server installs (set by run)
_BUILDER = None  # the KVCacheBuilder holding --backend and --max-rewind (set by run; None: defaults)

DEFAULT_MAX_REWIND = 64
"""Tokens a stored checkpoint rewinds exactly after an eviction, unless ``--max-rewind`` says
otherwise. Each stored checkpoint keeps at most this many rows of rewind journal besides its
budget (a stored answer: this many, or the decode steps back to its prompt when they are
fewer rows than its prompt checkpoint: :func:`answer_journal`), so a stored conversation is reused by
a prompt that leaves it up to this many tokens before its end (a regenerated answer of up to
this many tokens), fewer when its last calls evicted more rows than that (a multi-token call
keeps the rows it dropped: a prompt's last prefill call usually cannot be rewound at rest). Cost (decode speed, bytes):
bench/results/server_soak.md."""

def answer_journal(config) -> int:
    """Tokens the server's caches journal while they generate when ``--max-rewind`` is not
    given: ``budget + 1``, so a stored answer shorter than that can keep the decode steps back
    to its prompt (one K/V row each) instead of its prompt checkpoint (``budget`` rows)."""
    return int(getattr(config, "qfilters_budget", 0) or 0) + 1




def add_parser(sub) -> None:
    """Add ``server`` to ``sub``; the arguments after ``server`` (``args.server_args``, set by
    :func:`qfilters_mlx.commands.cli.main`) are parsed by :func:`run`."""
    sp = sub.add_parser(
        "server", add_help=False,
        help="mlx_lm.server with eviction caches (same flags and HTTP API, plus the cache flags)",
        description="Start mlx-lm's HTTP server with Q-Filters eviction caches.")
    sp.set_defaults(_run=run, _parser=sp, passes_through=True)  # cli.main sets server_args


def _builder():
    """The :class:`~qfilters_mlx.cache.builder.KVCacheBuilder` of the server's build flags."""
    from qfilters_mlx.cache.builder import KVCacheBuilder

    return _BUILDER if _BUILDER is not None else KVCacheBuilder()


def context_length(model) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its args, or of their
    ``text_config``), or ``None`` when it does not say."""
    args = getattr(model, "args", None)
    for where in (args, getattr(args, "text_config", None)):
        if isinstance(where, dict):
            n = where.get("max_position_embeddings")
        else:
            n = getattr(where, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def _aliases(value, path=None) -> set:
    """Names of a model, draft model or adapters folder given as ``value`` (and resolved to
    ``path``): the value as given, the path, the resolved path, the folder name, each also
    without a trailing ``/``."""
    names = set()
    for v in (value, path):
        if v is None:
            continue
        p = Path(v)
        names |= {str(v), str(v).rstrip("/") or str(v), str(p), str(p.resolve()), p.name}
    return {n for n in names if n and n != "."}


def _max_rewind(quantized: bool):
    """Tokens the served caches rewind after an eviction (a draft's ``num_draft_tokens`` bound):
    ``None`` when they never evict, 0 when quantized (no journal), else the built depth."""
    from qfilters_mlx.scorers import scorer_class

    if not scorer_class(_CONFIG.method).evicts:
        return None
    if quantized:
        return 0
    depth = _builder().options_for(_CONFIG).max_rewind
    return depth if isinstance(depth, int) else 0


def _served(cache_args, model_path, quantized: bool = False):
    """The names a request may use for what this server was started with (:class:`Served`)."""
    from qfilters_mlx.commands.server_requests import Served

    from qfilters_mlx.assets.models import DEFAULT_MODEL

    # started with no --model, the default's registry name is the value it was given
    given = cache_args.model if cache_args.model is not None else DEFAULT_MODEL
    names = {"default_model"} | _aliases(given, model_path)
    draft = _aliases(cache_args.draft_model) if cache_args.draft_model is not None else set()
    adapters = _aliases(cache_args.adapter_path) if cache_args.adapter_path is not None else set()
    hosts = {h.strip().lower() for h in cache_args.allowed_hosts.split(",") if h.strip()}
    return Served(model_names=names, draft_names=draft, adapter_names=adapters,
                  allow_switch=cache_args.allow_model_switch,
                  max_rewind=_max_rewind(quantized),
                  max_tokens_limit=cache_args.max_tokens_limit, allowed_hosts=hosts,
                  has_draft=cache_args.draft_model is not None,
                  default_draft_tokens=cache_args.num_draft_tokens,
                  allow_chat_template=cache_args.allow_chat_template,
                  max_prompt_tokens=cache_args.max_prompt_tokens)


def _classes(served=None, max_body_bytes=None, max_prompt_tokens=None, journal_at_rest=None,
             http_limits=None, disk=None):
    """mlx-lm's server classes with our additions (imported late: mlx is heavy). ``disk``:
    ``(folder, max_bytes, lock)`` of ``--prompt-cache-dir`` (:mod:`.server_disk`), or ``None``."""
    import mlx_lm.models.cache as cache_module
    import mlx_lm.server as server
    from mlx_lm.models.cache import make_prompt_cache

    from qfilters_mlx.commands.server_cache import prompt_cache_class
    from qfilters_mlx.commands.server_http import handler_class
    from qfilters_mlx.commands.server_loop import generator_class
    from qfilters_mlx.commands.server_requests import MAX_BODY_BYTES

    class QFiltersModelProvider(server.ModelProvider):
        """mlx-lm's ``ModelProvider`` that installs eviction caches on every loaded model and
        never says why another model failed to load (the error would reveal which paths exist).
        The served model loads in the generation thread (MLX streams are per thread) before the
        server answers (:func:`~.server_loop.generator_class`)."""

        def __init__(self, cli_args):
            super().__init__(cli_args)
            self.served = served

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            try:
                super()._load(model_path, adapter_path, draft_model_path)
                folder = (model_path if isinstance(model_path, str) and Path(model_path).is_dir()
                          else None)
                report = _builder().install(self.model, _CONFIG, tokenizer=self.tokenizer,
                                            model_path=folder)
                draft = None
                if self.draft_model is not None:  # its own folder's tokenizer when it has one;
                    # the served tokenizer only if the vocabularies agree (else its ids overrun)
                    d = draft_model_path
                    d_folder = d if isinstance(d, str) and Path(d).is_dir() else None
                    same_vocab = (_vocab_size(self.draft_model, self.tokenizer)
                                  == _vocab_size(self.model, self.tokenizer))
                    draft = _builder().install(
                        self.draft_model, _CONFIG, model_path=d_folder,
                        tokenizer=None if d_folder or not same_vocab else self.tokenizer)
            except Exception as err:
                self.reset()
                cli = self.cli_args
                if (model_path, adapter_path, draft_model_path) == (cli.model, cli.adapter_path,
                                                                    cli.draft_model):
                    raise  # the served model itself: the operator sees the reason at start
                logging.warning(f"qfilters-mlx: loading a requested model failed: {err!r}")
                raise ValueError("the requested model could not be loaded") from None
            logging.info(f"qfilters-mlx: {report.summary()}")
            if draft is not None:
                logging.info(f"qfilters-mlx: draft model: {draft.summary()}")
            self.is_batchable = self.draft_model is None and all(
                hasattr(c, "merge") for c in make_prompt_cache(self.model))
            if self.served is not None:
                self.served.vocab_size = _vocab_size(self.model, self.tokenizer)
                self.served.takes_images = self.processor is not None
                self.served.max_prompt_tokens = (max_prompt_tokens if max_prompt_tokens is not None
                                                 else context_length(self.model))
                self.served.context = context_length(self.model)

    prompt_cache = prompt_cache_class(cache_module, journal_at_rest)
    if disk is not None:
        from qfilters_mlx.commands.server_disk import disk_conversations_class

        prompt_cache = disk_conversations_class(prompt_cache, *disk)
    handler = handler_class(server, max_body_bytes or MAX_BODY_BYTES, **(http_limits or {}))
    return server, QFiltersModelProvider, prompt_cache, generator_class(server), handler


def _vocab_size(model, tokenizer) -> int:
    """Width of the model's logits (token ids a request may name): the model's
    ``args.vocab_size``, else the tokenizer's vocabulary."""
    n = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(n) if n else len(tokenizer.vocab)


def __getattr__(name):  # QFiltersModelProvider / StoredConversations, built on first use
    if name in ("QFiltersModelProvider", "StoredConversations"):
        _, provider, prompt_cache, _, _ = _classes()
        return provider if name == "QFiltersModelProvider" else prompt_cache
    raise AttributeError(name)


def _config(parser, args):
    from qfilters_mlx.commands.cache_options import config_from_args, describe_config, warn_ignored
    from qfilters_mlx.scorers import scorer_class

    if scorer_class(args.method).uses_filter and args.filters is None:
        if args.filter_source == "queries" or args.sign == "auto":
            parser.error("--filter-source queries and --sign auto estimate the filter from observed "
                         "queries, which mlx_lm.server's own batching cannot deliver: use the "
                         "default (the calibrated query filter), --filters FILE from "
                         "`qfilters-mlx calibrate`, or --filter-source keys")
    warn_ignored(parser, args)
    config = config_from_args(parser, args)
    return config, describe_config(config)


def run(parser, args, blas_library: str | None = None) -> int:
    """Parse the cache flags, print them, and run ``mlx_lm.server.main`` with the rest
    (and with this package's model provider, prompt cache, generation loop and handler)."""
    global _BUILDER, _CONFIG
    from qfilters_mlx.commands.cache_options import builder_from_args
    from qfilters_mlx.commands.model_path import resolve_model
    from qfilters_mlx.scorers import scorer_class

    argv = list(args.server_args)
    ours = cache_parser()
    helping = "-h" in argv or "--help" in argv
    if helping:
        ours.print_help()
        print("\nmlx_lm.server flags:\n")
    cache_args, rest = ours.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    quantized = any(a == "--kv-bits" or a.startswith("--kv-bits=") for a in rest)
    if quantized and cache_args.draft_model is not None and scorer_class(cache_args.method).evicts:
        ours.error("--kv-bits with --draft-model: a quantized eviction cache cannot rewind the "
                   "rejected draft tokens; drop one of them")
    at_rest = None  # journal rows a stored checkpoint keeps (None: each cache's max_rewind)
    if cache_args.max_rewind is None and scorer_class(cache_args.method).evicts and not quantized:
        at_rest = cache_args.max_rewind = max(DEFAULT_MAX_REWIND, cache_args.num_draft_tokens
                                              if cache_args.draft_model is not None else 0)
    _CONFIG, described = _config(ours, cache_args)
    if at_rest is not None:  # decode steps journaled back to the prompt while cheaper than
        cache_args.max_rewind = max(at_rest, answer_journal(_CONFIG))  # its checkpoint
    _BUILDER = builder_from_args(ours, cache_args)
    if cache_args.draft_model is not None:
        rest += ["--draft-model", cache_args.draft_model,
                 "--num-draft-tokens", str(cache_args.num_draft_tokens)]
    if cache_args.adapter_path is not None:
        rest += ["--adapter-path", cache_args.adapter_path]
    size = cache_args.prompt_cache_size
    rest += ["--allowed-origins", cache_args.allowed_origins,
             "--prompt-cache-size", str(DEFAULT_PROMPT_CACHE_SIZE if size is None else size)]
    disk = None
    if cache_args.prompt_cache_dir is not None and not helping:
        from qfilters_mlx.commands.server_files import lock_folder

        try:  # (before the model loads: a second server on the folder stops at once)
            lock = lock_folder(cache_args.prompt_cache_dir)
        except (ValueError, RuntimeError) as err:
            ours.error(str(err))
        except OSError as err:
            ours.error(f"--prompt-cache-dir {cache_args.prompt_cache_dir}: {err.strerror or err}")
        disk = (cache_args.prompt_cache_dir, cache_args.prompt_cache_disk_bytes or DEFAULT_DISK_BYTES, lock)
    elif cache_args.prompt_cache_disk_bytes is not None:
        ours.error("--prompt-cache-disk-bytes bounds the files of --prompt-cache-dir: name the folder")
    served = None
    if not helping:
        map_large_blocks()  # (before the model loads: freed blocks leave the resident set)
        model_path = resolve_model(ours, cache_args.model)
        rest += ["--model", str(model_path)]
        served = _served(cache_args, model_path, quantized)
    else:
        rest.append("--help")
    limits = {k: v for k, v in (("max_connections", cache_args.max_connections),
                                ("body_timeout", cache_args.body_timeout)) if v is not None}
    server, provider, prompt_cache, generator, handler = _classes(
        served, cache_args.max_body_bytes, cache_args.max_prompt_tokens, at_rest, limits, disk)
    options = _builder().options_for(_CONFIG)
    rest_note = f" (stored checkpoints keep {at_rest})" if at_rest is not None else ""
    print(f"qfilters-mlx server: KV cache {described} max_rewind={options.max_rewind}{rest_note} "
          f"backend={options.backend}"
          f"{' (BLAS: ' + blas_library + ')' if blas_library else ''}", file=sys.stderr, flush=True)
    http = server._run_http_server
    server.ModelProvider, server.LRUPromptCache = provider, prompt_cache
    server.ResponseGenerator = generator
    server._run_http_server = lambda host, port, gen: http(host, port, gen, handler_class=handler)
    old_argv = sys.argv
    sys.argv = ["qfilters-mlx server", *rest]
    try:
        server.main()
    except Exception as err:  # the served model or --filters failed to load: no server
        print(f"qfilters-mlx server: cannot serve: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = old_argv
    return 0
