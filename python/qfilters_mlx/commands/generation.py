"""One generation as the commands run it: load the model, build the prompt, stream with our caches.

Everything goes through mlx-lm's own functions (``load``, the tokenizer's chat
template, ``stream_generate`` with ``prompt_cache=``, ``draft_model=`` and
``prompt_progress_callback=``, ``make_sampler``), with
:func:`qfilters_mlx.observe_queries` around the whole call so that query-derived
filters see the queries.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qfilters_mlx.config.build import rewind_depth

__all__ = ["RunResult", "build_prompt", "load_model", "make_sampler_from_args", "prefill_progress",
           "kv_quantization", "read_prompt", "run_generation"]


@dataclass
class RunResult:
    """What one generation produced and measured.

    Attributes:
        text: the generated text.
        prompt_tokens / generation_tokens: token counts (mlx-lm's ``GenerationResponse``).
        finish_reason: ``"stop"``, ``"length"`` or ``None`` when nothing was generated.
        prompt_tps / generation_tps: tokens per second as mlx-lm measures them.
        peak_memory: bytes, ``mx.get_peak_memory()`` after a reset before the run.
        seconds: wall time of the whole call.
        caches: the model's prompt cache (the draft model's caches are not included).
    """

    text: str
    prompt_tokens: int
    generation_tokens: int
    finish_reason: str | None
    prompt_tps: float
    generation_tps: float
    peak_memory: int
    seconds: float
    caches: list = field(repr=False)


def read_prompt(parser, args) -> tuple[str, bool]:
    """The message and whether it is the shipped pass-key prompt.

    Raises (through ``parser.error``): unreadable ``--prompt-file``; an empty or
    whitespace-only prompt from ``--prompt``, ``--prompt-file`` or stdin.
    """
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"--prompt-file: cannot read {args.prompt_file}: {err}")
        if not text.strip():
            parser.error(f"--prompt-file: {args.prompt_file} is empty (or only whitespace)")
        return text, False
    if args.prompt is not None:
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        text = text.replace("\\n", "\n").replace("\\t", "\t")
        if not text.strip():
            where = "stdin gave" if args.prompt == "-" else "got"
            parser.error(f"--prompt: {where} an empty prompt (or only whitespace)")
        return text, False
    from qfilters_mlx.assets.prompts import long_prompt

    try:
        return long_prompt(), True
    except RuntimeError as err:
        parser.error(str(err))


def load_model(parser, args, path, flag: str = "--model"):
    """``mlx_lm.load`` with ``--adapter-path`` and ``--trust-remote-code``; errors name the flag."""
    from mlx_lm import load

    adapter = getattr(args, "adapter_path", None)
    if adapter is not None and not Path(adapter).exists():
        parser.error(f"--adapter-path: {adapter} does not exist")
    trust = bool(getattr(args, "trust_remote_code", False))
    try:
        return load(str(path), adapter_path=adapter if flag == "--model" else None,
                    tokenizer_config={"trust_remote_code": True} if trust else {},
                    trust_remote_code=trust)
    except (FileNotFoundError, ValueError, KeyError, OSError) as err:
        parser.error(f"{flag}: cannot load {path}: {type(err).__name__}: {err}")


def build_prompt(parser, args, tokenizer, text: str, *, continue_final: bool = False,
                 suffix_of_cached: bool = False) -> list[int]:
    """Token ids of ``text`` as mlx_lm.generate builds them (chat template unless ignored).

    Args:
        continue_final: end with the user message open (what ``cache-prompt`` stores, as
            mlx_lm.cache_prompt does), instead of adding the generation prompt.
        suffix_of_cached: the template's prefix is already in a loaded prompt cache; keep
            only what follows it (mlx_lm.generate's ``--prompt-cache-file`` rule).
    """
    if getattr(args, "use_default_chat_template", False) and not tokenizer.has_chat_template:
        default = getattr(tokenizer, "default_chat_template", None)
        if default is None:
            parser.error("--use-default-chat-template: this tokenizer has no default chat "
                         "template (use --ignore-chat-template for the raw prompt)")
        tokenizer.chat_template = default
        tokenizer.has_chat_template = True
    kwargs = {}
    if getattr(args, "chat_template_config", None) is not None:
        try:
            kwargs = json.loads(args.chat_template_config)
        except json.JSONDecodeError as err:
            parser.error(f"--chat-template-config: not JSON ({err})")
        if not isinstance(kwargs, dict):
            parser.error("--chat-template-config: must be a JSON object, e.g. "
                         "'{\"enable_thinking\": false}'")
    use_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if not use_template:
        return tokenizer.encode(text, add_special_tokens=not suffix_of_cached)
    messages = []
    if getattr(args, "system_prompt", None) is not None:
        messages.append({"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": text})
    template = dict(tokenize=False, continue_final_message=continue_final,
                    add_generation_prompt=not continue_final)
    prompt = tokenizer.apply_chat_template(messages, **template, **kwargs)
    if suffix_of_cached:
        messages[-1]["content"] = "<query>"
        probe = tokenizer.apply_chat_template(messages, **template, **kwargs)
        prompt = prompt[probe.index("<query>"):]
    return tokenizer.encode(prompt, add_special_tokens=False)


def draft_config(config):
    """The draft model's cache configuration for ``--draft-model``: ``config`` with the draft's
    own head width; a configuration that needs observed queries (query filter, ``sign="auto"``)
    becomes the key-SVD filter with its default sign, because ``observe_queries`` watches one
    model (the main one) and the draft's caches would otherwise never get their queries."""
    from dataclasses import replace

    if config.needs_queries:
        return replace(config, head_dim=None, qfilters_filter_source="keys", qfilters_sign=None)
    return replace(config, head_dim=None)


def build_draft(parser, args, draft_model, draft_tokenizer, tokenizer, config, builder,
                flag="--draft-model"):
    """``(draft_model, draft caches)`` after the checks speculative decoding needs: the same
    vocabulary, and rewinds deep enough for ``--num-draft-tokens`` rejected drafts (mlx-lm trims
    up to that many tokens from both models' caches; a deeper rewind would raise mid-generation).
    ``builder`` (a :class:`~qfilters_mlx.cache.builder.KVCacheBuilder`) builds the main model's
    caches too. Errors go to ``parser.error``."""
    if draft_tokenizer is not None and draft_tokenizer.vocab_size != tokenizer.vocab_size:
        parser.error(f"{flag}: its tokenizer does not match the model's")
    depth = rewind_depth(builder.options_for(config).max_rewind)
    if config.scorer.evicts and args.num_draft_tokens > depth:
        parser.error(f"--num-draft-tokens {args.num_draft_tokens} is more than the caches can rewind "
                     f"after an eviction (--max-rewind {depth}): raise --max-rewind")
    return draft_model, builder.for_model(draft_model, draft_config(config),
                                          tokenizer=draft_tokenizer or tokenizer)


def make_sampler_from_args(args):
    """mlx-lm's sampler for the sampling flags."""
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k)


def prefill_progress(label: str = "Prefill", min_tokens: int = 0, stream=None):
    """A ``prompt_progress_callback(processed, total)`` that prints ``label processed/total
    tokens (tok/s)`` on one stderr line, for prompts over ``min_tokens`` tokens."""
    stream = stream or sys.stderr
    start = [None]

    def callback(processed: int, total: int) -> None:
        if total <= min_tokens:
            return
        now = time.perf_counter()
        if start[0] is None:
            start[0] = now
        rate = processed / (now - start[0]) if now > start[0] else 0.0
        end = "\n" if processed >= total else ""
        print(f"\r{label}: {processed}/{total} tokens ({rate:.0f} tok/s)", end=end,
              file=stream, flush=True)

    return callback


def kv_quantization(args) -> dict:
    """mlx-lm's quantized-cache arguments from ``--kv-bits`` & co. (empty without it): its
    generation converts each cache with ``to_quantized`` past ``quantized_kv_start``."""
    if getattr(args, "kv_bits", None) is None:
        return {}
    return dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                quantized_kv_start=args.quantized_kv_start)


def run_generation(model, tokenizer, prompt_tokens, caches, args, *, draft=None, on_text=None,
                   progress=None) -> RunResult:
    """Generate from ``prompt_tokens`` with ``caches`` (updated in place; with ``--kv-bits``
    mlx-lm replaces them by their quantized versions, which ``RunResult.caches`` holds).

    Args:
        draft: ``(draft_model, draft_caches)`` for speculative decoding, or ``None``.
        on_text: called with each text segment as it streams.
        progress: mlx-lm's ``prompt_progress_callback`` (not used with a draft model:
            mlx-lm's speculative path has none).
    """
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from qfilters_mlx.filters.observe import observe_queries

    kwargs = kv_quantization(args)
    everything = list(caches)
    if draft is not None:  # the draft's caches never need queries (see draft_config)
        kwargs.update(draft_model=draft[0], num_draft_tokens=args.num_draft_tokens)
        everything += list(draft[1])
    mx.reset_peak_memory()
    pieces, last = [], None
    tic = time.perf_counter()
    with observe_queries(model, caches):  # feeds queries to query-based filters
        for last in stream_generate(model, tokenizer, prompt_tokens, max_tokens=args.max_tokens,
                                    sampler=make_sampler_from_args(args), prompt_cache=everything,
                                    prefill_step_size=args.prefill_step_size,
                                    prompt_progress_callback=progress, **kwargs):
            pieces.append(last.text)
            if on_text is not None:
                on_text(last.text)
    seconds = time.perf_counter() - tic
    if hasattr(caches, "report"):  # keep the BudgetedCaches (its report: shard, partial build)
        caches[:] = everything[: len(caches)]  # mlx-lm replaced the caches it quantized (--kv-bits)
    else:
        caches = everything[: len(caches)]
    return RunResult(
        text="".join(pieces),
        prompt_tokens=len(prompt_tokens),
        generation_tokens=last.generation_tokens if last else 0,
        finish_reason=last.finish_reason if last else None,
        prompt_tps=last.prompt_tps if last else 0.0,
        generation_tps=last.generation_tps if last else 0.0,
        peak_memory=int(mx.get_peak_memory()),
        seconds=seconds,
        caches=caches,
    )
