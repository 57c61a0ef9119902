"""L2 norm of the key (Devoto et al. 2024; kvpress's ``KnormPress``): score ``-||k||_2``,
so keys of small norm, which receive more attention, are kept."""

from __future__ import annotations

from qfilters_mlx.backends import reference
from qfilters_mlx.scorers.base import Scorer
from qfilters_mlx.scorers.registry import register

__all__ = ["L2NormScorer"]


@register
class L2NormScorer(Scorer):
    """``-||k||_2`` in float32 (:func:`qfilters_mlx.backends.reference.l2norm_scores`)."""

    name = "l2norm"

    def scores(self, keys, positions, filters=None, backend=None):
        return reference.l2norm_scores(keys)
