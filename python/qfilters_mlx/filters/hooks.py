"""Pair every cache update with the post-RoPE queries of the same attention call.

mlx-lm models have no hook for queries, so :class:`AttentionHooks` patches, for
the duration of a ``with`` block (restored on exit also after an error, once no
other open block holds the same place), the places every attention path passes
through:

1. ``update_and_fetch`` of the watched caches' classes: marks the start of a
   layer's attention call (the layer is the cache's index in the watched list;
   its argument are the post-RoPE keys, its result the keys attention uses);
2. the ``scaled_dot_product_attention`` name in every loaded ``mlx_lm.models.*``
   module and in every module defining a class of the model's submodules (each
   module imported the name from ``mlx_lm.models.base``, so patching ``base``
   alone changes nothing), and ``mx.fast.scaled_dot_product_attention`` (models
   that call it directly, e.g. plamo2): the queries attention actually uses,
   matched to the pending update by its cache argument or by the identity of
   the keys the cache returned;
3. ``mx.fast.rope`` (used by ``nn.RoPE`` and mlx-lm's ``rope_utils``): for
   models whose attention is written inline without SDPA (gemma2's soft-capped
   attention, olmo, ...). When the keys passed to ``update_and_fetch`` are the
   very array an ``mx.fast.rope`` call returned, the most recent earlier rope
   output of the same layer with the same offset and a compatible shape
   ``[B, H_q, L, D]`` (``H_q`` a multiple of ``H_kv``) is the layer's queries;
4. the model class's ``__call__``: which forward passes are watched, and the
   end of one; every watched cache of that call that waits for queries,
   advanced during it and got none for its current offset is then reported
   missing, however it was updated.

The patched names are shared by the whole process, but what they do is scoped
to one model instance: a forward pass is watched only when it is a call of the
block's model (by identity) whose ``cache`` argument holds a watched cache, and
the SDPA, rope and update hooks act only inside such a forward pass in the
thread running it (or, outside every patched forward pass, in the thread that
opened the block: direct cache calls). Every other forward pass (another model
of the same class, another thread, a draft model, the same model with other
caches) runs the original functions with nothing recorded. Blocks in different
threads may be open at the same time, on the same or different models.

Each update is delivered at most once: by an SDPA call as soon as it happens
(exactly what attention uses), else with the rope-derived queries when the
next watched update starts, the model call returns, or the block ends. An
update that got neither is reported as missing. An SDPA call naming a watched
cache whose update bypassed the class method (an instance attribute wrapping
``update_and_fetch``, taken before the hooks were installed) is delivered when
the cache's offset advanced since its last delivery. Unwatched caches and
updates without queries are passed through untouched.
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Callable

import mlx.core as mx

from qfilters_mlx.filters.pairing import Update, cache_leaves, fits, rope_queries

SDPA = "scaled_dot_product_attention"
_registry = threading.Lock()  # guards _points and _open
_points: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [owner, name, had, old, users]
_open: list["AttentionHooks"] = []  # blocks entered and not yet left (any thread)
_tls = threading.local()  # .entered: the block this thread opened; .forwards: forward-pass stack


def _target() -> "AttentionHooks | None":
    """The block the current call belongs to: the innermost forward pass of a
    patched model class in this thread (``None`` when that forward is not
    watched), else, outside any such forward, the block this thread opened."""
    forwards = getattr(_tls, "forwards", None)
    if forwards:
        return forwards[-1]
    return getattr(_tls, "entered", None)


def _forward_caches(args, kwargs) -> set[int]:
    """``id`` of every cache in a forward call's ``cache`` argument (``model(inputs, cache)``)."""
    cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
    return {id(c) for _, c in cache_leaves(cache)} if isinstance(cache, (list, tuple)) else set()


def _block_for(model, ids: set[int]) -> "AttentionHooks | None":
    """The open block watching a forward pass of ``model`` with the caches ``ids``:
    same model instance, and a watched cache among ``ids`` (a block watching no
    caches takes every forward pass of its model)."""
    with _registry:
        blocks = [b for b in _open if b.model is model]
    return next((b for b in blocks if not b._index or ids & b._index.keys()), None)


def _caller(depth: int) -> tuple:
    frame = sys._getframe(depth + 1)
    return frame.f_globals.get("__name__", "?"), frame.f_code


# One wrapper per patch point, shared by every open block: each call is handed to
# the block it belongs to (``_target``) and passes through untouched otherwise.
def _update_wrapper(original):
    def update_and_fetch(cache, *args, **kwargs):
        h = _target()
        if h is None:
            return original(cache, *args, **kwargs)
        return h._on_update(original, cache, args, kwargs, _caller(1))

    return update_and_fetch


def _sdpa_wrapper(original):
    def scaled_dot_product_attention(*args, **kwargs):
        h = _target()
        if h is None:
            return original(*args, **kwargs)
        return h._on_sdpa(original, args, kwargs, _caller(1))

    return scaled_dot_product_attention


def _rope_wrapper(original):
    def rope(*args, **kwargs):
        out = original(*args, **kwargs)
        h = _target()
        if h is not None:
            h._state().window.append((out, kwargs.get("offset", 0)))
        return out

    return rope


def _model_wrapper(original):
    def __call__(model, *args, **kwargs):
        ids = _forward_caches(args, kwargs)
        h = _block_for(model, ids)
        forwards = _tls.__dict__.setdefault("forwards", [])
        forwards.append(h)
        try:
            if h is None:
                return original(model, *args, **kwargs)
            return h._on_forward(original, model, args, kwargs, ids)
        finally:
            forwards.pop()

    return __call__


class _ThreadState:
    def __init__(self):
        self.pending: Update | None = None
        self.window = collections.deque(maxlen=8)  # (rope output, offset) since the last update
        self.sdpa_depth = 0


class AttentionHooks:
    """Context manager installing the hooks (see module docstring).

    Args:
        model: the mlx-lm model (its class's ``__call__`` and the modules of its
            submodules' classes are patched; only this instance's forward passes
            with the watched caches are observed).

    Use :meth:`watch` to choose the caches and the callbacks; it can be called
    again inside the block (e.g. a probe with throwaway caches first).

    Raises:
        RuntimeError: entered while this thread already holds a block (nested use).
    """

    def __init__(self, model):
        self.model = model
        self._index: dict[int, tuple[tuple, Any]] = {}
        self._deliver: Callable | None = None
        self._missing: Callable | None = None
        self._unpaired: Callable | None = None
        self._wants: Callable | None = None
        self._held: list[tuple[int, str]] = []  # patch points this block holds
        self._local = threading.local()
        self._states: list[_ThreadState] = []
        self._states_lock = threading.Lock()
        self._delivered_at: dict[int, int] = {}  # id(cache) -> its offset when last delivered

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "AttentionHooks":
        if getattr(_tls, "entered", None) is not None:
            raise RuntimeError("observe_queries / capture_attention is already active in this thread: "
                               "nested use is not supported (close the outer block first)")
        with _registry:
            try:
                self._install()
            except BaseException:
                self._release()
                raise
            _open.append(self)
        _tls.entered = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            with _registry:
                if self in _open:
                    _open.remove(self)
                self._release()
            self._index.clear()
            self._states.clear()
            if getattr(_tls, "entered", None) is self:
                _tls.entered = None

    def _release(self) -> None:
        """Drop this block's hold on its patch points; restore those nobody holds (under ``_registry``)."""
        for key in reversed(self._held):
            point = _points[key]
            point[4] -= 1
            if point[4] == 0:
                owner, name, had, old, _ = _points.pop(key)
                if had:
                    setattr(owner, name, old)
                else:
                    delattr(owner, name)
        self._held.clear()

    def _patch(self, owner, name: str, make: Callable[[Callable], Callable]) -> None:
        """Hold the patch point ``owner.name``, installing ``make(original)`` if no block holds it."""
        key = (id(owner), name)
        point = _points.get(key)
        if point is None:
            had = name in vars(owner)
            old = vars(owner).get(name)
            original = getattr(owner, name)
            setattr(owner, name, make(original))
            point = _points[key] = [owner, name, had, old, 0]
        point[4] += 1
        self._held.append(key)

    def _install(self) -> None:
        mods = {n for n in sys.modules if n.startswith("mlx_lm.models.")}
        mods.update(type(m).__module__ for _, m in self.model.named_modules())
        for name in sorted(mods):
            mod = sys.modules.get(name)
            if mod is not None and callable(vars(mod).get(SDPA)):
                self._patch(mod, SDPA, _sdpa_wrapper)
        self._patch(mx.fast, SDPA, _sdpa_wrapper)
        self._patch(mx.fast, "rope", _rope_wrapper)
        self._patch(type(self.model), "__call__", _model_wrapper)

    # ---------------------------------------------------------------- watching
    def watch(self, caches, deliver: Callable | None = None, missing: Callable | None = None,
              unpaired: Callable | None = None, wants: Callable | None = None) -> None:
        """Watch ``caches`` (flushes what was pending for the previous ones).

        Args:
            caches: per-layer cache list the model is called with (``CacheList``
                entries are watched individually).
            deliver: ``deliver(update: Update, queries [B, H_q, L, D])``, once per update.
            missing: ``missing(update)`` for an update that got no queries.
            unpaired: ``unpaired(queries, keys)`` for SDPA calls that match no
                update (only the outermost of nested SDPA calls).
            wants: ``wants(cache) -> bool`` checked before each update; ``False``
                passes the update through unobserved (no per-call cost once
                every cache has its filter). Default: every update is observed.
        """
        self.flush()
        self._index = {id(c): (p, c) for p, c in cache_leaves(caches)}
        self._delivered_at = {}
        self._deliver, self._missing, self._unpaired, self._wants = deliver, missing, unpaired, wants
        with _registry:
            for _, c in self._index.values():
                owner = next((k for k in type(c).__mro__ if "update_and_fetch" in vars(k)), None)
                if owner is not None and (id(owner), "update_and_fetch") not in self._held:
                    self._patch(owner, "update_and_fetch", _update_wrapper)

    def flush(self) -> None:
        """Deliver or report every pending update (all threads)."""
        with self._states_lock:
            states = list(self._states)
        for st in states:
            self._flush(st)

    def _state(self) -> _ThreadState:
        st = getattr(self._local, "st", None)
        if st is None:
            st = self._local.st = _ThreadState()
            with self._states_lock:
                self._states.append(st)
        return st

    def _flush(self, st: _ThreadState) -> None:
        u, st.pending = st.pending, None
        if u is None or u.delivered:
            return
        if u.rope_queries is not None:
            self._send(u, u.rope_queries)
        elif self._missing is not None:
            self._missing(u)

    def _send(self, u: Update, queries) -> None:
        u.delivered = True
        offset = getattr(u.cache, "offset", None)
        if isinstance(offset, int):
            self._delivered_at[id(u.cache)] = offset
        if self._deliver is not None:
            self._deliver(u, queries)

    # ---------------------------------------------------------------- calls handed over by the wrappers
    def _on_update(self, original, cache, args, kwargs, caller):
        entry = self._index.get(id(cache))
        if entry is None or entry[1] is not cache:
            return original(cache, *args, **kwargs)
        st = self._state()
        self._flush(st)  # the previous layer's attention is done
        if self._wants is not None and not self._wants(cache):
            st.window.clear()
            return original(cache, *args, **kwargs)
        keys = args[0] if args else kwargs.get("keys")
        window = list(st.window)
        st.window.clear()
        out = original(cache, *args, **kwargs)
        keys_out = out[0] if isinstance(out, (tuple, list)) and out else None
        path = entry[0]
        st.pending = Update(path[0], path, cache, keys, keys_out, rope_queries(window, keys), caller)
        return out

    def _on_sdpa(self, original, args, kwargs, caller):
        queries = args[0] if args else kwargs.get("queries", kwargs.get("q"))
        keys = args[1] if len(args) > 1 else kwargs.get("keys", kwargs.get("k"))
        cache = args[3] if len(args) > 3 else kwargs.get("cache")
        st = self._state()
        u = st.pending
        if u is not None and not u.delivered and (
                (cache is not None and cache is u.cache) or (keys is not None and keys is u.keys_out)):
            if fits(queries, u.keys_in):
                self._send(u, queries)
        else:
            if cache is not None and (u is None or u.cache is not cache):
                self._bypassed(cache, queries, keys, caller)
            if st.sdpa_depth == 0 and self._unpaired is not None:
                self._unpaired(queries, keys)
        st.sdpa_depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            st.sdpa_depth -= 1

    def _on_forward(self, original, model, args, kwargs, ids: set[int]):
        before = {k: v for k, v in self._offsets().items() if k in ids}
        try:
            out = original(model, *args, **kwargs)
        except BaseException:
            self._state().pending = None  # the forward failed: nothing to report
            raise
        self._flush(self._state())
        self._check_advanced(before)
        return out

    def _offsets(self) -> dict[int, int]:
        """Offsets of the watched caches that want queries (only with ``wants``)."""
        if self._wants is None or self._missing is None:
            return {}
        return {k: c.offset for k, (_, c) in self._index.items()
                if isinstance(getattr(c, "offset", None), int) and self._wants(c)}

    def _check_advanced(self, before: dict[int, int]) -> None:
        """End of a forward: a cache that wants queries, advanced during it and got
        none for its current offset is reported missing, however it was updated."""
        for key, offset in before.items():
            path, c = self._index.get(key, (None, None))
            if c is None or c.offset == offset or self._delivered_at.get(key) == c.offset:
                continue
            if self._wants(c):
                self._missing(Update(path[0], path, c, None, None, None,
                                     ("(an update_and_fetch the hooks did not see)", None)))

    def _bypassed(self, cache, queries, keys, caller) -> None:
        """An SDPA call names a watched cache whose update did not go through the
        class's ``update_and_fetch`` (e.g. an instance attribute wrapping the method
        taken before the hooks were installed): deliver once per new offset
        (layers reusing another layer's keys without an update deliver nothing)."""
        entry = self._index.get(id(cache))
        offset = getattr(cache, "offset", None)
        if entry is None or entry[1] is not cache or not isinstance(offset, int):
            return
        if self._wants is not None and not self._wants(cache):
            return
        if self._delivered_at.get(id(cache)) == offset or not fits(queries, keys, same_length=False):
            return
        path = entry[0]
        self._send(Update(path[0], path, cache, None, keys, None, caller), queries)
