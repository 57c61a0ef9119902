"""The full cache: keeps every token (the baseline every method is compared with)."""

from __future__ import annotations

from qfilters_mlx.scorers.base import Scorer
from qfilters_mlx.scorers.registry import register

__all__ = ["FullScorer"]


@register
class FullScorer(Scorer):
    """Never evicts; every rewind is a plain trim."""

    name = "full"
    ranks = False
    evicts = False
