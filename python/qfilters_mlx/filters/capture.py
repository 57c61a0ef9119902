"""Observe post-RoPE queries without editing mlx-lm.

:func:`capture_attention` calls a callback with the queries and the keys of
every cache update of a forward pass, found through mlx-lm's
``scaled_dot_product_attention``, ``mx.fast.scaled_dot_product_attention`` or
the ``mx.fast.rope`` calls of inline attention (see
:mod:`qfilters_mlx.filters.hooks`), and restores every patch on exit, also after
an exception.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from qfilters_mlx.filters.hooks import AttentionHooks
from qfilters_mlx.filters.pairing import Update

ADVICE = ("use qfilters_filter_source='keys' with qfilters_sign=+1 or -1 (CLI: --filter-source keys "
          "--sign 1), or filters from a file (KVCacheConfig(qfilters_filters=...), CLI --filters; "
          "written by `qfilters-mlx calibrate` for a model whose queries can be observed, or "
          "converted from the paper's release)")


class QueriesNotCaptured(ValueError):
    """The queries of some attention layer cannot be observed.

    Attributes:
        layers: ``{layer index: where update_and_fetch was called from}``.
    """

    def __init__(self, message: str, layers: dict):
        super().__init__(message)
        self.layers = dict(layers)


def describe_layers(layers: dict) -> str:
    """``"layer 0 (attention in mlx_lm.models.x.Attention.__call__), layer 1 (...)"``."""
    return ", ".join(f"layer {i} (attention in {w})" for i, w in sorted(layers.items()))


@contextmanager
def capture_attention(model, callback: Callable, caches=None,
                      on_missing: Callable | None = None) -> Iterator[None]:
    """Call ``callback(layer, queries, keys)`` once for every cache update of ``model``.

    Args:
        model: an mlx-lm model (an ``nn.Module``; modules defining its
            submodules' classes are patched even outside ``mlx_lm.models``).
        callback: ``callback(layer: int | None, queries [B, H_q, L, D], keys
            [B, H_kv, S, D])``. ``queries`` are the post-RoPE queries of the
            call's ``L`` new tokens (what the SDPA call received, else the
            output of ``mx.fast.rope`` on the queries); ``keys`` are what the
            cache returned (stored ++ new). ``layer`` is the index of the
            cache's entry in ``caches``.
        caches: the per-layer cache list the model is called with. ``None``:
            every outermost SDPA call is reported with ``layer=None`` and the
            keys it received (inline attention is then not seen).
        on_missing: ``on_missing(layer, where)`` for an update whose queries
            could not be found (``where``: the function that called
            ``update_and_fetch``); by default such updates are skipped.

    Only forward passes of this ``model`` instance with these ``caches`` (any
    forward pass of it when ``caches`` is ``None``) are observed; other models,
    also of the same class and in other threads, run untouched, and blocks in
    other threads may be open at the same time. Every patch is restored on exit.

    Raises:
        RuntimeError: nested use in one thread.
    """

    def deliver(u: Update, queries) -> None:
        callback(u.layer, queries, u.keys_out)

    def missing(u: Update) -> None:
        if on_missing is not None:
            on_missing(u.layer, u.where)

    with AttentionHooks(model) as hooks:
        if caches is None:
            hooks.watch([], unpaired=lambda q, k: callback(None, q, k))
        else:
            hooks.watch(caches, deliver, missing)
        yield
