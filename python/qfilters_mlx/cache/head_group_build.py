"""Building head groups for a model: checking a :class:`~qfilters_mlx.config.HeadBudgets`
against the configuration and the model (:func:`check_heads`) and one budgeted layer's cache
for its groups (:func:`layer_cache`), for ``KVCacheBuilder.for_model(..., heads=)``."""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from qfilters_mlx.cache.head_groups import HeadGroupsKVCache

__all__ = ["CALIBRATED", "check_heads", "layer_cache", "resolve_heads"]

CALIBRATED = "calibrated"
"""``heads="calibrated"``: the model's retrieval heads found (or measured once and stored) and
turned into budgets by the written rule (docs/head-groups.md)."""


def resolve_heads(heads, model, config, tokenizer=None, model_path=None):
    """``heads`` as a :class:`~qfilters_mlx.config.HeadBudgets`: as given, or for
    ``"calibrated"`` the rule :func:`~qfilters_mlx.filters.head_budgets.head_budgets` at
    ``config.qfilters_budget`` and ``qfilters_n_sink`` over the model's ranking
    (:func:`~qfilters_mlx.filters.head_store.resolve_head_ranking`: stored file, else measured
    once now and stored, one line on stderr).

    Raises:
        ValueError: another string; what the ranking and the rule raise (a ranking of another
            model, no tokenizer to measure with, a budget the rule cannot split).
    """
    if not isinstance(heads, str):
        return heads
    if heads != CALIBRATED:
        raise ValueError(f"heads must be a HeadBudgets or {CALIBRATED!r}, got {heads!r}")
    from qfilters_mlx.filters.head_budgets import head_budgets
    from qfilters_mlx.filters.head_store import resolve_head_ranking

    ranking = resolve_head_ranking(model, tokenizer, model_path).ranking
    return head_budgets(ranking, config.qfilters_budget, config.qfilters_n_sink)


def check_heads_use(heads, config, *, shared_kv: bool = False) -> None:
    """Raise, before a ranking is measured or any cache is built, when head groups cannot be
    used with ``config`` at all.

    Raises:
        TypeError: ``heads`` is neither a :class:`~qfilters_mlx.config.HeadBudgets` nor a string.
        ValueError: ``method="full"`` (nothing evicted); the compress-once mode (head groups
            hold fixed budgets); layers whose K/V another layer reads (``shared_kv``).
    """
    from qfilters_mlx.config import HeadBudgets

    if not isinstance(heads, (HeadBudgets, str)):
        raise TypeError(f"heads must be a HeadBudgets or {CALIBRATED!r}, got {type(heads).__name__}")
    if not config.scorer.evicts:
        raise ValueError(f"heads=: method {config.method!r} evicts nothing; head budgets need an "
                         "evicting method")
    if config.compress_once:
        raise ValueError("heads=: head groups hold fixed per-head budgets (the streaming mode); "
                         "the compress-once mode sets its budget by ratio")
    if shared_kv:
        raise ValueError("heads=: this model's layers read another layer's K/V, which head "
                         "groups do not return as one array")


def check_heads(heads, config, n_kv_heads: list[int], *, shard=None):
    """The part of ``heads`` (a :class:`~qfilters_mlx.config.HeadBudgets` of the whole model)
    that this process's caches hold: ``heads`` itself, or on a tensor-parallel rank (``shard``, a
    :class:`~qfilters_mlx.sharding.ShardInfo`) the rank's KV heads of every layer
    (:meth:`~qfilters_mlx.config.HeadBudgets.heads_slice`). Raises before any cache is built when
    the tables do not fit budgeted layers of ``n_kv_heads`` heads (the whole model's,
    ``shard.n_kv_heads``, on a rank) or ``config.qfilters_n_sink``.

    Raises:
        ValueError: the tables do not fit (on a rank the message names the rank's heads and asks
            for the whole model's table).
    """
    if shard is None:
        heads.check(len(n_kv_heads), n_kv_heads, config.qfilters_n_sink)
        return heads
    try:
        heads.check(len(n_kv_heads), [shard.n_kv_heads] * len(n_kv_heads), config.qfilters_n_sink)
    except ValueError as err:
        raise ValueError(f"heads=: {err}; on a tensor-parallel rank ({shard.summary()}) give the "
                         f"whole model's table of {shard.n_kv_heads} KV heads per layer, which "
                         "each rank slices to its own") from err
    return heads.heads_slice(shard.start, shard.local_heads)


def layer_cache(config, groups, layer_idx: int, filters, new_cache):
    """Budgeted layer ``layer_idx``'s cache for its ``groups``
    (:meth:`~qfilters_mlx.config.HeadBudgets.groups`): one group, a plain cache at that budget
    and those windows; several, a :class:`HeadGroupsKVCache` of one cache per group, each with
    its heads' rows of ``filters`` (``[H_kv, D]`` or ``None``). ``new_cache(config, filters)``
    builds one cache (with the builder's options)."""
    def group_config(g):
        recent = g.recent[0] if len(set(g.recent)) == 1 else g.recent
        return dataclasses.replace(config, qfilters_budget=g.budget, qfilters_recent=recent)

    if len(groups) == 1:
        return new_cache(group_config(groups[0]), filters)
    caches = []
    for g in groups:
        f = None if filters is None else filters[mx.array(g.heads, dtype=mx.int32)]
        caches.append(new_cache(group_config(g), f))
    return HeadGroupsKVCache((g.heads, c) for g, c in zip(groups, caches))
