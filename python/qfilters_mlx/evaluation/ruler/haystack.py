"""Haystack material of the RULER tasks: real prose, RULER's noise sentence, word pools.

RULER's "essay" haystack (Paul Graham's essays) is replaced by CPython's reference
documentation (:func:`qfilters_mlx.assets.prompts.source_text`) from the first paragraph
after character :data:`HAYSTACK_OFFSET` to the end of the text. That span is disjoint from
every other use of the text: perplexity and score quality (its first tokens, segment A,
characters below 100,000), segment B (100,000 onward, 40,000 characters), the retrieval
contexts and shipped prompt (200,000 onward, at most ~20,000 characters for a 4k context)
and the calibration text of ``qfilters-mlx calibrate`` (300,000 to 360,000).

Keys are RULER's ``adjective-noun`` words and values its 7-digit numbers or UUIDs; the word
lists are those of the ``wonderwords`` package, as RULER uses them.
"""

from __future__ import annotations

import re
import uuid
from functools import lru_cache

__all__ = ["HAYSTACK_OFFSET", "NOISE", "essay_sentences", "key_words", "random_number", "random_uuid",
           "word_list"]

HAYSTACK_OFFSET = 370_000
"""Character offset of the prose haystack (after the calibration text, see the module doc)."""

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's repeated-sentence ("noise") haystack unit."""


def essay_sentences(text: str) -> list[str]:
    """The sentences of ``text`` from the first paragraph after :data:`HAYSTACK_OFFSET`,
    whitespace collapsed (split after ``.``, ``!`` or ``?`` followed by whitespace).

    Raises:
        ValueError: ``text`` has no paragraph after the offset.
    """
    cut = text.find("\n\n", HAYSTACK_OFFSET)
    if cut < 0:
        raise ValueError(f"the source text has no paragraph after character {HAYSTACK_OFFSET}")
    flat = " ".join(text[cut + 2:].split())
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if s]


@lru_cache(maxsize=None)
def word_list(kind: str) -> tuple[str, ...]:
    """A ``wonderwords`` word list (``"noun"``, ``"adjective"`` or ``"verb"``), as shipped.

    Raises:
        ModuleNotFoundError: ``wonderwords`` is not installed (``pip install qfilters-mlx[eval]``).
    """
    from wonderwords import random_word

    return tuple(random_word._get_words_from_text_file(f"{kind}list.txt"))


def key_words(rng, n: int) -> list[str]:
    """``n`` distinct RULER needle keys ``adjective-noun`` (RULER draws from every such pair;
    here the adjective and the noun are drawn independently, the same distribution without
    materialising the ~9 million pairs)."""
    adjs, nouns = word_list("adjective"), word_list("noun")
    out: list[str] = []
    while len(out) < n:
        k = f"{rng.choice(adjs)}-{rng.choice(nouns)}"
        if k not in out:
            out.append(k)
    return out


def random_number(rng, digits: int = 7) -> str:
    """A ``digits``-digit number (RULER's needle value)."""
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def random_uuid(rng) -> str:
    """A version-4 UUID drawn from ``rng`` (RULER's UUID keys and values)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
