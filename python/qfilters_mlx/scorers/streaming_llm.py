"""StreamingLLM (Xiao et al. 2023): keep the ``n_sink`` first positions and the last
``budget - n_sink``; no score (mlx-lm's ``RotatingKVCache`` keeps the same set)."""

from __future__ import annotations

from qfilters_mlx.scorers.base import Scorer
from qfilters_mlx.scorers.registry import register

__all__ = ["StreamingLLMScorer"]


@register
class StreamingLLMScorer(Scorer):
    """Sinks + recent window, by position only."""

    name = "streaming_llm"
    ranks = False
