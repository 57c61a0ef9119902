"""Tensor-parallel models (``mlx.distributed``): which KV heads a rank holds, and its filters.

mlx-lm shards a model over the ranks that ``mlx.launch`` starts with
``model.shard(group)`` (``mlx_lm.utils.sharded_load``): every attention layer's
``q/k/v_proj`` become ``mlx.nn.AllToShardedLinear`` (output rows split into
``group.size()`` equal, contiguous parts, rank ``r`` keeping part ``r``) and
``o_proj`` a ``ShardedToAllLinear``; the attention module's ``n_kv_heads`` is
divided by the group size. With ``k_proj`` rows ordered head by head
(``[n_kv_heads * head_dim, hidden]``), rank ``r`` of ``N`` therefore holds the KV
heads ``[r * H / N, (r + 1) * H / N)`` of ``H`` (:func:`head_range`); its caches
store those heads and nothing else, and Q-Filters, being per KV head, runs on
each rank on its own heads with no communication.

A filters array or file is always whole-model ``[n_layers, n_kv_heads, head_dim]``
(what one process calibrates): :func:`local_filters` slices it to a rank's heads,
:func:`gather_heads` rebuilds it from the ranks' parts (``mx.distributed.all_gather``).

The group is read from the model's sharded linear layers (their ``group``); a
model sharded by other means (``shard_inplace`` on plain ``nn.Linear``) is not
recognised as sharded. Nothing here imports mlx at module level.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardInfo", "check_divisible", "check_shards", "gather_heads", "head_range", "local_filters",
           "parameter_sharding", "rank_of", "shard_info", "tensor_group"]

# mlx.nn's distributed linear layers and how they split their parameters
# (mlx/nn/layers/distributed.py: _all_to_sharded / _sharded_to_all with one segment).
_ALL_TO_SHARDED = ("AllToShardedLinear", "QuantizedAllToShardedLinear")
_SHARDED_TO_ALL = ("ShardedToAllLinear", "QuantizedShardedToAllLinear")


def _sharded_modules(model):
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in _ALL_TO_SHARDED + _SHARDED_TO_ALL and hasattr(m, "group"):
            yield name, m, kind in _ALL_TO_SHARDED


def tensor_group(model):
    """The ``mx.distributed.Group`` the model's layers are sharded over, or ``None`` (not
    sharded, or sharded over a group of one).

    Raises:
        ValueError: layers are sharded over groups of different sizes.
    """
    groups = {}
    for name, m, _ in _sharded_modules(model):
        groups.setdefault(m.group.size(), (name, m.group))
    if len(groups) > 1:
        raise ValueError("the model's layers are sharded over groups of different sizes "
                         f"({', '.join(f'{n} at {g[0]}' for n, g in sorted(groups.items()))}): "
                         "Q-Filters supports one tensor-parallel group")
    if not groups:
        return None
    (size, (_, group)), = groups.items()
    return group if size > 1 else None


def rank_of(model) -> tuple[int, int]:
    """``(rank, group size)`` of the model's tensor-parallel group; ``(0, 1)`` if not sharded."""
    g = tensor_group(model)
    return (0, 1) if g is None else (g.rank(), g.size())


def head_range(n_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)``: the KV heads of ``n_kv_heads`` that rank ``rank`` of ``size`` holds
    (``shard_linear(k_proj, "all-to-sharded")``: contiguous equal parts in rank order).

    Raises:
        ValueError: ``n_kv_heads`` is not divisible by ``size``, or ``rank`` is out of range.
    """
    check_divisible(n_kv_heads, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    per = n_kv_heads // size
    return rank * per, (rank + 1) * per


def check_divisible(n_kv_heads: int, size: int, n_heads: int | None = None) -> None:
    """Raise unless tensor parallelism over ``size`` ranks gives every rank whole heads.

    Raises:
        ValueError: ``n_kv_heads`` (or ``n_heads``) is not divisible by ``size``.
    """
    for what, n in (("KV heads", n_kv_heads), ("attention heads", n_heads)):
        if n is not None and n % size:
            raise ValueError(
                f"the model has {n} {what}, not divisible by the {size} ranks of the "
                f"tensor-parallel group: each rank must hold whole heads (shard_linear splits "
                f"k_proj into {size} equal parts); launch a number of ranks that divides {n}")


def check_shards(model) -> None:
    """Raise unless every sharded attention module holds whole KV heads on this rank
    (``k_proj`` rows ``== n_kv_heads * head_dim``); a model that is not sharded passes.

    Raises:
        ValueError: naming the module, the rows and the whole model's KV heads (not
            divisible by the group size).
    """
    group = tensor_group(model)
    if group is None:
        return
    size = group.size()
    for name, m in model.named_modules():
        k = getattr(m, "k_proj", None)
        hk, hd = getattr(m, "n_kv_heads", None), getattr(m, "head_dim", None)
        if type(k).__name__ in _ALL_TO_SHARDED and isinstance(hk, int) and isinstance(hd, int):
            rows = k.weight.shape[0]
            if rows != hk * hd:
                raise ValueError(
                    f"{name}: k_proj holds {rows} rows on this rank, not n_kv_heads * head_dim = "
                    f"{hk} * {hd}: the model's {rows * size // hd} KV heads are not divisible by "
                    f"the {size} ranks of the tensor-parallel group (launch a number of ranks "
                    "that divides the KV heads)")


@dataclass(frozen=True)
class ShardInfo:
    """Where a rank's caches sit in the whole model.

    Attributes:
        rank, size: the rank and the tensor-parallel group size.
        local_heads: KV heads per layer on this rank (``H_kv`` of its caches).
        n_kv_heads: KV heads per layer of the whole model (``local_heads * size``).
        start: first KV head of this rank (:func:`head_range`).
    """

    rank: int
    size: int
    local_heads: int
    n_kv_heads: int

    @property
    def start(self) -> int:
        return self.rank * self.local_heads

    def summary(self) -> str:
        return (f"rank {self.rank} of {self.size} (tensor parallel): KV heads "
                f"{self.start}..{self.start + self.local_heads - 1} of {self.n_kv_heads} per layer")


def shard_info(model, local_heads: set[int] | None = None) -> ShardInfo | None:
    """The rank's :class:`ShardInfo`, or ``None`` for a model that is not sharded.

    Args:
        local_heads: the ``H_kv`` the rank's cache slots received (from the shape
            probe, :func:`qfilters_mlx.model_info.probe_layout`); ``None`` reads them from
            the attention modules' ``n_kv_heads``.

    Raises:
        ValueError: the layers hold different numbers of KV heads, or an attention
            module's ``k_proj`` rows are not ``n_kv_heads * head_dim`` (the whole model's
            KV heads were not divisible by the group size).
    """
    group = tensor_group(model)
    if group is None:
        return None
    size = group.size()
    check_shards(model)
    if local_heads is None:
        local_heads = {m.n_kv_heads for _, m in model.named_modules()
                       if isinstance(getattr(m, "n_kv_heads", None), int)}
    if len(local_heads) != 1:
        raise ValueError(f"the sharded model's layers hold different numbers of KV heads per rank "
                         f"({sorted(local_heads)})")
    (h,) = local_heads
    return ShardInfo(group.rank(), size, int(h), int(h) * size)


def local_filters(filters, info: ShardInfo | None):
    """``filters [n_layers, n_kv_heads, D]`` (whole model) sliced to the rank's heads
    ``[n_layers, local_heads, D]``; unchanged when ``info`` is ``None``.

    Raises:
        ValueError: the filters hold another number of KV heads than the whole model.
    """
    if info is None:
        return filters
    if filters.ndim != 3 or filters.shape[1] != info.n_kv_heads:
        raise ValueError(f"filters {tuple(filters.shape)} do not hold the whole model's "
                         f"{info.n_kv_heads} KV heads per layer ([n_layers, n_kv_heads, head_dim]; "
                         f"this rank holds {info.local_heads} of them, {info.summary()})")
    return filters[:, info.start:info.start + info.local_heads]


def gather_heads(local, model):
    """The whole model's ``[n_layers, n_kv_heads, D]`` from every rank's
    ``[n_layers, local_heads, D]`` (``mx.distributed.all_gather`` over the model's
    tensor group, heads in rank order); ``local`` itself when the model is not sharded.
    A collective: every rank must call it; it is evaluated here (a lazy gather that only
    rank 0 evaluates, e.g. when writing a file, would wait forever for the others)."""
    import mlx.core as mx

    group = tensor_group(model)
    if group is None:
        return local
    whole = mx.swapaxes(mx.distributed.all_gather(mx.swapaxes(local, 0, 1), group=group), 0, 1)
    mx.eval(whole)  # now, on every rank: left lazy, only the rank that uses it would run it
    return whole


def parameter_sharding(model) -> dict[str, tuple[int, int]]:
    """``{parameter name: (axis, group size)}`` for every parameter the tensor-parallel
    layers split (axis of the parameter that holds ``1/size`` of the whole), as
    ``mlx.nn``'s ``_all_to_sharded`` / ``_sharded_to_all`` split them with one segment
    (fused projections sharded with ``segments=`` are split differently). Empty when
    the model is not sharded."""
    from mlx.utils import tree_flatten

    if tensor_group(model) is None:
        return {}
    out = {}
    for name, m, to_sharded in _sharded_modules(model):
        for pname, p in tree_flatten(m.parameters()):
            if to_sharded:
                axis = -1 if pname.endswith("bias") else max(p.ndim - 2, 0)
            elif pname.endswith("bias"):
                continue
            else:
                axis = -1
            out[f"{name}.{pname}" if name else pname] = (axis % p.ndim, m.group.size())
    return out
