"""Pass-key recall beyond the recent window, scored teacher-forced under simulated eviction.

A prompt (:func:`qfilters_mlx.evaluation.retrieval.retrieval_prompt`: instruction, prose with a
5-digit pass key at a depth, the question, the chat template's assistant turn) is followed by
the answer the model gives with a full cache, ``"The secret pass key is "`` and the key. One
teacher-forced pass scores it (:func:`qfilters_mlx.evaluation.simulate.simulated_predictions`
for an evicting arm, :func:`full_predictions` for the full cache): the key counts as recalled
when, at every one of its tokens, the model ranks that token first given the tokens before it
(what greedy decoding would emit after the same answer prefix). The answer prefix is given, not
generated: a model that would not start its answer that way under eviction is not seen.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.evaluation.retrieval import retrieval_prompt
from qfilters_mlx.filters.needles import NeedlePrompt, needle_sequence

__all__ = ["ANSWER_PREFIX", "NeedlePrompt", "full_predictions", "key_recall", "needle_prompt"]

ANSWER_PREFIX = "The secret pass key is "
"""What SmolLM2-135M-Instruct answers before the key with a full cache (checked on these prompts)."""


def needle_prompt(tokenizer, text: str, context_tokens: int, depth: float, key: str) -> NeedlePrompt:
    """The recall sequence of :func:`~qfilters_mlx.evaluation.retrieval.retrieval_prompt`'s
    prompt (same arguments) followed by :data:`ANSWER_PREFIX` and ``key``.

    Raises:
        ValueError: what ``retrieval_prompt`` raises; the key's tokens are not a suffix of the
            answer's own tokens, or do not occur in the prompt (a tokenizer that merges the key
            with its neighbours).
    """
    prompt = retrieval_prompt(tokenizer, text, context_tokens, depth, key)
    return needle_sequence(tokenizer, prompt, ANSWER_PREFIX, key)


def full_predictions(model, tokens, prefix: int) -> tuple[list[float], list[int]]:
    """``(nll, argmax)`` of ``tokens[prefix:]`` with a full cache, one teacher-forced pass
    (mlx-lm's causal attention, no eviction): as :func:`.simulate.simulated_predictions`.

    Raises:
        ValueError: ``prefix`` outside ``[1, len(tokens) - 1]``.
    """
    if not 1 <= prefix < len(tokens):
        raise ValueError(f"prefix must be in [1, {len(tokens) - 1}], got {prefix}")
    toks = mx.array(tokens)
    lp = model(toks[None, :-1])[0, prefix - 1:].astype(mx.float32)
    nll = mx.logsumexp(lp, axis=-1) - mx.take_along_axis(lp, toks[prefix:, None], axis=-1)[:, 0]
    return nll.tolist(), mx.argmax(lp, axis=-1).tolist()


def key_recall(prompt: NeedlePrompt, nll, argmax, prefix: int) -> tuple[bool, float]:
    """``(recalled, key NLL)``: whether every key token is ranked first, and the key tokens'
    summed NLL (nats), from predictions of ``prompt.tokens[prefix:]``.

    Raises:
        ValueError: the predictions do not cover ``prompt.tokens[prefix:]``.
    """
    n = len(prompt.tokens) - prefix
    if len(nll) != n or len(argmax) != n:
        raise ValueError(f"predictions of {n} tokens needed, got {len(nll)} NLLs and {len(argmax)} argmax")
    idx = [p - prefix for p in prompt.key_positions]
    recalled = all(argmax[i] == prompt.tokens[p] for i, p in zip(idx, prompt.key_positions))
    return recalled, float(sum(nll[i] for i in idx))
