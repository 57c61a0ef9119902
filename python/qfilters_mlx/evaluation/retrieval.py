"""Pass-key retrieval: a key hidden at a depth of a long context, a question, a greedy answer.

:func:`retrieval_prompt` builds the chat-template prompt (instruction, about
``context_tokens`` tokens of prose in whole paragraphs, the needle at a
paragraph boundary, the question); :func:`batched_greedy` answers it with many
arms at once (one batch row each, chunked prefill as in mlx-lm). The instruction
and the question are those of the shipped prompt (:mod:`qfilters_mlx.assets.prompts`).
"""

from __future__ import annotations

import random
from typing import Callable

import mlx.core as mx

from qfilters_mlx.assets.prompts import INSTRUCTION, QUESTION
from qfilters_mlx.evaluation.multi_arm import batch_caches
from qfilters_mlx.filters.needles import needle_body
from qfilters_mlx.filters.observe import observe_queries

__all__ = ["NEEDLE", "batched_greedy", "greedy_tokens", "pass_key", "retrieval_chat", "retrieval_prompt"]

NEEDLE = "The secret pass key is {key}. Remember it."


def pass_key(seed: int, context: int, depth: float) -> str:
    """A 5-digit pass key, a pure function of ``(seed, context, depth)``."""
    return str(random.Random(f"{seed}-{context}-{depth}").randint(10000, 99999))


def retrieval_prompt(tokenizer, text: str, context_tokens: int, depth: float, key: str) -> list[int]:
    """Tokens of :func:`retrieval_chat` (the chat-template prompt)."""
    chat = retrieval_chat(tokenizer, text, context_tokens, depth, key)
    return tokenizer.encode(chat, add_special_tokens=False)


def retrieval_chat(tokenizer, text: str, context_tokens: int, depth: float, key: str) -> str:
    """Chat-template text of: instruction, about ``context_tokens`` tokens of
    ``text`` (whole paragraphs), the needle at relative ``depth`` (a paragraph
    boundary), the question.

    Args:
        tokenizer: an mlx-lm ``TokenizerWrapper`` with a chat template.
        text: source prose, paragraphs separated by blank lines.
        context_tokens: target length of the context part in tokens.
        depth: needle position as a fraction of the context, in ``[0, 1]``.
        key: the pass key.

    Raises:
        ValueError: ``depth`` outside ``[0, 1]`` or ``text`` too short.
    """
    body = needle_body(tokenizer, text, context_tokens, depth, NEEDLE.format(key=key))
    message = "\n\n".join([INSTRUCTION, *body, f"Question: {QUESTION}"])
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def batched_greedy(model, prompt: list[int], rows: list[list], max_tokens: int, chunk: int,
                   on_call: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy answers of every row to the same prompt.

    The prompt is fed in calls of ``chunk`` tokens (each row's cache evicts
    after every call, as in chunked prefill), then each row decodes its own
    greedy tokens.

    Returns:
        Per row, ``max_tokens`` token ids.
    """
    B = len(rows)
    caches = batch_caches(rows)
    toks = mx.broadcast_to(mx.array(prompt)[None], (B, len(prompt)))
    logits = None
    with observe_queries(model, caches):  # for query-based filters
        for s in range(0, len(prompt), chunk):
            logits = model(toks[:, s : s + chunk], cache=caches)[:, -1]
            mx.eval(logits)
            if on_call is not None:
                on_call(1)
        return greedy_tokens(model, caches, logits, max_tokens)


def greedy_tokens(model, caches, logits: mx.array, max_tokens: int) -> list[list[int]]:
    """``max_tokens`` greedy token ids per row, the first the argmax of ``logits``
    ``[B, vocab]`` (the last fed position's), each next one fed through ``caches``."""
    out = []
    for i in range(max_tokens):
        nxt = mx.argmax(logits, axis=-1)
        out.append(nxt)
        if i + 1 < max_tokens:
            logits = model(nxt[:, None], cache=caches)[:, -1]
            mx.eval(logits)
    return mx.stack(out, axis=1).tolist()
