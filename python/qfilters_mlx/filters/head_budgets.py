"""Budgets per KV head from a retrieval-head ranking, at the bytes of one budget everywhere.

The rule (:func:`head_budgets`), for a ranking ``[L, H]`` (L budgeted layers, H KV heads each,
:func:`qfilters_mlx.filters.head_ranking.rank_heads`), a budget ``B`` per head, ``S`` sinks,
``k`` big heads and a multiple ``m``:

1. the total is ``T = L * H * B`` tokens, what one budget everywhere holds;
2. the big heads are the ``k`` heads ranked highest (ties: lower layer, then lower head first);
3. each big head gets ``m * B`` tokens;
4. every other head gets ``b = floor((T - k * m * B) / (L * H - k))`` tokens. The
   ``T - k * m * B - (L * H - k) * b`` tokens left over (fewer than ``L * H - k``) are not used:
   the sum of the budgets is at most ``T``, and a layer holds at most two budgets (``m * B`` and
   ``b``), so a head-group cache stores at most two groups per layer;
5. every head, big or not, gets the recent window of the other heads' budget,
   ``default_recent(b, S)`` (:func:`qfilters_mlx.config.defaults.default_recent`: half of ``b``,
   at most ``b - S - 1``). A big head thus keeps ``S`` sinks, that window, and
   ``m * B - S - default_recent(b, S)`` tokens chosen by the cache's score (the filter), not a
   window ``m`` times as long: a key further back than any window can be kept.

``k = 0`` or ``m = 1`` gives every head ``B`` tokens and ``default_recent(B, S)`` recent (what one
budget per layer holds). The rule refuses (``ValueError``) a ``k`` or ``m`` that leaves the other
heads ``b <= S`` tokens.

Defaults :data:`DEFAULT_BIG_HEADS` and :data:`DEFAULT_MULTIPLE` are the simulator's
``heads-needle-4x8q`` arm's, not picked on calibration text: the calibration-only rule of
docs/head-groups.md ("The constants") gives no value that fits at ``m = 4`` on SmolLM2-135M
(``bench/results/head_rule.md``).
"""

from __future__ import annotations

import numbers

import numpy as np

from qfilters_mlx.config.defaults import default_recent
from qfilters_mlx.config.heads import HeadBudgets

__all__ = ["DEFAULT_BIG_HEADS", "DEFAULT_MULTIPLE", "big_heads", "head_budgets"]

DEFAULT_BIG_HEADS = 8
"""Big heads of the whole model (rule step 2); the simulator's ``heads-needle-4x8q``."""

DEFAULT_MULTIPLE = 4
"""Budget of a big head as a multiple of the one-budget budget (rule step 3); the simulator's
``heads-needle-4x8q``."""


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"head_budgets: {name} must be an int >= {low}, got {value!r}")
    return int(value)


def big_heads(ranking, k: int) -> list[tuple[int, int]]:
    """The ``k`` ``(layer, head)`` pairs ``ranking [L, H]`` ranks highest, best first (ties:
    lower layer, then lower head first)."""
    r = np.asarray(ranking, dtype=np.float64)
    order = np.argsort(-r, axis=None, kind="stable")[:k]
    return [tuple(int(x) for x in divmod(int(i), r.shape[1])) for i in order]


def head_budgets(ranking, budget: int, n_sink: int, n_big: int = DEFAULT_BIG_HEADS,
                 multiple: int = DEFAULT_MULTIPLE) -> HeadBudgets:
    """Budgets and recent windows per layer and KV head by the module's rule.

    Args:
        ranking: ``[n_layers, n_kv_heads]`` array-like of floats, higher = more of a retrieval
            head (:func:`qfilters_mlx.filters.head_ranking.rank_heads`); finite values.
        budget: ``B``, tokens per head of the one-budget cache (sinks and window included).
        n_sink: ``S``, sinks per head.
        n_big: ``k``, big heads in the whole model (``0 <= k < n_layers * n_kv_heads``).
        multiple: ``m``, the big heads' budget over ``B`` (``>= 1``).

    Returns:
        :class:`~qfilters_mlx.config.heads.HeadBudgets` (``total_tokens <= n_layers *
        n_kv_heads * budget``; at most two budgets per layer).

    Raises:
        ValueError: a ranking that is not a finite 2-D table; ``budget``, ``n_sink``, ``n_big``
            or ``multiple`` out of range; the other heads' budget ``b <= n_sink`` (the message
            gives ``b``).
    """
    r = np.asarray(ranking, dtype=np.float64)
    if r.ndim != 2 or r.size == 0 or not np.isfinite(r).all():
        raise ValueError(f"head_budgets: ranking must be a finite [n_layers, n_kv_heads] table, got shape {r.shape}")
    B, S = _int("budget", budget, 1), _int("n_sink", n_sink, 0)
    k, m = _int("n_big", n_big, 0), _int("multiple", multiple, 1)
    L, H = r.shape
    if k >= L * H:
        raise ValueError(f"head_budgets: n_big must be < n_layers * n_kv_heads = {L * H}, got {k}")
    if k == 0 or m == 1:
        small = big = B
    else:
        big, small = m * B, (L * H * B - k * m * B) // (L * H - k)
    if small <= S:
        raise ValueError(f"head_budgets: {k} heads at {m} x {B} leave the other heads {small} tokens, "
                         f"not more than the {S} sinks: fewer big heads or a smaller multiple")
    window = default_recent(small, S)
    table = np.full((L, H), small, dtype=np.int64)
    for lh in big_heads(r, k):
        table[lh] = big
    return HeadBudgets(table.tolist(), [[window] * H for _ in range(L)])
