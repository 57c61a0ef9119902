"""Feed observed queries to the caches that estimate their filter from queries."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

from qfilters_mlx.filters.capture import ADVICE, QueriesNotCaptured, describe_layers
from qfilters_mlx.filters.hooks import AttentionHooks
from qfilters_mlx.filters.pairing import Update, cache_leaves

# Probe inputs: a decode call then a 2-token call (some models take other paths for L == 1).
PROBE_CALLS = (1, 2)


def wants_queries(cache) -> bool:
    """Whether ``cache`` still waits for queries: its ``needs_queries`` flag; for a
    wrapper holding ``caches`` (e.g. one cache per batch row), whether any of them
    does; any other cache with ``observe_queries`` is assumed to."""
    flag = getattr(cache, "needs_queries", None)
    if flag is not None:
        return bool(flag)
    inner = getattr(cache, "caches", None)
    if isinstance(inner, (list, tuple)):
        return any(hasattr(c, "observe_queries") and wants_queries(c) for c in inner)
    return hasattr(cache, "observe_queries")


def _related(a: tuple, b: tuple) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def probe_queries(hooks: AttentionHooks, model, caches) -> None:
    """Check, before any real token is fed, that every layer whose cache in
    ``caches`` waits for queries delivers them.

    Runs the model over ``PROBE_CALLS`` tokens with throwaway caches of the
    model's own kind (``mlx_lm.models.cache.make_prompt_cache``) and builds the
    graph only (nothing is evaluated unless the model evaluates internally);
    ``caches`` are not touched. Layers never updated by the probe are skipped
    (their caches never grow). A probe call that raises ends the probe (the
    calls before it are checked): the model's own error, if any, comes from
    the real call, and the check at the end of every forward pass still holds.

    Raises:
        QueriesNotCaptured: naming every layer (and its attention function)
            whose queries were not found.
        ValueError: ``caches`` has another length than the model's own cache list.
    """
    from mlx_lm.models.cache import make_prompt_cache

    wanted = [p for p, c in cache_leaves(caches) if hasattr(c, "observe_queries") and wants_queries(c)]
    if not wanted:
        return
    probe = make_prompt_cache(model)
    if len(probe) != len(caches):
        raise ValueError(f"caches has {len(caches)} entries but the model uses {len(probe)} "
                         "(mlx_lm make_prompt_cache): build them with KVCacheBuilder.for_model(model, ...)")
    missing: dict[tuple, str] = {}
    hooks.watch(probe, missing=lambda u: missing.setdefault(u.path, u.where))
    for n in PROBE_CALLS:
        try:
            model(mx.zeros((1, n), dtype=mx.int32), cache=probe)
        except Exception:  # noqa: BLE001 - e.g. a model that cannot prefill: check what ran
            break
    hooks.flush()
    bad = {}
    for path in wanted:
        hit = next((missing[p] for p in sorted(missing) if _related(p, path)), None)
        if hit is not None:
            bad[path[0]] = hit
    if bad:
        raise QueriesNotCaptured(
            f"observe_queries: the queries of {describe_layers(bad)} cannot be observed (no "
            "scaled_dot_product_attention call and no mx.fast.rope call on the queries was seen for "
            "this layer's keys), so its cache with qfilters_filter_source='queries' or "
            f"qfilters_sign='auto' would never get a filter nor evict; {ADVICE}", bad)


@contextmanager
def observe_queries(model, caches: list) -> Iterator[list]:
    """Within the context, every cache in ``caches`` that has ``observe_queries``
    receives the post-RoPE queries ``[B, H_q, L, D]`` of its layer once per
    ``update_and_fetch`` (right after the attention call, or when the next
    layer's update starts or the forward returns).

    Needed by ``qfilters_sign="auto"`` and ``qfilters_filter_source="queries"``
    (a cache alone never sees queries). Use around the whole generation::

        caches = KVCacheBuilder.for_model(model, config)
        with observe_queries(model, caches):
            mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)

    On entry, when some cache waits for queries, a cheap probe
    (:func:`probe_queries`) checks that the model delivers them for each such
    layer. Queries are found through mlx-lm's ``scaled_dot_product_attention``,
    ``mx.fast.scaled_dot_product_attention`` or the ``mx.fast.rope`` call on the
    queries (inline attention); see :mod:`qfilters_mlx.filters.hooks`.

    Yields ``caches``. Every patch is removed on exit, also on error.

    Raises:
        QueriesNotCaptured: on entry (probe), or at the end of a forward pass
            (at the latest when the next update starts), naming the layer whose
            queries were not found while its cache waits for them.
        RuntimeError: nested use in one thread.
    """
    observers = [c for _, c in cache_leaves(caches) if hasattr(c, "observe_queries")]

    def deliver(u: Update, queries) -> None:
        fn = getattr(u.cache, "observe_queries", None)
        if fn is not None:
            fn(queries)

    def observed(cache) -> bool:
        return hasattr(cache, "observe_queries") and wants_queries(cache)

    def missing(u: Update) -> None:
        if observed(u.cache):
            layers = {u.layer: u.where}
            raise QueriesNotCaptured(
                f"observe_queries: no queries were found for the last update of "
                f"{describe_layers(layers)}, whose cache waits for them to estimate its filter; "
                f"{ADVICE}", layers)

    with AttentionHooks(model) as hooks:
        probe_queries(hooks, model, caches)
        hooks.watch(caches, deliver, missing, wants=observed)
        for c in observers:
            c.queries_observed = True
        try:
            yield caches
        finally:
            for c in observers:
                c.queries_observed = False
