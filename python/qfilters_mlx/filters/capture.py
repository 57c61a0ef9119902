"""Observe post-RoPE queries without editing mlx-lm.

Each ``mlx_lm.models.<arch>`` module imports ``scaled_dot_product_attention``
from ``mlx_lm.models.base`` into its own namespace, so patching ``base`` alone
changes nothing (DESIGN.md, "Filter sources"). :func:`capture_attention` wraps
that name in every loaded ``mlx_lm.models.*`` module (and in the module of the
model's own class), calls a callback with the queries and the keys the cache
returned, and restores every patched name on exit, also after an exception.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

_NAME = "scaled_dot_product_attention"
_lock = threading.Lock()


def _target_modules(model) -> list:
    names = {m for m in sys.modules if m.startswith("mlx_lm.models.")}
    if model is not None:
        names.add(type(model).__module__)
    mods = [sys.modules[n] for n in sorted(names) if n in sys.modules]
    return [m for m in mods if callable(getattr(m, _NAME, None))]


@contextmanager
def capture_attention(model, callback: Callable, caches=None) -> Iterator[None]:
    """Call ``callback(layer, queries, keys)`` on every attention call of ``model``.

    Args:
        model: an mlx-lm model (its class's module is patched even if it lives
            outside ``mlx_lm.models``).
        callback: ``callback(layer: int | None, queries [B, H_q, L, D], keys
            [B, H_kv, S, D])``. ``queries`` are post-RoPE (what attention uses);
            ``keys`` are what the cache returned (stored ++ new). ``layer`` is
            the index of the call's cache in ``caches`` (``None`` if unknown).
        caches: the per-layer cache list the model is called with.

    The wrap is process-global while active (mlx-lm modules are shared), so it
    is serialised with a lock; every patched name is restored on exit.
    """
    index = {id(c): i for i, c in enumerate(caches or [])}
    with _lock:
        patched = []
        try:
            for mod in _target_modules(model):
                original = getattr(mod, _NAME)

                def wrapper(queries, keys, values, cache, *args, _orig=original, **kwargs):
                    callback(index.get(id(cache)), queries, keys)
                    return _orig(queries, keys, values, cache, *args, **kwargs)

                setattr(mod, _NAME, wrapper)
                patched.append((mod, original))
            yield
        finally:
            for mod, original in reversed(patched):
                setattr(mod, _NAME, original)
