"""Q-Filters (Godey et al. 2025, arXiv:2503.02812): score ``sign * <k, u>`` with ``u`` the
layer's Q-Filter of the key's KV head, float32.

The filter comes from the model's calibration text (the default), from the first queries or
keys the cache sees, or from a file; the cache hands it over as ``filters`` ``[H_kv, D]``.
A decode step scores and picks the next slot in one backend operation
(``decode_select_keys``: one primitive in the cpp backend).
"""

from __future__ import annotations

from qfilters_mlx.backends import reference
from qfilters_mlx.scorers.base import Scorer
from qfilters_mlx.scorers.registry import register

__all__ = ["QFiltersScorer"]


@register
class QFiltersScorer(Scorer):
    """``sign * <k, u>`` (:func:`qfilters_mlx.backends.reference.projection_scores`)."""

    name = "qfilters"
    uses_filter = True

    def scores(self, keys, positions, filters=None, backend=None):
        fn = reference.projection_scores if backend is None else backend.projection_scores
        return fn(keys, filters, self.sign)

    def decode_select(self, backend, scores, positions, keys, filters, free, position, n_sink, recent):
        return backend.decode_select_keys(scores, positions, keys, filters, free, position,
                                          self.sign, n_sink, recent)
