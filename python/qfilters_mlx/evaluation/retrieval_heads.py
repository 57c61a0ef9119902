"""Retrieval heads with their own budgets, for the simulator: which KV heads attend far back
(measured once per model on calibration sequences), and budgets per head at the same total bytes
as one budget everywhere.

Two measures per layer and KV head, from full-cache teacher-forced passes:

* :func:`~qfilters_mlx.filters.head_ranking.needle_attention`: on a pass-key prompt, the
  attention the queries that predict the answer's key tokens give the key's tokens in the prompt
  (the copy a retrieval head does);
* :func:`far_mass`: on plain text, the attention each query gives keys beyond its recent window,
  sinks left out (:func:`.oracle.attention_received`).

:func:`split_budgets` then gives the top heads ``big`` tokens (sinks and a recent window of
``big - n_sink``) and every other head ``small`` (sinks and ``small - n_sink`` recent), with
the tokens left over spread one by one over the small heads, so that the budgets sum to
``n_layers * n_kv_heads * budget``: the bytes a cache storing each head at its own size holds.
"""

from __future__ import annotations

import numpy as np

from qfilters_mlx.evaluation.oracle import attention_received

__all__ = ["far_mass", "split_budgets"]


def far_mass(model, tokens, window: int, n_sink: int) -> np.ndarray:
    """``[n_layers, H_kv]``: the attention weight per query head and query that falls on keys
    beyond ``window`` tokens back, the first ``n_sink`` left out (:func:`attention_received`)."""
    (per_layer,) = attention_received(model, list(tokens), [int(window)])
    H_q = model.args.num_attention_heads
    return np.stack([r[:, n_sink:].sum(axis=1) / (H_q // r.shape[0]) / len(tokens) for r in per_layer])


def split_budgets(ranking: np.ndarray, budget: int, big: int, small: int | None, n_sink: int,
                  heads: int | None = None) -> tuple:
    """``(budgets, recents, heads)``: per layer, a tuple of one budget and one recent window per
    KV head, and the ``(layer, head)`` pairs given ``big``: the most heads ``ranking`` ranks
    highest that fit in ``n_layers * n_kv_heads * budget`` tokens with every other head at
    ``small`` or a token more (module docstring), or the top ``heads`` with every other head
    sharing what is left (``small`` then ``None``).

    Raises:
        ValueError: not ``n_sink < small <= budget < big``.
    """
    L, H = ranking.shape
    total = L * H * budget
    if heads is not None:
        small = (total - heads * big) // (L * H - heads)
    if not n_sink < small <= budget < big:
        raise ValueError(f"need n_sink < small <= budget < big, got {n_sink}, {small}, {budget}, {big}")
    k = heads if heads is not None else (total - L * H * small) // (big - small)
    order = [divmod(int(i), H) for i in np.argsort(-ranking, axis=None, kind="stable")]
    top = set(order[:k])
    b = np.full((L, H), small)
    for lh in top:
        b[lh] = big
    rest = [lh for lh in order if lh not in top]
    for i in range(total - int(b.sum())):
        b[rest[i % len(rest)]] += 1
    budgets = tuple(tuple(int(x) for x in row) for row in b)
    recents = tuple(tuple(int(x) - n_sink for x in row) for row in b)
    return budgets, recents, sorted(top)
