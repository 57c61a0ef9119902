"""Routing mlx-lm's attention of chosen layers through a function of ours, for one-pass
measurements (the retrieval-head ranking, :mod:`qfilters_mlx.filters.head_ranking`) and the
simulator (:mod:`qfilters_mlx.evaluation.simulate`, :mod:`qfilters_mlx.evaluation.oracle`):
every loaded ``mlx_lm.models`` module that imported ``scaled_dot_product_attention`` gets a
wrapper for the duration, undone on exit. The same two pieces (:func:`routed`, :func:`rebind`)
route head-group caches for good (:func:`qfilters_mlx.cache.head_groups.install_grouped_attention`)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable

__all__ = ["rebind", "refuse_own_mask", "route_attention", "routed"]


def refuse_own_mask(layer: int, mask) -> None:
    """Raise ``ValueError`` when ``layer`` attends with a mask other than the causal one."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        # (a sliding-window or padded layer: its own mask would be replaced silently)
        raise ValueError(f"layer {layer} attends with its own mask (a sliding window?): only "
                         "causal full-attention layers are simulated or measured")


def routed(kind: type, attend: Callable, original: Callable) -> Callable:
    """mlx-lm's ``scaled_dot_product_attention`` (``original``) with the layers whose cache is a
    ``kind`` sent to ``attend(queries, keys, values, cache, scale, mask, sinks)``."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, kind):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return attend(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention.__wrapped__ = original
    return scaled_dot_product_attention


def rebind(original: Callable, replacement: Callable) -> list:
    """Every loaded ``mlx_lm.models`` module (``base`` included, so that modules imported later
    take it too) whose ``scaled_dot_product_attention`` is ``original`` gets ``replacement``;
    returns those modules."""
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("mlx_lm.models.") and getattr(m, "scaled_dot_product_attention", None)
               is original]
    for m in patched:
        m.scaled_dot_product_attention = replacement
    return patched


@contextmanager
def route_attention(kind: type, attend: Callable):
    """Route mlx-lm's ``scaled_dot_product_attention`` of layers whose cache is a ``kind`` through
    ``attend(queries, keys, values, cache, scale, mask, sinks)`` (every loaded ``mlx_lm.models``
    module that imported it); other layers keep the original."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention
    patched = rebind(original, routed(kind, attend, original))
    try:
        yield
    finally:
        for m in patched:
            m.scaled_dot_product_attention = original
