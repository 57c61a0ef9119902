"""The shipped long prompt: real English prose with a pass key to retrieve.

Source text: CPython's own reference documentation, which every CPython
installation ships as prose in ``pydoc_data/topics.py`` (the text behind
``help("topic")``; PSF documentation licence, the same text as
docs.python.org's Language Reference). :func:`source_text` joins the string
values of its ``topics`` dict in sorted key order with blank lines (docs/testing.md,
"Real inputs"); nothing is copied into this repository.

The first 2,048 SmolLM2 tokens of that joined text (about 8,000 characters)
are reserved for perplexity evaluation. The prompt is taken from a disjoint,
later span: it starts at the first paragraph that begins at or after
character :data:`SOURCE_OFFSET` (200,000) and is about :data:`SPAN_CHARS`
characters long (about 2,400 SmolLM2 tokens with the framing below; the exact
count depends on the Python version, whose documentation differs slightly).

:data:`PASS_KEY_SENTENCE` is inserted as its own paragraph at the paragraph
boundary nearest :data:`PASS_KEY_DEPTH` of the span, and the prompt ends with
:data:`QUESTION`. Pure function of the running Python: same Python, same
prompt.
"""

from __future__ import annotations

__all__ = [
    "PASS_KEY",
    "PASS_KEY_DEPTH",
    "PASS_KEY_SENTENCE",
    "QUESTION",
    "SOURCE_OFFSET",
    "SPAN_CHARS",
    "answer_has_pass_key",
    "long_prompt",
    "source_text",
]

PASS_KEY = "48213"
"""The fact to retrieve (a string: it is compared with generated text)."""


def answer_has_pass_key(answer: str) -> bool:
    """Whether a generated answer to :func:`long_prompt` contains :data:`PASS_KEY`
    (the evaluation's rule: the key appears in the answer, digits not split)."""
    return PASS_KEY in answer


PASS_KEY_SENTENCE = f"The secret pass key is {PASS_KEY}. Remember it."
QUESTION = "What is the secret pass key?"
INSTRUCTION = (
    "Below is an excerpt from the Python language reference. "
    "A secret pass key is hidden somewhere in it. "
    "Read it carefully and answer the question at the end."
)

SOURCE_OFFSET = 200_000
"""Character offset the prompt span starts after (well past the evaluation tokens)."""

SPAN_CHARS = 9_000
"""Approximate length of the span in characters (cut at a paragraph boundary)."""

PASS_KEY_DEPTH = 0.5
"""Relative position of the pass key sentence inside the span."""

_PARAGRAPH = "\n\n"


def source_text() -> str:
    """CPython's reference documentation as one string.

    The values of ``pydoc_data.topics.topics`` in sorted key order, joined with
    ``"\\n\\n"``.

    Raises:
        RuntimeError: this Python has no ``pydoc_data`` (some distributions
            split it into a separate package).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as err:
        raise RuntimeError(
            "the shipped prompt is built from CPython's pydoc_data.topics module, "
            "which this Python does not have (some distributions package it "
            "separately, e.g. as part of the python3 documentation or "
            "'libpython3-stdlib'); pass your own prompt with --prompt or --prompt-file"
        ) from err
    return _PARAGRAPH.join(topics[key] for key in sorted(topics))


def _paragraph_start(text: str, at: int) -> int:
    """Index of the first paragraph at or after ``at`` that starts with a letter."""
    i = at
    while True:
        i = text.find(_PARAGRAPH, i)
        if i < 0:
            raise ValueError(f"no paragraph starts after character {at}")
        j = i + len(_PARAGRAPH)
        if j < len(text) and text[j].isalpha():
            return j
        i = j


def _paragraph_end(text: str, at: int) -> int:
    """End of the paragraph that contains position ``at``."""
    i = text.find(_PARAGRAPH, at)
    return len(text) if i < 0 else i


def long_prompt(
    offset: int = SOURCE_OFFSET,
    n_chars: int = SPAN_CHARS,
    depth: float = PASS_KEY_DEPTH,
) -> str:
    """The long pass-key retrieval prompt (a user message, no chat template).

    Layout: an instruction, the documentation span with
    :data:`PASS_KEY_SENTENCE` inserted as a paragraph at ``depth``, then
    ``"Question: " + QUESTION``.

    Args:
        offset: character offset into :func:`source_text`; the span begins at
            the next paragraph that starts with a letter.
        n_chars: approximate span length; the span ends at the end of the
            paragraph containing ``start + n_chars``.
        depth: where the pass key goes, as a fraction of the span in
            ``[0, 1]``; it is placed at the nearest following paragraph break.

    Raises:
        ValueError: ``offset``/``n_chars``/``depth`` out of range.
        RuntimeError: ``pydoc_data`` is missing (see :func:`source_text`).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if n_chars < 1:
        raise ValueError(f"n_chars must be >= 1, got {n_chars}")
    text = source_text()
    if not 0 <= offset < len(text):
        raise ValueError(f"offset must be in [0, {len(text)}), got {offset}")
    start = _paragraph_start(text, offset)
    span = text[start:_paragraph_end(text, start + n_chars)].strip()
    cut = _paragraph_end(span, int(len(span) * depth))
    before, after = span[:cut].rstrip(), span[cut:].lstrip()
    parts = [INSTRUCTION, before, PASS_KEY_SENTENCE, after, f"Question: {QUESTION}"]
    return _PARAGRAPH.join(p for p in parts if p)


CALIBRATION_OFFSET = 300_000
"""Character offset of the default calibration text: after the evaluation text (the
start of :func:`source_text`) and the shipped prompt (``SOURCE_OFFSET`` onward,
``SPAN_CHARS`` long), so the three never overlap."""

CALIBRATION_CHARS = 60_000


def calibration_text() -> tuple[str, str]:
    """Default text for ``qfilters-mlx calibrate`` and its description.

    Returns:
        ``(text, source)``: ``CALIBRATION_CHARS`` characters of :func:`source_text`
        from the first paragraph after ``CALIBRATION_OFFSET`` (about 13k tokens).
    """
    assert CALIBRATION_OFFSET > SOURCE_OFFSET + 2 * SPAN_CHARS
    text = source_text()
    start = _paragraph_start(text, CALIBRATION_OFFSET)
    return (text[start:start + CALIBRATION_CHARS],
            f"pydoc_data.topics (sorted, joined) chars {start}..{start + CALIBRATION_CHARS}")
