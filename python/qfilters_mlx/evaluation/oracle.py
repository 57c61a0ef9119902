"""The oracle score for simulated streaming eviction: the attention each key receives later in
a full-cache pass over the same tokens (hindsight), used as the insertion score of
:class:`~qfilters_mlx.evaluation.simulate.MaskedArm` under the same keep rule: a ceiling for
every score fixed at insertion, valid for those tokens only."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from qfilters_mlx.filters.attention_route import refuse_own_mask, route_attention
from qfilters_mlx.evaluation.simulate import MaskedArm

__all__ = ["attention_received", "oracle_arm", "oracle_arms"]


class _Observe:
    """Stand-in for one layer's cache in a full-cache pass: keeps every key; the routed attention
    (:func:`_received_sdpa`) adds up the attention each key receives, once per window rule."""

    def __init__(self, layer: int, rules: list):
        self.layer, self.rules = layer, rules
        self.offset = 0
        self.received = None  # one [H_kv, T] float32 per rule, set by the routed attention

    def update_and_fetch(self, keys, values):
        if self.offset:
            raise RuntimeError("attention_received: a layer was called twice in one pass")
        self.offset = keys.shape[2]
        return keys, values


def _received_sdpa(queries, keys, values, cache, scale, mask, sinks):
    """Full causal attention of an :class:`_Observe` layer (explicit softmax weights, float32,
    the layer's output computed from them); records, per window rule, KV head
    ``h`` and key ``j``, the attention weights of query heads ``h * G .. h * G + G - 1`` summed
    over the queries ``t > j + window_h`` (``G = H_q / H_kv``)."""
    refuse_own_mask(cache.layer, mask)
    if sinks is not None:
        raise ValueError(f"attention_received: layer {cache.layer} has attention sinks (their share of "
                         "the softmax is not a key's): not covered")
    B, H_q, T, _ = queries.shape
    H = keys.shape[1]
    if B != 1:
        raise ValueError(f"attention_received: one sequence per pass, got batch {B}")
    q = queries[0].astype(mx.float32).reshape(H, H_q // H, T, -1)
    k = keys[0].astype(mx.float32)[:, None]
    logits = (q * scale) @ k.swapaxes(-1, -2)  # [H, G, T, T]: query t (rows), key j (columns)
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    probs = mx.softmax(mx.where(causal, logits, -mx.inf), axis=-1, precise=True)
    # later[h, t, j]: the weights on key j of the queries t' >= t (row T: none)
    later = mx.cumsum(probs.sum(axis=1), axis=1, reverse=True)
    later = mx.concatenate([later, mx.zeros((H, 1, T))], axis=1)  # [H, T + 1, T]
    per_rule = []
    for rule in cache.rules:
        windows = [int(w) for w in rule(cache.layer, H)]
        if len(windows) != H or min(windows) < 0:
            raise ValueError(f"attention_received: layer {cache.layer} needs {H} windows >= 0, got {windows}")
        first = mx.minimum(mx.arange(T)[None, :] + mx.array(windows)[:, None] + 1, T)  # [H, T]: t = j + w + 1
        per_rule.append(mx.take_along_axis(later, first[:, None, :], axis=1)[:, 0])
    cache.received = per_rule
    out = probs @ values[0].astype(mx.float32)[:, None]  # [H, G, T, D_v]: the full cache's output
    mx.eval(cache.received, out)
    return out.reshape(1, H_q, T, -1).astype(queries.dtype)


def _rule(windows) -> Callable[[int, int], list]:
    if isinstance(windows, (int, np.integer)) and not isinstance(windows, bool):
        w = int(windows)
        return lambda layer, heads: [w] * heads
    if callable(windows):
        return windows
    raise ValueError(f"attention_received: a window rule is an int or windows(layer, n_kv_heads), got {windows!r}")


def attention_received(model, inputs, rules: list) -> list[list[np.ndarray]]:
    """The attention each key receives later in a full-cache teacher-forced pass over ``inputs``:
    the oracle (hindsight) score of :func:`oracle_arms`, for several window rules in one pass.

    For layer ``l``, KV head ``h`` and key position ``j``: the softmax attention weights
    ``a[l, q, t, j]`` of the full cache (causal, no eviction), summed over the ``G`` query heads
    ``q`` that read KV head ``h`` (GQA) and over the queries ``t > j + w`` with ``w`` the head's
    recent window: the queries for which a streaming cache holds key ``j`` only if its score kept
    it (for ``t <= j + w`` the key is in the recent window whatever its score). Units: attention
    weight (each query head's weights over its keys sum to 1 per query), float32.

    Args:
        model: an mlx-lm model whose attention layers call mlx-lm's
            ``scaled_dot_product_attention`` with their cache (as :func:`simulated_nll`).
        inputs: 1-D token ids fed to the model (for an arm of :func:`simulated_nll` over
            ``tokens``: ``tokens[:-1]``, the positions whose keys it evicts).
        rules: window rules, each an int (every layer and head) or
            ``windows(layer, n_kv_heads) -> n_kv_heads ints`` (as :meth:`MaskedArm.windows`).

    Returns:
        Per rule, one ``[H_kv, len(inputs)]`` float32 numpy array per layer.

    Raises:
        ValueError: empty ``inputs`` or ``rules``, a rule neither int nor callable, windows not one
            int ``>= 0`` per KV head; a layer attending with a mask of its own (sliding window) or
            with attention sinks. RuntimeError: a layer's attention did not go through the
            routed path.
    """
    toks = mx.array(inputs)
    if toks.ndim != 1 or toks.shape[0] < 1:
        raise ValueError(f"inputs: 1-D token ids, got shape {tuple(toks.shape)}")
    if not rules:
        raise ValueError("attention_received: no window rule given")
    fns = [_rule(r) for r in rules]
    caches = [_Observe(i, fns) for i in range(len(model.layers))]
    with route_attention(_Observe, _received_sdpa):
        mx.eval(model(toks[None], cache=caches))
    missed = [c.layer for c in caches if c.received is None]
    if missed:
        raise RuntimeError(f"attention_received: the attention of layers {missed} did not go through "
                           "mlx-lm's scaled_dot_product_attention with their cache")
    return [[np.array(c.received[i]) for c in caches] for i in range(len(fns))]


def oracle_arms(model, tokens, configs: list) -> list[MaskedArm]:
    """The oracle's :class:`MaskedArm` of each config for ``tokens``, from one full-cache pass:
    the config's keep rule (budget, sinks, recent windows) with each key's insertion score the
    attention it receives later in the full cache (:func:`attention_received` over
    ``tokens[:-1]``, from the queries after the key has left its head's recent window). It sees
    the future: a ceiling for scores fixed at insertion, valid for these ``tokens`` only.

    Raises:
        ValueError: what :class:`MaskedArm` and :func:`attention_received` raise; an arm's score,
            asked for keys of another length than ``len(tokens) - 1``.
    """
    probes = [MaskedArm(c, score=lambda layer, keys: None) for c in configs]  # configs checked first
    received = attention_received(model, list(tokens)[:-1], [p.windows for p in probes])
    n = len(tokens) - 1

    def scorer(per_layer):
        def score(layer, keys):
            if keys.shape[2] != n:
                raise ValueError(f"oracle_arm: scores for {n} keys of its own tokens, asked for {keys.shape[2]}")
            return mx.array(per_layer[layer])[None]
        return score

    return [MaskedArm(c, score=scorer(r)) for c, r in zip(configs, received)]


def oracle_arm(model, tokens, config) -> MaskedArm:
    """:func:`oracle_arms` of one config."""
    return oracle_arms(model, tokens, [config])[0]
