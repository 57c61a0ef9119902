"""The default Q-Filters: a model's calibrated query filter, found or made once.

``KVCacheConfig()`` has ``qfilters_filter_source="calibrated"``: "the calibrated filter of the
model the caches are built for". :meth:`qfilters_mlx.KVCacheBuilder.for_model` resolves it with
:func:`resolve_filters`, in this order:

1. ``config.qfilters_filters``: the file (checked against the model) or array given;
2. a file for the model's identity (:func:`qfilters_mlx.identity.model_identity`):
   ``<model folder>/qfilters_filters.safetensors`` when the folder is known, then
   :func:`stored_path` in the user cache (``$QFILTERS_MLX_HOME/filters``, else
   ``$XDG_CACHE_HOME/qfilters-mlx/filters``, else ``~/.cache/qfilters-mlx/filters``);
   a converted release of the paper's filters placed there is found the same way;
3. else it calibrates now, once (the paper's estimator,
   :func:`qfilters_mlx.filters.calibration.calibrate_filters`), on :data:`CALIBRATION_TOKENS`
   tokens of the calibration text that ships with Python
   (:func:`qfilters_mlx.assets.prompts.calibration_text`, disjoint from the evaluation text),
   with a progress bar on stderr, stores the file at :func:`stored_path` and prints one line
   saying what was calibrated, from how many tokens and where it was stored.

Tokens need a tokenizer: the one passed to ``for_model(..., tokenizer=)``, else the model
folder's (``model_path=``). Without either, the model samples its own calibration text
(temperature 1, from a seeded random start token; ``bench/results/calibration_tokens.md``
compares those filters with text-calibrated ones); such a file is replaced by a text-calibrated
one at the first build that has a tokenizer.

When no query-derived filter can be had (the model's queries cannot be captured) the caches
use the online key-SVD filter (sign :data:`qfilters_mlx.config.DEFAULT_KEY_SIGN`) and one line on
stderr says so, naming ``qfilters-mlx calibrate``. Every outcome is named in
:attr:`qfilters_mlx.cache.builder.BuildReport.filters`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["CALIBRATION_CHUNK", "CALIBRATION_TOKENS", "FOLDER_FILENAME", "SAMPLED_TOKENS", "ResolvedFilters", "encode_quietly",
           "filters_home",
           "model_tokenizer", "resolve_filters", "say", "store_atomically", "stored_path"]

CALIBRATION_TOKENS = 2048
"""Tokens of calibration text the default filters are calibrated on (forward passes of
:data:`CALIBRATION_CHUNK`): on SmolLM2 the smallest count as good as the evaluation's filters from
4,096 tokens (``bench/results/calibration_tokens.md``): streaming perplexity at budget 256 13.484
vs 13.479, mean cosine per KV head 0.9991 (1,024 tokens: 13.518, 0.9985; 512: 13.724, 0.982)."""

SAMPLED_TOKENS = 512
"""Tokens the model samples itself when no tokenizer is at hand (one forward step each, so it
costs far more than text): mean cosine 0.971 to filters from 4,096 text tokens, perplexity 13.81
at budget 256 (uniform random token ids: 0.952, 13.69); ``bench/results/calibration_tokens.md``.
Such a file is replaced by a text-calibrated one once a tokenizer is at hand."""

CALIBRATION_CHUNK = 1024
"""Tokens per forward pass of the calibration (``qfilters-mlx calibrate``'s default)."""

FOLDER_FILENAME = "qfilters_filters.safetensors"
"""Name of a filters file inside a model folder (found when the folder is known)."""

TOKENIZER_FREE = "text the model sampled itself (no tokenizer given)"
"""How the tokenizer-free calibration describes its tokens (see the module doc)."""

SAMPLING_SEED = 0


@dataclass(frozen=True)
class ResolvedFilters:
    """What :func:`resolve_filters` found.

    Attributes:
        filters: ``[n_layers, n_kv_heads, head_dim]`` float32 (the whole model's heads), or
            ``None`` when the caches estimate their filter online.
        config: the configuration the caches are built with (the given one, or the key-SVD
            fallback when no query-derived filter can be had).
        origin: one line naming the filter in use and where it came from.
    """

    filters: object
    config: object
    origin: str


def filters_home() -> Path:
    """Folder of the filters files made or found by model identity (not created here)."""
    from qfilters_mlx.assets.prepare_model import cache_root

    return cache_root() / "filters"


def stored_path(model_id: str) -> Path:
    """``filters_home() / "<model_id>.safetensors"``: the user-cache file of a model."""
    return filters_home() / f"{model_id}.safetensors"


def say(model, text: str) -> None:
    """Print ``text`` as one line on stderr (rank 0 of a tensor-parallel model only)."""
    from qfilters_mlx.sharding import rank_of

    if rank_of(model)[0] == 0:
        print(text, file=sys.stderr, flush=True)


def _describe_file(path, meta: dict, how: str) -> str:
    tokens = meta.get("calibration_tokens", "?")
    text = meta.get("calibration_text", "unknown text")
    return f"calibrated query filter {path} ({how}; {tokens} tokens of {text})"


def _found(model, model_id: str, model_path, text_possible: bool) -> ResolvedFilters | None:
    """The model folder's file, else the user-cache file; a user-cache file made without a
    tokenizer is passed over when one is at hand (it is then calibrated on text and replaced)."""
    from qfilters_mlx.filters.calibration import load_filters

    candidates = []
    if model_path is not None and Path(model_path, FOLDER_FILENAME).is_file():
        candidates.append((Path(model_path, FOLDER_FILENAME), "the model folder's"))
    if stored_path(model_id).is_file():
        candidates.append((stored_path(model_id), "found by model identity"))
    if not _every_rank(model, bool(candidates)):
        return None  # ranks on other machines lack the file: all of them calibrate together
    for path, how in candidates:
        filters, meta = load_filters(str(path), model)  # a file for another model raises
        if how != "the model folder's" and text_possible and meta.get("calibration_text") == TOKENIZER_FREE:
            continue
        return ResolvedFilters(filters, None, _describe_file(path, meta, how))
    return None


def _every_rank(model, flag: bool) -> bool:
    """``flag`` on every rank of the model's tensor-parallel group (one ``all_sum``), so that
    ranks on different machines (each with its own cache folder) take the same path through the
    collective operations of loading or calibrating; ``flag`` itself when not sharded."""
    import mlx.core as mx

    from qfilters_mlx.sharding import tensor_group

    group = tensor_group(model)
    if group is None:
        return flag
    total = mx.distributed.all_sum(mx.array(int(flag)), group=group, stream=mx.cpu)
    return int(total.item()) == group.size()


def model_tokenizer(tokenizer, model_path):
    """``tokenizer``, else the tokenizer of the model folder ``model_path`` (when it is one), else ``None``."""
    if tokenizer is not None or model_path is None or not Path(model_path).is_dir():
        return tokenizer
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(model_path))


def _sampled_ids(model, n: int, bar) -> list[int]:
    """``n`` tokens the model samples itself (temperature 1) from a seeded random start."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    key = mx.random.key(SAMPLING_SEED)
    cache = make_prompt_cache(model)
    logits = model(mx.array([[0]]), cache=cache)[:, -1]
    k0, key = mx.random.split(key)
    tok = mx.random.randint(0, logits.shape[-1], (1, 1), key=k0)
    cache = make_prompt_cache(model)
    out = [int(tok.item())]
    while len(out) < n:
        k, key = mx.random.split(key)
        tok = mx.random.categorical(model(tok, cache=cache)[:, -1], key=k)[None]
        out.append(int(tok.item()))
        bar.update(1)
    return out


def encode_quietly(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text)`` without transformers' "sequence length is longer than the
    specified maximum" warning: the text is tokenized whole but run through the model in
    chunks, so the warning's "indexing errors" cannot happen."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - mlx-lm depends on transformers
        return tokenizer.encode(text)
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return tokenizer.encode(text)
    finally:
        hf_logging.set_verbosity(before)



def _calibration_ids(model, tokenizer, n: int, bar) -> tuple[list[int], str]:
    if tokenizer is None:
        return _sampled_ids(model, n, bar), TOKENIZER_FREE
    from qfilters_mlx.assets.prompts import calibration_text

    text, source = calibration_text()
    return encode_quietly(tokenizer, text)[:n], source


def _progress(model, total: int, desc: str):
    from tqdm import tqdm

    from qfilters_mlx.sharding import rank_of

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr,
                disable=rank_of(model)[0] != 0, leave=False)


def store_atomically(path: Path, write) -> str | None:
    """``write(tmp)`` to a temporary file beside ``path``, then move it to ``path`` (the folder
    is made); the error text if it cannot be written (nothing is left behind then). ``write``
    may write nothing (a tensor-parallel rank other than 0): ``path`` is then left as it is."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(str(tmp))
        if tmp.exists():
            os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # (mx.save_safetensors raises RuntimeError)
        return f"{type(err).__name__}: {err}"
    finally:
        if tmp.exists():  # (False, not an error, when the folder could not be made)
            tmp.unlink()
    return None


def _store(model, filters, path: Path, **info) -> str | None:
    """Write ``filters`` atomically to ``path``; the error text if it cannot be written."""
    from qfilters_mlx.filters.calibration import save_filters

    return store_atomically(path, lambda tmp: save_filters(tmp, filters, model, **info))


def _calibrate_now(model, model_id: str, tokenizer, config) -> ResolvedFilters:
    from qfilters_mlx.filters.calibration import calibrate_filters
    from qfilters_mlx.filters.capture import QueriesNotCaptured

    tic = time.perf_counter()
    if tokenizer is None:
        with _progress(model, SAMPLED_TOKENS - 1, "Sampling Q-Filters calibration tokens") as bar:
            ids, source = _calibration_ids(model, None, SAMPLED_TOKENS, bar)
    else:
        ids, source = _calibration_ids(model, tokenizer, CALIBRATION_TOKENS, None)
    chunks = [ids[i:i + CALIBRATION_CHUNK] for i in range(0, len(ids), CALIBRATION_CHUNK)]
    try:
        with _progress(model, len(ids), "Calibrating Q-Filters") as bar:
            filters = calibrate_filters(model, _ticking(chunks, bar))
    except QueriesNotCaptured as err:
        fallback = replace(config, qfilters_filter_source="keys", qfilters_sign=None)
        origin = (f"online key-SVD filter, sign {fallback.qfilters_sign:+d} (no query-derived filter: "
                  f"this model's queries cannot be captured: {err}; `qfilters-mlx calibrate` makes "
                  "one where they can)")
        say(model, f"qfilters-mlx: {origin}")
        return ResolvedFilters(None, fallback, origin)
    path = stored_path(model_id)
    error = _store(model, filters, path, calibration_text=source, calibration_tokens=len(ids),
                   samples_per_head=len(ids))
    seconds = time.perf_counter() - tic
    n_layers, n_kv, hd = filters.shape
    where = f"stored in {path}" if error is None else f"not stored ({error}): made again next time"
    say(model, f"qfilters-mlx: calibrated Q-Filters ({n_layers} layers x {n_kv} KV heads x {hd}) "
                f"from {len(ids)} tokens of {source} in {seconds:.1f} s; {where}")
    how = f"calibrated now in {seconds:.1f} s" + ("" if error is None else ", not stored")
    return ResolvedFilters(filters, None, _describe_file(
        path if error is None else "(in memory)", {"calibration_tokens": len(ids),
                                                  "calibration_text": source}, how))


def _ticking(chunks, bar):
    for chunk in chunks:
        yield chunk
        bar.update(len(chunk))


def resolve_filters(model, config, tokenizer=None, model_path=None) -> ResolvedFilters:
    """The filters ``config`` asks for on ``model`` (see the module doc for the order).

    Args:
        model: an mlx-lm model (one rank of a tensor-parallel model too: identity,
            calibration and storage are then collectives every rank must call, and rank 0
            writes and prints).
        config: a :class:`qfilters_mlx.config.KVCacheConfig`.
        tokenizer: the model's tokenizer (mlx-lm's ``TokenizerWrapper`` or a Hugging Face
            tokenizer), used only to calibrate.
        model_path: the folder the model was loaded from, or ``None``.

    Returns:
        :class:`ResolvedFilters` (``filters`` ``None`` for the online filters, which the caches
        estimate themselves, and for methods without a filter).

    Raises:
        ValueError: a given file or a found file does not fit the model (it names the
            differing identity fields; a found file is not silently replaced).
    """
    from qfilters_mlx.filters.calibration import load_filters

    if not config.scorer.uses_filter:
        return ResolvedFilters(None, config, f"none (method {config.method})")
    f = config.qfilters_filters
    if isinstance(f, str):
        filters, meta = load_filters(f, model)
        return ResolvedFilters(filters, config, _describe_file(f, meta, "given"))
    if f is not None:
        return ResolvedFilters(f, config, "filters array (given)")
    if config.qfilters_filter_source == "queries":
        return ResolvedFilters(None, config, f"online query filter from the first "
                                             f"{config.qfilters_calib_tokens} queries (needs "
                                             "observe_queries)")
    if config.qfilters_filter_source == "keys":
        sign = config.qfilters_sign
        return ResolvedFilters(None, config, f"online key-SVD filter from the first "
                                             f"{config.qfilters_calib_tokens} keys, sign "
                                             f"{sign if isinstance(sign, str) else format(sign, '+d')} "
                                             "(not query-derived; `qfilters-mlx calibrate` makes a "
                                             "query filter file)")
    from qfilters_mlx.identity import model_identity

    model_id = model_identity(model)
    text_possible = tokenizer is not None or (model_path is not None and Path(model_path).is_dir())
    found = _found(model, model_id, model_path, text_possible)
    if found is not None:
        return replace(found, config=config)
    resolved = _calibrate_now(model, model_id, model_tokenizer(tokenizer, model_path), config)
    return resolved if resolved.config is not None else replace(resolved, config=config)
