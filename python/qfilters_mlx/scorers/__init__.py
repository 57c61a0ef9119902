"""Eviction scorers: one small class per method, registered by name.

=============== ============================= ==========================================
method          score at insertion            source
=============== ============================= ==========================================
qfilters        ``sign * <k, u>``             Godey et al. 2025, arXiv:2503.02812
l2norm          ``-||k||_2``                  Devoto et al. 2024 (kvpress KnormPress)
streaming_llm   none (sinks + recent window)  Xiao et al. 2023
random          seeded uniform in ``[0, 1)``  control arm
full            none (never evicts)           baseline
=============== ============================= ==========================================

A new method: subclass :class:`Scorer` (``name``, ``scores``; the traits if they differ) and
:func:`register` it; ``KVCacheConfig(method=name)``, saved caches and ``--method`` then take it.
"""

from __future__ import annotations

from qfilters_mlx.scorers.base import Scorer
from qfilters_mlx.scorers.registry import insertion_scores, register, scorer_class, scorer_names
# (imported in registration order: the order of scorer_names() and of --method's choices)
from qfilters_mlx.scorers.qfilters import QFiltersScorer  # noqa: I001
from qfilters_mlx.scorers.l2norm import L2NormScorer
from qfilters_mlx.scorers.streaming_llm import StreamingLLMScorer
from qfilters_mlx.scorers.seeded_random import RandomScorer, random_scores
from qfilters_mlx.scorers.full import FullScorer

__all__ = ["FullScorer", "L2NormScorer", "QFiltersScorer", "RandomScorer", "Scorer",
           "StreamingLLMScorer", "insertion_scores", "random_scores", "register", "scorer_class",
           "scorer_names"]
