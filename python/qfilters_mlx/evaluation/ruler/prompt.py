"""A sample's tokens as kvpress feeds them, and the haystack size that fits a context length.

kvpress's ``KVPressTextGenerationPipeline.preprocess``: the chat template is applied to
``context + separator`` (one user message, generation prompt added) and cut at the
separator; the question is ``question + the template's suffix + answer_prefix``. The
context tokens are compressed, the question's are not.
"""

from __future__ import annotations

from typing import Callable

from qfilters_mlx.evaluation.ruler.tasks import Sample, TooFewUnits

__all__ = ["DoesNotFit", "fit", "sample_tokens"]


class DoesNotFit(ValueError):
    """A sample's smallest haystack (with its question and answer tokens) exceeds the length."""


def sample_tokens(tokenizer, sample: Sample) -> tuple[list[int], list[int]]:
    """``(context tokens, question tokens)`` of ``sample`` (kvpress's split; see module doc).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "has_chat_template", True) or getattr(tokenizer, "chat_template", "") is None:
        raise ValueError("RULER prompts use the model's chat template; this tokenizer has none")
    separator = "\n" + "#" * len(sample.context)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": sample.context + separator}],
                                         tokenize=False, add_generation_prompt=True)
    context, suffix = chat.split(separator)
    question = sample.question + suffix + sample.answer_prefix
    return (tokenizer.encode(context, add_special_tokens=False),
            tokenizer.encode(question, add_special_tokens=False))


def fit(build: Callable[[int], Sample], tokenizer, length: int) -> tuple[Sample, int]:
    """The sample with the most haystack units ``n`` whose context + question tokens plus its
    ``max_new_tokens`` fit in ``length`` (RULER's rule), and that ``n``.

    ``build(n)`` must be deterministic; the search assumes the token count grows with ``n``
    (doubling, then bisection).

    Raises:
        DoesNotFit: not even the smallest haystack fits (a ``ValueError``).
    """
    def tokens(n: int) -> tuple[Sample, int]:
        s = build(n)
        c, q = sample_tokens(tokenizer, s)
        return s, len(c) + len(q) + s.max_new_tokens

    lo = 0
    while True:  # the smallest size (a power of two) at which the task has its answer
        try:
            s0, t0 = tokens(lo)
            break
        except TooFewUnits:
            lo = max(1, 2 * lo)
    if t0 > length:
        raise DoesNotFit(f"{s0.task}: {t0} tokens with the smallest haystack ({lo} units) exceed the "
                         f"length {length}")
    hi = max(1, 2 * lo)
    while tokens(hi)[1] <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens(mid)[1] <= length:
            lo = mid
        else:
            hi = mid
    return build(lo), lo
