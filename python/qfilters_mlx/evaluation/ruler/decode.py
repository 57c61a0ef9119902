"""Greedy decoding of RULER rows with the model's body and head split (:mod:`.forced`).

:func:`greedy` / :func:`greedy_from`: every row of a batch one token per call, until each has
ended. :func:`lookup_greedy`: one row, with drafted tokens verified in one call (prompt-lookup
decoding: the tokens that followed the last occurrence of the answer's latest n-gram in the
prompt or the answer are drafted, and accepted while each equals the argmax of its position), so
a needle copied from the context or a repeated line costs one call instead of one per token. Its
answer is greedy decoding's: a drafted token is kept only where it is the argmax (up to the
rounding of the verifying call's shapes, as between chunked and whole prefills).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from qfilters_mlx.evaluation.ruler.forced import ForwardSplit

__all__ = ["draft", "greedy", "greedy_from", "lookup_greedy"]


def greedy(split: ForwardSplit, caches, tokens: list[int], rows: int, max_tokens: int, eos: set[int],
           finished: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """Feed ``tokens`` to every row in one call (the LM head on its last position only), then
    :func:`greedy_from`."""
    x = mx.broadcast_to(mx.array(tokens)[None], (rows, len(tokens)))
    logits = split.head(split.body(x, cache=caches)[:, -1:])[:, -1]
    return greedy_from(split, caches, logits, max_tokens, eos, finished)


def greedy_from(split: ForwardSplit, caches, logits: mx.array, max_tokens: int, eos: set[int],
                finished: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """Up to ``max_tokens`` greedy tokens per row, the first the argmax of ``logits`` ``[R, vocab]``,
    each next one fed through ``caches``, stopping when every row has produced a token of ``eos``
    or is ``finished(ids)`` (e.g. every expected string already written: its score cannot change).
    Returns per row the ids before its first ``eos`` token (up to where it finished)."""
    rows = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(max_tokens):
        nxt = mx.argmax(logits, axis=-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                done[i] = t in eos
                if not done[i]:
                    out[i].append(t)
                    done[i] = finished is not None and finished(out[i])
        if all(done) or step + 1 == max_tokens:
            break
        logits = split.head(split.body(nxt[:, None], cache=caches))[:, -1]
    return out


def draft(seq: list[int], k: int, ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of ``seq``'s last ``n``
    tokens, for the largest ``n <= ngram`` that occurs; ``[]`` when none does (or ``k < 1``)."""
    if k < 1:
        return []
    L = len(seq)
    for n in range(min(ngram, L - 1), 0, -1):
        tail = seq[L - n:]
        for j in range(L - n - 1, -1, -1):
            if seq[j:j + n] == tail:
                return seq[j + n:j + n + k]
    return []


def lookup_greedy(split: ForwardSplit, cache: list, prompt: list[int], tokens: list[int], max_tokens: int,
                  eos: set[int], finished: Callable[[list[int]], bool] | None = None, k: int = 8,
                  ngram: int = 3) -> list[int]:
    """Greedy answer of one row whose ``cache`` (mlx-lm ``KVCache`` per layer, trimmable) holds
    everything before ``tokens``: feed ``tokens``, then decode with drafts (:func:`draft` over
    ``prompt + tokens + answer``) of up to ``k`` tokens, trimming the rejected ones from the cache.

    Returns the ids before the first ``eos`` token, at most ``max_tokens``, stopping once
    ``finished(ids)``.
    """
    h = split.body(mx.array(tokens)[None], cache=cache)[:, -1:]
    nxt = int(mx.argmax(split.head(h)[0, -1]).item())
    history = list(prompt) + list(tokens)
    out: list[int] = []
    while True:
        if nxt in eos:
            return out
        out.append(nxt)
        if len(out) == max_tokens or (finished is not None and finished(out)):
            return out
        d = draft(history + out, min(k, max_tokens - len(out)), ngram)
        logits = split.head(split.body(mx.array([nxt] + d)[None], cache=cache))[0]
        am = mx.argmax(logits, axis=-1).tolist()  # am[i]: the argmax after [nxt] + d[:i]
        acc = 0
        while acc < len(d) and d[acc] == am[acc]:
            acc += 1
        for tok in d[:acc]:
            if tok in eos:
                return out
            out.append(tok)
            if len(out) == max_tokens or (finished is not None and finished(out)):
                return out
        if len(d) > acc:
            for c in cache:
                c.trim(len(d) - acc)
        nxt = am[acc]
