"""Streaming eviction simulated in one forward pass: per-head attention masks.

With scores fixed at insertion (the calibrated or a given filter, L2-norm, StreamingLLM,
random), the keys a streaming cache holds when token ``t`` attends are a function of the
scores of tokens ``< t`` alone: the first ``n_sink`` positions, the last ``recent``, and
the highest-scored ``budget - n_sink - recent`` of the others (once a key is evicted it
never returns, so the kept set after position ``p`` is the top of all candidates up to
``p``; ties: the earlier position wins, as :func:`qfilters_mlx.backends.reference.select_keep`).
Token ``t``'s own keys, at every layer, are computed from what the cache held at ``t``.
So one teacher-forced forward pass whose attention at each layer and KV head is masked
to those sets gives the same per-token NLLs as :func:`.perplexity.streaming_nll` fed
token by token (``prefix`` tokens first in one call, then one at a time), up to the
order of floating-point sums (which can flip exactly or nearly tied scores, such as the L2
norms of a repeated token), at the cost of one prefill instead of ``T`` decode steps.

The oracle (:func:`qfilters_mlx.evaluation.oracle.oracle_arm`): the same keep rule with each
key's score the attention it receives later in a full-cache pass over the same tokens, a
ceiling for every score fixed at insertion.

Not covered: filters estimated online (``qfilters_calib_tokens`` first keys or queries:
the scores then change at calibration), compress-once, quantized storage.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from qfilters_mlx.filters.attention_route import refuse_own_mask, route_attention

__all__ = ["MaskedArm", "keep_masks", "simulated_nll", "simulated_pass", "simulated_predictions"]


@dataclass(frozen=True)
class MaskedArm:
    """One eviction rule for :func:`simulated_nll`: a config's budget, sinks and recent
    window(s), and a score.

    Attributes:
        config: a streaming-mode :class:`~qfilters_mlx.config.KVCacheConfig` (its budget,
            ``n_sink`` and :meth:`~qfilters_mlx.config.KVCacheConfig.layer_recent`).
        score: ``score(layer, keys [1, H_kv, T, D] post-RoPE) -> [1, H_kv, T]`` float32, each
            key's score at insertion (higher is kept), ``score(layer, keys, values)`` with
            ``with_values``; ``None``: the config's own method
            (:func:`~qfilters_mlx.cache.kv_cache.insertion_scores`, with ``filters[layer]``).
        filters: ``[n_layers, H_kv, D]`` for ``method="qfilters"`` with ``score=None``.
        budgets: one budget per layer (tokens kept per KV head; each ``> n_sink`` and at least
            ``n_sink`` plus that layer's windows), or per layer a tuple of one budget per KV
            head, or ``None``: the config's budget everywhere. Budgets per layer or head are a
            simulation only: a cache takes its config's one budget.
        recents: per layer, a tuple of one recent window per KV head in place of the config's,
            or ``None``.
        with_values: ``score`` also takes the layer's values ``[1, H_kv, T, D_v]``.

    Raises:
        ValueError: a compress-once config, ``method="full"`` (nothing to simulate),
            ``method="qfilters"`` with neither ``score`` nor ``filters``, or a budget per layer
            that is no int above ``n_sink``.
    """

    config: object
    score: Callable | None = None
    filters: object = None
    budgets: tuple | None = None
    recents: tuple | None = None
    with_values: bool = False

    def __post_init__(self):
        c = self.config
        if c.compress_once:
            raise ValueError("simulated_nll covers the streaming mode only")
        if c.method == "full":
            raise ValueError("method='full' evicts nothing: use evaluation.perplexity.full_cache_nll")
        if self.score is None and c.method == "qfilters" and self.filters is None:
            raise ValueError("method='qfilters' without score= needs filters= (fixed at insertion: "
                             "online filters are not covered)")
        if self.budgets is not None and not all(
                isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > c.qfilters_n_sink
                for layer in self.budgets for b in (layer if isinstance(layer, tuple) else (layer,))):
            raise ValueError(f"budgets: one int > n_sink ({c.qfilters_n_sink}) per layer, got {self.budgets}")

    def budget(self, layer: int):
        """Tokens kept per KV head at ``layer``: an int, or a tuple of one per KV head."""
        if self.budgets is None:
            return int(self.config.qfilters_budget)
        if not 0 <= layer < len(self.budgets):
            raise ValueError(f"budgets has {len(self.budgets)} layers; layer {layer} has none")
        b = self.budgets[layer]
        return tuple(int(x) for x in b) if isinstance(b, tuple) else int(b)

    def scores(self, layer: int, keys: mx.array, values: mx.array | None = None) -> mx.array:
        """``[1, H_kv, T]`` float32 insertion scores of ``keys`` (and ``values``) at ``layer``."""
        if self.score is not None:
            return self.score(layer, keys, values) if self.with_values else self.score(layer, keys)
        from qfilters_mlx.cache.kv_cache import insertion_scores

        c = self.config
        positions = mx.broadcast_to(mx.arange(keys.shape[2]), keys.shape[:3])
        f = None if self.filters is None else self.filters[layer]
        return insertion_scores(c.method, keys, positions, filters=f, sign=c.score_sign,
                                seed=c.qfilters_seed, layer=layer)

    def windows(self, layer: int, heads: int) -> list[int]:
        """The recent window of each of the ``heads`` KV heads of ``layer``."""
        r = self.config.layer_recent(layer) if self.recents is None else self.recents[layer]
        return [int(r)] * heads if isinstance(r, int) else [int(x) for x in r]


def keep_masks(scores: np.ndarray, budget: int, n_sink: int, recent, prefix: int) -> np.ndarray:
    """``[H, T, T]`` bool: query ``t`` attends key ``j``.

    Queries ``t < prefix`` (the first call) attend every ``j <= t``; a later query attends
    what the cache kept after position ``t - 1`` and itself.

    Args:
        scores: ``[H, T]`` insertion scores (NaN ranks lowest).
        budget: tokens kept per head (an int, or ``H`` ints).
        n_sink: leading positions never evicted.
        recent: ``H`` ints, trailing positions never evicted per head.
        prefix: tokens of the first call (``>= 1``).

    Raises:
        ValueError: not ``H`` windows, ``n_sink + recent[h] > budget``, or ``prefix < 1``.
    """
    H, T = scores.shape
    budgets = [int(budget)] * H if isinstance(budget, (int, np.integer)) else [int(b) for b in budget]
    if len(recent) != H or len(budgets) != H or prefix < 1 or any(
            n_sink + int(r) > b or int(r) < 0 for r, b in zip(recent, budgets)):
        raise ValueError(f"keep_masks: need {H} windows in [0, budget - n_sink] and prefix >= 1 "
                         f"(budget {budget}, n_sink {n_sink}, recent {list(recent)}, prefix {prefix})")
    s = np.where(np.isnan(scores), -np.inf, scores)
    t = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    out = np.zeros((H, T, T), dtype=bool)
    for h in range(H):
        window = int(recent[h])
        keep_top = budgets[h] - n_sink - window
        evicted_after = np.full(T, T)  # key j is visible to queries t <= evicted_after[j]
        heap: list = []
        nxt = n_sink
        for p in range(prefix - 1, T - 1):  # the cache after position p, seen by query p + 1
            while nxt <= p - window:
                heapq.heappush(heap, (s[h, nxt], -nxt))  # evicted first: low score, then late
                nxt += 1
            while len(heap) > keep_top:
                evicted_after[-heapq.heappop(heap)[1]] = p
        # (sinks and the recent window never enter the heap: never evicted, visible to every query)
        out[h] = (j <= t) & ((evicted_after[None, :] >= t) | (t < prefix))
    return out


class _OnePass:
    """Stand-in for one layer's cache in the single forward pass: scores the keys and holds
    the layer's mask for the patched attention."""

    def __init__(self, layer: int, arm: MaskedArm, prefix: int):
        self.layer, self.arm, self.prefix = layer, arm, prefix
        self.offset = 0
        self.mask = None
        self.attended = False  # set by the patched attention

    def update_and_fetch(self, keys, values):
        if self.offset:
            raise RuntimeError("simulated_nll: a layer was called twice in one pass")
        H = keys.shape[1]
        c = self.arm.config
        scores = np.array(self.arm.scores(self.layer, keys, values).astype(mx.float32))[0]
        m = keep_masks(scores, self.arm.budget(self.layer), c.qfilters_n_sink, self.arm.windows(self.layer, H),
                       self.prefix)
        self.mask = mx.array(m)[None]  # [1, H_kv, T, T]
        self.offset = keys.shape[2]
        return keys, values


def _masked_sdpa(queries, keys, values, cache, scale, mask, sinks):
    """Attention of a :class:`_OnePass` layer through its per-KV-head mask."""
    refuse_own_mask(cache.layer, mask)
    groups = queries.shape[1] // keys.shape[1]  # GQA: query head h reads KV head h // groups
    m = mx.repeat(cache.mask, groups, axis=1) if groups > 1 else cache.mask
    cache.attended = True
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=m, sinks=sinks)


def _masked_attention():
    """Route the attention of :class:`_OnePass` layers through their per-KV-head masks."""
    return route_attention(_OnePass, _masked_sdpa)


def simulated_nll(model, tokens, arm: MaskedArm, prefix: int) -> list[float]:
    """Per-token NLLs (nats) of ``tokens[prefix:]`` under streaming eviction by ``arm``, in one
    forward pass (module docstring): what :func:`.perplexity.streaming_nll` returns for
    caches evicting by the same fixed scores.

    Args:
        model: an mlx-lm model whose attention layers call mlx-lm's
            ``scaled_dot_product_attention`` with their cache (the llama family and most others).
        tokens: 1-D token ids.
        arm: the eviction rule.
        prefix: tokens of the first call, ``1 <= prefix < len(tokens)``.

    Raises:
        ValueError: ``prefix`` out of range; a layer attending with a mask of its own (sliding
            window) instead of the causal one. RuntimeError: some layer's attention did not go
            through the masked path (its mask would be silently causal).
    """
    return simulated_pass(model, tokens, arm, prefix)[0]


def _check_fits(arm: MaskedArm, n_layers: int) -> None:
    """Raise ``ValueError`` naming the layer where ``arm`` does not fit a model of ``n_layers``."""
    if arm.budgets is not None and len(arm.budgets) != n_layers:
        raise ValueError(f"budgets has {len(arm.budgets)} layers, the model {n_layers}")
    n_sink = arm.config.qfilters_n_sink
    for i in range(n_layers):
        b = arm.budget(i)
        r = arm.windows(i, len(b) if isinstance(b, tuple) else 1)
        for w, x in zip(r, b if isinstance(b, tuple) else [b] * len(r)):
            if n_sink + w > x:
                raise ValueError(f"layer {i}: n_sink {n_sink} + recent window {w} exceed its budget {x}")


class _Replay:
    """Stand-in for a layer below ``start``: returns the hidden state recorded for the layer
    input at ``start`` (every layer below it is skipped), other attributes are the layer's."""

    def __init__(self, layer, hidden):
        self._layer, self._hidden, self.called = layer, hidden, False

    def __getattr__(self, name):
        return getattr(self._layer, name)

    def __call__(self, h, *args, **kwargs):
        self.called = True
        return self._hidden


class _Record:
    """Stand-in for a layer whose output is kept (``out``); otherwise the layer itself."""

    def __init__(self, layer):
        self._layer, self.out = layer, None

    def __getattr__(self, name):
        return getattr(self._layer, name)

    def __call__(self, *args, **kwargs):
        self.out = self._layer(*args, **kwargs)
        return self.out


def simulated_pass(model, tokens, arm: MaskedArm, prefix: int, *, start: int = 0, hidden=None,
                   record=()) -> tuple[list[float], dict]:
    """:func:`simulated_nll` from layer ``start`` on, keeping the outputs of the layers in
    ``record``: a search that changes the windows of layer ``start`` and up reruns only those
    layers. The layers below ``start`` are not run: ``hidden`` (their last one's output,
    ``[1, T - 1, d_model]``, as an earlier pass recorded it under the same rule for those
    layers) stands for them.

    Returns:
        ``(nll, outputs)``: the per-token NLLs (nats) of ``tokens[prefix:]`` and
        ``{layer: [1, T - 1, d_model]}`` for every layer in ``record``.

    Raises:
        ValueError: what :func:`simulated_nll` raises; ``start`` outside ``[0, n_layers)``,
            ``start > 0`` without ``hidden`` or the reverse, ``hidden`` not ``[1, T - 1, ...]``,
            a ``record`` layer below ``start`` or outside the model; ``arm.budgets`` not one per
            layer, or a layer whose sinks and widest window exceed its budget (both named,
            before any layer runs). RuntimeError: also when the model does not run the layers
            of ``model.layers`` (the replayed layers were not called). ``model.layers`` is
            restored whatever is raised.
    """
    lp, outputs = _simulated_logits(model, tokens, arm, prefix, start, hidden, record)
    return _nll(lp, tokens, prefix).tolist(), outputs


def _simulated_logits(model, tokens, arm, prefix, start, hidden, record):
    """:func:`simulated_pass`'s checks and pass: ``(logits [T - prefix, V] float32 predicting
    tokens[prefix:], outputs)``."""
    toks = mx.array(tokens)
    T = toks.shape[0]
    if not 1 <= prefix < T:
        raise ValueError(f"prefix must be in [1, {T - 1}], got {prefix}")
    layers = model.layers
    n = len(layers)
    record = sorted(set(int(r) for r in record))
    if not 0 <= start < n or (start > 0) != (hidden is not None):
        raise ValueError(f"start must be in [0, {n}) and hidden given exactly when start > 0 "
                         f"(start {start}, hidden {'given' if hidden is not None else 'None'})")
    if record and not start <= record[0] <= record[-1] < n:
        raise ValueError(f"record: layers must be in [{start}, {n}), got {record}")
    if hidden is not None and (hidden.ndim != 3 or tuple(hidden.shape[:2]) != (1, T - 1)):
        raise ValueError(f"hidden must be [1, {T - 1}, d_model] (the recorded output of layer {start - 1}), "
                         f"got shape {tuple(hidden.shape)}")
    _check_fits(arm, n)
    caches = [_OnePass(i, arm, prefix) for i in range(n)]
    originals = list(layers)
    replayed = [_Replay(layers[i], hidden) for i in range(start)]
    recorded = {i: _Record(layers[i]) for i in record}
    layers[:start] = replayed
    for i, r in recorded.items():
        layers[i] = r
    try:
        with _masked_attention():
            logits = model(toks[None, :-1], cache=caches)[0].astype(mx.float32)
    finally:
        layers[:] = originals
    if not all(r.called for r in replayed) or any(r.out is None for r in recorded.values()):
        raise RuntimeError("simulated_pass: the model did not run the layers of model.layers (layers "
                           "below start cannot be replayed, outputs not recorded)")
    missed = [i for i, c in enumerate(caches[start:], start) if not c.attended]
    if missed:
        raise RuntimeError(f"simulated eviction: the attention of layers {missed} did not go through "
                           "mlx-lm's scaled_dot_product_attention with their cache (not maskable)")
    return logits[prefix - 1:], {i: r.out for i, r in recorded.items()}


def _nll(lp, tokens, prefix: int) -> mx.array:
    """``[T - prefix]`` NLLs of ``tokens[prefix:]`` from their logits ``lp [T - prefix, V]``."""
    target = mx.array(tokens)[prefix:, None]
    return mx.logsumexp(lp, axis=-1) - mx.take_along_axis(lp, target, axis=-1)[:, 0]


def simulated_predictions(model, tokens, arm: MaskedArm, prefix: int) -> tuple[list[float], list[int]]:
    """:func:`simulated_nll` and, at each scored position, the token the model ranks first:
    ``(nll, argmax)``, both for ``tokens[prefix:]`` (``argmax[i]`` predicts ``tokens[prefix + i]``
    from the tokens before it, teacher-forced: what greedy decoding would emit there given those
    tokens). Raises what :func:`simulated_nll` raises."""
    lp, _ = _simulated_logits(model, tokens, arm, prefix, 0, None, ())
    return _nll(lp, tokens, prefix).tolist(), mx.argmax(lp, axis=-1).tolist()
