"""Model-level quality measures (no I/O: callers load models and text).

Streaming perplexity: a short prefix is prefilled, then the text is fed one
token at a time (teacher forcing) through the cache, so every scored token is
predicted from the evicted cache exactly as in decoding.
"""

from __future__ import annotations

import math

import mlx.core as mx


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
    toks = mx.array(tokens)
    T = toks.shape[0]
    if not 1 <= prefix < T:
        raise ValueError(f"prefix must be in [1, {T - 1}], got {prefix}")
    logits = model(toks[None, :prefix], cache=caches)[:, -1]
    nll = []
    for t in range(prefix, T):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll.append(-lp[0, toks[t]])
        if t + 1 < T:
            logits = model(toks[None, t : t + 1], cache=caches)[:, -1]
        if len(nll) % 64 == 0:
            mx.eval(nll, logits)
    mx.eval(nll)
    return [x.item() for x in nll]


def perplexity(nll: list[float]) -> float:
    """``exp(mean(nll))``."""
    return math.exp(sum(nll) / len(nll))
