"""The process-wide side of :class:`~qfilters_mlx.filters.hooks.AttentionHooks`: shared patch
points and the routing of each patched call to the block it belongs to.

Patch points (``owner.name``) are shared by every open block and counted: the first
block to hold one installs its wrapper, the last one to let go restores what was there
(:func:`hold`, :func:`release`; both under :data:`REGISTRY`). One wrapper per patch point
(:func:`update_wrapper`, :func:`sdpa_wrapper`, :func:`rope_wrapper`,
:func:`model_wrapper`) hands each call to the block it belongs to, through the block's
``on_update``, ``on_sdpa``, ``on_rope`` and ``on_forward``, and passes it through
untouched otherwise. The block of a call is the innermost forward pass of a patched
model class in this thread (``None`` when that forward is not watched: a forward pass
belongs to the open block of the same model instance that ``takes`` one of its caches),
else, outside any such forward, the block this thread opened (:func:`entered`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from qfilters_mlx.filters.pairing import cache_leaves

__all__ = ["OPEN_BLOCKS", "REGISTRY", "SDPA", "entered", "hold", "model_wrapper", "release",
           "rope_wrapper", "sdpa_wrapper", "set_entered", "update_wrapper"]

SDPA = "scaled_dot_product_attention"
REGISTRY = threading.Lock()  # guards _points and OPEN_BLOCKS
OPEN_BLOCKS: list = []  # blocks entered and not yet left (any thread)
_points: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [owner, name, had, old, users]
_tls = threading.local()  # .entered: the block this thread opened; .forwards: forward-pass stack


def entered() -> Any:
    """The block this thread opened (``None`` when none is open)."""
    return getattr(_tls, "entered", None)


def set_entered(block) -> None:
    """Record ``block`` (or ``None``) as the block this thread opened."""
    _tls.entered = block


def hold(owner, name: str, make: Callable[[Callable], Callable]) -> tuple[int, str]:
    """Hold the patch point ``owner.name``, installing ``make(original)`` if no block holds it;
    returns the point's key for :func:`release` (call under :data:`REGISTRY`)."""
    key = (id(owner), name)
    point = _points.get(key)
    if point is None:
        had = name in vars(owner)
        old = vars(owner).get(name)
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        point = _points[key] = [owner, name, had, old, 0]
    point[4] += 1
    return key


def release(keys: list) -> None:
    """Drop a block's hold on the patch points ``keys`` (emptied); restore those nobody holds
    (call under :data:`REGISTRY`)."""
    for key in reversed(keys):
        point = _points[key]
        point[4] -= 1
        if point[4] == 0:
            owner, name, had, old, _ = _points.pop(key)
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
    keys.clear()


def _target() -> Any:
    """The block the current call belongs to: the innermost forward pass of a
    patched model class in this thread (``None`` when that forward is not
    watched), else, outside any such forward, the block this thread opened."""
    forwards = getattr(_tls, "forwards", None)
    if forwards:
        return forwards[-1]
    return entered()


def _forward_caches(args, kwargs) -> set[int]:
    """``id`` of every cache in a forward call's ``cache`` argument (``model(inputs, cache)``)."""
    cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
    return {id(c) for _, c in cache_leaves(cache)} if isinstance(cache, (list, tuple)) else set()


def _block_for(model, ids: set[int]) -> Any:
    """The open block watching a forward pass of ``model`` with the caches ``ids``:
    same model instance, and a watched cache among ``ids`` (a block watching no
    caches takes every forward pass of its model)."""
    with REGISTRY:
        blocks = [b for b in OPEN_BLOCKS if b.model is model]
    return next((b for b in blocks if b.takes(ids)), None)


def _caller(depth: int) -> tuple:
    frame = sys._getframe(depth + 1)
    return frame.f_globals.get("__name__", "?"), frame.f_code


# One wrapper per patch point, shared by every open block: each call is handed to
# the block it belongs to (``_target``) and passes through untouched otherwise.
def update_wrapper(original):
    def update_and_fetch(cache, *args, **kwargs):
        h = _target()
        if h is None:
            return original(cache, *args, **kwargs)
        return h.on_update(original, cache, args, kwargs, _caller(1))

    return update_and_fetch


def sdpa_wrapper(original):
    def scaled_dot_product_attention(*args, **kwargs):
        h = _target()
        if h is None:
            return original(*args, **kwargs)
        return h.on_sdpa(original, args, kwargs, _caller(1))

    return scaled_dot_product_attention


def rope_wrapper(original):
    def rope(*args, **kwargs):
        out = original(*args, **kwargs)
        h = _target()
        if h is not None:
            h.on_rope(out, kwargs.get("offset", 0))
        return out

    return rope


def model_wrapper(original):
    def __call__(model, *args, **kwargs):
        ids = _forward_caches(args, kwargs)
        h = _block_for(model, ids)
        forwards = _tls.__dict__.setdefault("forwards", [])
        forwards.append(h)
        try:
            if h is None:
                return original(model, *args, **kwargs)
            return h.on_forward(original, model, args, kwargs, ids)
        finally:
            forwards.pop()

    return __call__
