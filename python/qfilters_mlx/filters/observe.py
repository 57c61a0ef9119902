"""Feed observed queries to the caches that estimate their filter from queries."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from qfilters_mlx.filters.capture import capture_attention


@contextmanager
def observe_queries(model, caches: list) -> Iterator[list]:
    """Within the context, every cache in ``caches`` that has ``observe_queries``
    receives the post-RoPE queries of its layer after each ``update_and_fetch``.

    Needed by ``qfilters_sign="auto"`` and ``qfilters_filter_source="queries"``
    (a cache alone never sees queries). Use around the whole generation::

        caches = KVCacheBuilder.for_model(model, config)
        with observe_queries(model, caches):
            mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)

    Yields ``caches``. The SDPA wrap is removed on exit, also on error.
    """
    observers = [c for c in caches if hasattr(c, "observe_queries")]

    def forward(layer, queries, _keys):
        if layer is not None:
            fn = getattr(caches[layer], "observe_queries", None)
            if fn is not None:
                fn(queries)

    for c in observers:
        c.queries_observed = True
    try:
        with capture_attention(model, forward, caches=caches):
            yield caches
    finally:
        for c in observers:
            c.queries_observed = False
