"""What pairs a cache update with its queries: the pending update, the caches
watched, and the shape/identity rules (used by :mod:`qfilters_mlx.filters.hooks`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx


@dataclasses.dataclass
class Update:
    """One watched ``update_and_fetch`` call awaiting its queries.

    Attributes:
        layer: index of the cache's top-level entry in the watched list.
        path: ``(layer,)`` or ``(layer, j)`` for entry ``j`` of a ``CacheList``.
        cache: the cache object.
        keys_in: ``[B, H_kv, L, D]`` keys passed in (post-RoPE).
        keys_out: keys the cache returned (``[B, H_kv, S, D]``), or ``None``.
        rope_queries: queries found through ``mx.fast.rope``, or ``None``.
        caller: ``(module name, code object)`` of the function that called
            ``update_and_fetch`` (see :attr:`where`).
    """

    layer: int
    path: tuple
    cache: Any
    keys_in: Any
    keys_out: Any
    rope_queries: Any
    caller: tuple
    delivered: bool = False

    @property
    def where(self) -> str:
        """``module.qualname`` of the function that called ``update_and_fetch``."""
        module, code = self.caller
        return module if code is None else f"{module}.{code.co_qualname}"


def cache_leaves(caches) -> list[tuple[tuple, Any]]:
    """``(path, cache)`` for every cache in ``caches``; entries of mlx-lm ``CacheList``s
    are listed with path ``(i, j)``, everything else (our caches, wrappers) with ``(i,)``."""
    from mlx_lm.models.cache import CacheList

    out = []
    for i, c in enumerate(caches or []):
        if isinstance(c, CacheList):
            out.extend(((i, j), s) for j, s in enumerate(c.caches))
        else:
            out.append(((i,), c))
    return out


def fits(queries, keys, same_length: bool = True) -> bool:
    """``queries [B, H_q, L, D]`` can be the queries of ``keys [B, H_kv, L, D]``
    (``same_length=False``: of keys ``[B, H_kv, S, D]`` of any length)."""
    if not (isinstance(queries, mx.array) and isinstance(keys, mx.array)):
        return False
    if queries.ndim != 4 or keys.ndim != 4 or queries is keys:
        return False
    (b, hq, n, d), (kb, hk, kn, kd) = queries.shape, keys.shape
    return b == kb and (n == kn or not same_length) and d == kd and hk > 0 and hq % hk == 0


def same_offset(a, b) -> bool:
    if a is b:
        return True
    return isinstance(a, int) and isinstance(b, int) and a == b


def rope_queries(window: list, keys):
    """Queries of the update whose keys are ``keys``, found among this layer's
    ``mx.fast.rope`` outputs (see module docstring), or ``None``."""
    for j in range(len(window) - 1, -1, -1):
        if window[j][0] is keys:
            offset = window[j][1]
            for out, off in reversed(window[:j]):
                if same_offset(off, offset) and fits(out, keys):
                    return out
            return None
    return None
