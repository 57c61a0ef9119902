"""The arms of the RULER run and the caches they answer with.

Compress-once (kvpress's protocol): the context is prefilled once; each arm keeps, of that
prefill's keys/values, what a cache compressed by ``compression_ratio`` keeps (:mod:`.rows`) (kvpress's rule:
``int(tokens * (1 - ratio))`` kept per layer and KV head; no sinks nor recent window for the
scored presses, 4 sinks for StreamingLLM, as kvpress's ``StreamingLLMPress``), then the
question and the answer are appended. Streaming (this package's default mode): the arm's
cache evicts to ``budget = int((1 - ratio) * context tokens)`` after every call of the
whole prompt (library defaults: 4 sinks, recent window ``budget / 2``).

Arms: ``full`` (mlx-lm's ``KVCache``); ``qfilters`` (the offline calibrated query filter of
``qfilters-mlx calibrate``, ``score = +(k . f)``); ``qfilters_online`` (the query filter
estimated online from the first ``calib_tokens`` post-RoPE queries of the context, as a
cache with ``qfilters_filter_source="queries"`` does); ``knorm`` (kvpress's KnormPress:
method ``l2norm``, ``score = -||k||``); ``streaming_llm``; ``random`` (seeded).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPRESS_ARMS", "DEFAULT_COMPRESS_ARMS", "STREAMING_ARMS", "RulerArm", "arm_by_name", "layer_filters",
           "streaming_row"]


@dataclass(frozen=True)
class RulerArm:
    """One evicting arm: results label, ``KVCacheConfig.method``, where its filter comes from
    (``"calibrated"``, ``"online"`` or ``None``) and its compress-once sinks."""

    name: str
    method: str
    filters: str | None = None
    n_sink: int = 0


COMPRESS_ARMS = (
    RulerArm("qfilters", "qfilters", "calibrated"),
    RulerArm("qfilters_online", "qfilters", "online"),
    RulerArm("knorm", "l2norm"),
    RulerArm("streaming_llm", "streaming_llm", n_sink=4),
    RulerArm("random", "random"),
)
"""Every evicting arm (the full cache is not an arm of this list)."""

DEFAULT_COMPRESS_ARMS = ("qfilters", "knorm", "streaming_llm")
"""Arms a run has unless asked for others: ``random`` (a control that scored near zero) and
``qfilters_online`` (within 3 points of the calibrated filter at every ratio of the first run;
it also needs the context's queries observed) run only on request."""

STREAMING_ARMS = ("qfilters", "streaming_llm")
"""Arms run in the streaming protocol by default (each row reads the prompt from its first eviction on:\n:func:`.rows.forked_row`)."""


def arm_by_name(name: str) -> RulerArm:
    """The arm called ``name``.

    Raises:
        ValueError: no such arm (the message lists them).
    """
    for a in COMPRESS_ARMS:
        if a.name == name:
            return a
    raise ValueError(f"unknown arm {name!r}; arms: {[a.name for a in COMPRESS_ARMS]}")


def layer_filters(arm: RulerArm, calibrated, online, n_layers: int) -> list:
    """Per layer, the arm's filter ``[H_kv, D]`` (``None`` for arms without one).

    Raises:
        ValueError: the calibrated or online filters the arm needs are missing.
    """
    if arm.filters == "calibrated":
        if calibrated is None:
            raise ValueError("the 'qfilters' arm needs calibrated filters (qfilters-mlx calibrate)")
        return [calibrated[i] for i in range(n_layers)]
    if arm.filters == "online":
        if online is None or any(f is None for f in online):
            raise ValueError("the 'qfilters_online' arm needs the filter estimated from the context's "
                             "first calib_tokens queries: the context is shorter than calib_tokens")
        return list(online)
    return [None] * n_layers


def streaming_row(arm: RulerArm, ratio: float, context_tokens: int, head_dim: int, n_layers: int, *,
                  calibrated=None, calib_tokens: int = 128, seed: int = 0, backend: str = "auto") -> list:
    """One arm's fresh per-layer streaming caches at ``budget = int((1 - ratio) * context_tokens)``
    (library defaults otherwise; the online arm estimates its filter from the first
    ``calib_tokens`` queries, fed by ``observe_queries``).

    Raises:
        ValueError: the budget is too small for the arm's sinks and window, or filters are missing.
    """
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import KVCacheConfig

    budget = int((1 - ratio) * context_tokens)
    cfg = KVCacheConfig(method=arm.method, head_dim=head_dim, qfilters_budget=budget, qfilters_sign=1,
                        qfilters_filter_source="queries" if arm.filters == "online" else "keys",
                        qfilters_calib_tokens=calib_tokens, qfilters_seed=seed)
    filters = [None] * n_layers if arm.filters == "online" else layer_filters(arm, calibrated, None, n_layers)
    return [QFiltersKVCache(cfg, layer_idx=i, filters=f, backend=backend) for i, f in enumerate(filters)]
