"""The method's choices and defaults, one set for the library and ``qfilters-mlx generate``
(``tests/commands/test_cli.py`` states them). Why each default: docs/configuration.md ("Fields"), from
the measurements in bench/results/eval_smollm2.md."""

from __future__ import annotations

from qfilters_mlx.scorers import scorer_names

METHODS = scorer_names()
"""The built-in eviction methods (docs/configuration.md, "Eviction methods"); a scorer
registered later (:func:`qfilters_mlx.scorers.register`) is a valid ``method`` too."""

FILTER_SOURCES = ("calibrated", "queries", "keys")
"""Where the Q-Filter comes from: ``"calibrated"`` (the paper's offline query estimator, found
or made once per model by ``KVCacheBuilder.for_model``: :mod:`qfilters_mlx.filters.default_filters`),
or estimated online inside the cache: ``"queries"`` (the paper's query-SVD of the first
``calib_tokens`` queries; needs ``observe_queries``) or ``"keys"`` (key-SVD)."""

DEFAULT_METHOD = "qfilters"
DEFAULT_BUDGET = 256
"""Tokens kept per layer and KV head."""
DEFAULT_N_SINK = 4
DEFAULT_CALIB_TOKENS = 128
DEFAULT_RECENT_FRACTION = 0.5
"""The recent window as a fraction of the budget (see :func:`default_recent`)."""
DEFAULT_FILTER_SOURCE = "calibrated"
DEFAULT_SIGN = 1
"""Sign of the query filters' score: their orientation as estimated (fixed by the queries)."""
DEFAULT_KEY_SIGN = -1
"""Sign of the key-SVD filter's score (``qfilters_filter_source="keys"``)."""
DEFAULT_SEED = 0


def default_sign(filter_source: str) -> int:
    """The sign ``qfilters_sign=None`` resolves to: :data:`DEFAULT_KEY_SIGN` for the key-SVD
    filter, :data:`DEFAULT_SIGN` for the query filters."""
    return DEFAULT_KEY_SIGN if filter_source == "keys" else DEFAULT_SIGN


def default_recent(budget: int, n_sink: int) -> int:
    """The default recent window of the streaming mode: ``floor(budget * DEFAULT_RECENT_FRACTION)``,
    capped at ``budget - n_sink - 1`` so that at least one slot is left for scored tokens
    (never < 0). ``KVCacheConfig(qfilters_recent=None)`` (the default) and ``qfilters-mlx
    generate`` without ``--recent`` both use it."""
    return max(0, min(int(budget * DEFAULT_RECENT_FRACTION), budget - n_sink - 1))
