"""Streaming perplexity: every scored token is predicted from the evicted cache.

A prefix is prefilled in one call, then the text is fed one token at a time
(teacher forcing) through the cache, exactly as in decoding
(:func:`streaming_nll`; :func:`batched_streaming_nll` runs many arms at once,
one batch row each, through :class:`~qfilters_mlx.evaluation.multi_arm.MultiArmCache`).
:func:`full_cache_nll` is the plain mlx-lm reference (``KVCache``, chunked).
NLLs are natural-log nats per token, computed in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Callable

import mlx.core as mx

from qfilters_mlx.evaluation.multi_arm import batch_caches
from qfilters_mlx.filters.observe import observe_queries

__all__ = ["PerplexitySizes", "batched_streaming_nll", "full_cache_nll", "perplexity", "streaming_nll"]


@dataclass(frozen=True)
class PerplexitySizes:
    """Sizes every streaming-perplexity run shares (the evaluation's and the segments');
    budgets and prefix/scored lengths in tokens."""

    budgets: tuple = (64, 128, 256, 512)
    n_sink: int = 4
    calib_tokens: int = 128
    seed: int = 0
    backend: str = "auto"
    ppl_prefix: int = 128
    ppl_scored: int = 2048

    def to_json(self) -> dict:
        """The settings as they read back from a JSON file (tuples become lists)."""
        return json.loads(json.dumps(asdict(self)))

    def shared(self) -> dict:
        """The :class:`PerplexitySizes` fields of this (sub)class instance, by name."""
        return {f.name: getattr(self, f.name) for f in fields(PerplexitySizes)}


def streaming_nll(model, tokens, caches, prefix: int = 16) -> list[float]:
    """Negative log-likelihoods (nats) of ``tokens[prefix:]`` under teacher forcing.

    Args:
        model: an mlx-lm model.
        tokens: 1-D sequence of token ids (list or ``mx.array``).
        caches: one cache per layer (e.g. from ``KVCacheBuilder.for_model``).
        prefix: tokens prefilled in one call before token-by-token decoding (>= 1).

    Returns:
        ``len(tokens) - prefix`` floats, the NLL of each token given all before it.

    Raises:
        ValueError: ``prefix`` outside ``[1, len(tokens) - 1]``.
    """
    return batched_streaming_nll(model, tokens, [caches], prefix)[0]


def perplexity(nll) -> float:
    """``exp(mean(nll))``."""
    nll = list(nll)
    return math.exp(sum(nll) / len(nll))


def batched_streaming_nll(model, tokens, rows: list[list], prefix: int = 16,
                          on_step: Callable[[int], None] | None = None) -> list[list[float]]:
    """:func:`streaming_nll` for several arms at once, one batch row per arm.

    Args:
        model: an mlx-lm model.
        tokens: 1-D token ids, the same text for every row.
        rows: per arm, one cache per layer (batch size 1 each).
        prefix: tokens prefilled in one call (>= 1).
        on_step: called with 1 after each decoded token (progress).

    Returns:
        Per row, ``len(tokens) - prefix`` NLLs (nats).

    Raises:
        ValueError: ``prefix`` outside ``[1, len(tokens) - 1]``; ragged ``rows``.
    """
    toks = mx.array(tokens)
    T = toks.shape[0]
    if not 1 <= prefix < T:
        raise ValueError(f"prefix must be in [1, {T - 1}], got {prefix}")
    B = len(rows)
    caches = batch_caches(rows)
    batch = mx.broadcast_to(toks[None], (B, T))
    nll = []
    with observe_queries(model, caches):  # for query-based filters
        logits = model(batch[:, :prefix], cache=caches)[:, -1]
        for t in range(prefix, T):
            lp = logits.astype(mx.float32)
            nll.append(mx.logsumexp(lp, axis=-1) - lp[:, toks[t]])
            if t + 1 < T:
                logits = model(batch[:, t : t + 1], cache=caches)[:, -1]
            if len(nll) % 32 == 0:
                mx.eval(nll, logits)
            if on_step is not None:
                on_step(1)
    out = mx.stack(nll, axis=1)
    mx.eval(out)
    return out.tolist()


def full_cache_nll(model, tokens, prefix: int, chunk: int = 512) -> list[float]:
    """NLLs of ``tokens[prefix:]`` from plain mlx-lm (``KVCache``, chunked forward passes).

    Teacher forcing over a full cache: mathematically the same as
    token-by-token decoding, at a fraction of the cost.
    """
    from mlx_lm.models.cache import make_prompt_cache

    toks = mx.array(tokens)
    T = toks.shape[0]
    cache = make_prompt_cache(model)
    out = []
    for s in range(0, T - 1, chunk):
        e = min(s + chunk, T - 1)
        lp = model(toks[None, s:e], cache=cache)[0].astype(mx.float32)
        nll = mx.logsumexp(lp, axis=-1) - mx.take_along_axis(lp, toks[s + 1 : e + 1, None], axis=-1)[:, 0]
        mx.eval(nll)
        out.extend(nll.tolist())
    return out[prefix - 1 :]
