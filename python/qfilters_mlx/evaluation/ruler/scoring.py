"""RULER's metric for its synthetic tasks (``scripts/eval/synthetic/constants.py``).

``string_match_all``: per sample, the share of expected strings that occur in the
prediction (both lower-cased), averaged over samples, times 100. Predictions are first
cleaned as RULER's ``postprocess_pred`` does: control characters replaced by a newline,
then stripped.
"""

from __future__ import annotations

import re

__all__ = ["postprocess", "sample_score", "string_match_all"]

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's ``postprocess_pred``: control characters become ``"\\n"``, then ``strip()``."""
    return _CONTROL.sub("\n", pred).strip()


def sample_score(pred: str, refs) -> float:
    """Share (0 to 1) of ``refs`` found case-insensitively in ``pred``.

    Raises:
        ValueError: ``refs`` is empty.
    """
    refs = list(refs)
    if not refs:
        raise ValueError("a sample needs at least one expected string")
    p = postprocess(pred).lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_all(preds, refs) -> float:
    """``100 * mean over samples of sample_score`` (RULER's ``string_match_all``).

    Raises:
        ValueError: no samples, or ``preds`` and ``refs`` differ in length.
    """
    preds, refs = list(preds), list(refs)
    if not preds or len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} reference lists")
    return 100.0 * sum(sample_score(p, r) for p, r in zip(preds, refs)) / len(preds)
