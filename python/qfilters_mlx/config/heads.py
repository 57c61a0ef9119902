"""Per-head budgets: KV heads of a layer split into groups, each stored at its own size.

A :class:`HeadBudgets` gives every budgeted layer and KV head a budget and a recent window
(tokens). Heads of a layer with the same budget form one group (:meth:`HeadBudgets.groups`);
``KVCacheBuilder.for_model(..., heads=...)`` builds one cache per group
(:class:`qfilters_mlx.cache.head_groups.HeadGroupsKVCache`), so the tokens held are the sum of
the per-head budgets. The layout is DuoAttention's (Xiao et al., arXiv:2410.10819): groups
hold disjoint heads, attention runs once per group and the outputs go back in head order.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = ["HeadBudgets", "HeadGroup"]


@dataclass(frozen=True)
class HeadGroup:
    """One group of a layer: its KV heads (ascending), their budget and recent windows."""

    heads: tuple[int, ...]
    budget: int
    recent: tuple[int, ...]


def _table(name: str, value) -> tuple:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(f"HeadBudgets.{name} must be a non-empty [n_layers][n_kv_heads] table, "
                        f"got {value!r}")
    rows = []
    for i, row in enumerate(value):
        if hasattr(row, "tolist"):
            row = row.tolist()
        if not isinstance(row, (list, tuple)) or not row:
            raise TypeError(f"HeadBudgets.{name}[{i}] must be a non-empty row of ints, got {row!r}")
        for v in row:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"HeadBudgets.{name}[{i}]: values must be ints, got {v!r}")
        rows.append(tuple(int(v) for v in row))
    return tuple(rows)


@dataclass(frozen=True)
class HeadBudgets:
    """Budget and recent window of every budgeted layer and KV head.

    Attributes:
        budgets: ``[n_layers][n_kv_heads]`` tokens kept per head (sinks and recent window
            included), one row per budgeted layer in the builder's order.
        recents: ``[n_layers][n_kv_heads]`` recent window of each head
            (``0 <= recent <= budget - n_sink`` is checked against the configuration's
            ``n_sink`` by :meth:`check`).

    Raises:
        TypeError: a table that is not nested ints.
        ValueError: the tables differ in shape; a budget below 1.
    """

    budgets: tuple
    recents: tuple

    def __post_init__(self):
        b, r = _table("budgets", self.budgets), _table("recents", self.recents)
        if [len(x) for x in b] != [len(x) for x in r]:
            raise ValueError("HeadBudgets: budgets and recents must have the same [n_layers][n_kv_heads] shape")
        for i, row in enumerate(b):
            if min(row) < 1:
                raise ValueError(f"HeadBudgets.budgets[{i}]: budgets must be >= 1, got {row}")
        object.__setattr__(self, "budgets", b)
        object.__setattr__(self, "recents", r)

    @classmethod
    def uniform(cls, n_layers: int, n_kv_heads: int, budget: int, recent: int) -> HeadBudgets:
        """Every head at ``budget`` with window ``recent`` (what one budget per layer holds)."""
        return cls(((budget,) * n_kv_heads,) * n_layers, ((recent,) * n_kv_heads,) * n_layers)

    @property
    def n_layers(self) -> int:
        return len(self.budgets)

    @property
    def total_tokens(self) -> int:
        """Tokens held per batch row over all layers and heads: the sum of the budgets."""
        return sum(sum(row) for row in self.budgets)

    def heads_slice(self, start: int, count: int) -> HeadBudgets:
        """KV heads ``start .. start + count - 1`` of every layer (a tensor-parallel rank's heads,
        :func:`qfilters_mlx.sharding.head_range`).

        Raises:
            ValueError: the range is empty or not inside every layer's heads.
        """
        if count < 1 or start < 0 or any(start + count > len(row) for row in self.budgets):
            raise ValueError(f"HeadBudgets: heads {start}..{start + count - 1} are not inside every layer's "
                             f"{sorted({len(row) for row in self.budgets})} heads")
        return HeadBudgets(tuple(row[start:start + count] for row in self.budgets),
                           tuple(row[start:start + count] for row in self.recents))

    def groups(self, layer: int) -> tuple[HeadGroup, ...]:
        """Layer ``layer``'s groups: heads of equal budget, in order of their first head."""
        budgets, recents = self.budgets[layer], self.recents[layer]
        out: dict[int, list[int]] = {}
        for h, b in enumerate(budgets):
            out.setdefault(b, []).append(h)
        return tuple(HeadGroup(tuple(hs), b, tuple(recents[h] for h in hs)) for b, hs in out.items())

    def check(self, n_layers: int, n_kv_heads: list[int], n_sink: int) -> None:
        """Raise ``ValueError`` unless the tables fit ``n_layers`` budgeted layers of
        ``n_kv_heads[i]`` heads and every head has ``n_sink < budget`` and
        ``0 <= recent <= budget - n_sink`` (the message names layer and head)."""
        if self.n_layers != n_layers:
            raise ValueError(f"HeadBudgets has {self.n_layers} layers, the model {n_layers} budgeted layers")
        for i, (b, r) in enumerate(zip(self.budgets, self.recents)):
            if len(b) != n_kv_heads[i]:
                raise ValueError(f"HeadBudgets layer {i}: {len(b)} heads, the model's layer has {n_kv_heads[i]}")
            for h, (bh, rh) in enumerate(zip(b, r)):
                if not n_sink < bh or not 0 <= rh <= bh - n_sink:
                    raise ValueError(f"HeadBudgets layer {i} head {h}: need n_sink ({n_sink}) < budget "
                                     f"({bh}) and 0 <= recent ({rh}) <= budget - n_sink")
