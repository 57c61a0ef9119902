"""Needle prompts: a key hidden at a depth of prose, a question, and the answer that copies it.

:func:`needle_body` places a needle sentence among whole paragraphs of a text;
:func:`needle_sequence` appends an answer prefix and the key to a prompt's tokens and finds
where the key's tokens sit in the prompt and in the answer (:class:`NeedlePrompt`). The
evaluation's pass-key prompts (:mod:`qfilters_mlx.evaluation.retrieval`,
:mod:`qfilters_mlx.evaluation.recall`) and the calibration prompts of the retrieval-head ranking
(:mod:`qfilters_mlx.filters.head_ranking`) are both built from these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["NeedlePrompt", "find_run", "needle_body", "needle_sequence"]


@dataclass(frozen=True)
class NeedlePrompt:
    """One teacher-forced recall sequence.

    Attributes:
        tokens: prompt, answer prefix and key token ids (1-D).
        prompt_tokens: tokens of the prompt (through the assistant turn's start).
        key: the key (the text the answer ends with).
        key_positions: indices in ``tokens`` of the key's tokens in the answer.
        needle_position: index in ``tokens`` of the key's first token in the prompt (the needle).
    """

    tokens: list
    prompt_tokens: int
    key: str
    key_positions: list
    needle_position: int

    @property
    def distance(self) -> int:
        """Tokens from the needle's key to the end of the prompt."""
        return self.prompt_tokens - self.needle_position


def find_run(seq: list, sub: list) -> int:
    """Index of the first occurrence of ``sub`` as a contiguous run of ``seq``, else ``-1``."""
    for i in range(len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


def needle_body(tokenizer, text: str, context_tokens: int, depth: float, needle: str) -> list[str]:
    """Whole paragraphs of ``text`` (blank-line separated), about ``context_tokens`` tokens from
    its start, with ``needle`` inserted as its own paragraph at the paragraph boundary nearest
    relative ``depth``.

    Raises:
        ValueError: ``depth`` outside ``[0, 1]``, or ``text`` too short.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    picked, counts, n = [], [], 0
    for p in paragraphs:
        if n >= context_tokens:
            break
        picked.append(p)
        counts.append(len(tokenizer.encode(p, add_special_tokens=False)) + 1)
        n += counts[-1]
    if n < context_tokens:
        raise ValueError(f"text too short for {context_tokens} context tokens")
    cut = int(np.searchsorted(np.cumsum(counts), depth * n)) + (0 if depth == 0 else 1)
    cut = min(cut, len(picked))
    return picked[:cut] + [needle] + picked[cut:]


def needle_sequence(tokenizer, prompt: list[int], answer_prefix: str, key: str) -> NeedlePrompt:
    """``prompt`` followed by the tokens of ``answer_prefix + key``.

    The key's tokens are the shortest run at the end of the answer that decodes to ``key``
    (leading white space left out: a word key is one token with its space); the needle is
    their first occurrence in ``prompt``.

    Raises:
        ValueError: the key is no run of whole tokens at the end of the answer, or its tokens do
            not occur in the prompt (a tokenizer that merges the key with its neighbours).
    """
    answer = tokenizer.encode(answer_prefix + key, add_special_tokens=False)
    n = next((n for n in range(1, len(answer) + 1) if tokenizer.decode(answer[-n:]).strip() == key), None)
    if n is None:
        raise ValueError(f"the key {key!r} is no run of whole tokens at the end of the answer {answer}")
    key_ids = answer[-n:]
    at = find_run(prompt, key_ids)
    if at < 0:
        raise ValueError(f"the key's tokens {key_ids} do not occur in the prompt")
    tokens = list(prompt) + answer
    return NeedlePrompt(tokens, len(prompt), key, list(range(len(tokens) - n, len(tokens))), at)
