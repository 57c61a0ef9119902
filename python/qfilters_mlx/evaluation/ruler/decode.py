"""Greedy decoding of RULER rows with the model's body and head split (:mod:`.forced`):
every row of a batch one token per call, until each has ended.

(Prompt-lookup decoding, drafts verified several tokens per call, was measured slower on a 2-core
CPU: a call of 9 tokens over a 2k cache costs 4.5 to 7.7 times a call of one, more than the
drafts it accepted on RULER answers saved.)
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from qfilters_mlx.evaluation.ruler.forced import ForwardSplit

__all__ = ["greedy", "greedy_from"]


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
