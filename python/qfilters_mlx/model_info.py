"""What each layer of an mlx-lm model stores, read from the model itself.

One place for model introspection, shared by the cache builder, calibration and
the evaluation. Nothing here guesses from ``model.args``: the layout comes from

* the caches the model builds for itself (its class's ``make_cache``, else one
  mlx-lm ``KVCache`` per layer), walked into ``CacheList`` entries, and
* a shape probe: one 1-token forward pass with throwaway caches (never
  evaluated: MLX builds the graph lazily, so only shapes are computed), which
  records the ``[B, H_kv, L, D]`` shapes every plain ``KVCache`` slot receives.

This covers wrappers (``text_config`` / ``language_model``), GPT-2 style args,
``.config`` instead of ``.args``, per-layer head widths (``global_head_dim``)
and keys of width ``qk_nope_head_dim + qk_rope_head_dim`` alike. A slot whose
keys are a compressed latent (multi-head latent attention: one "head" of width
``kv_lora_rank``, as in deepseek_v3 or glm4_moe_lite) is marked ``mla``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache

from qfilters_mlx.identity import model_identity  # noqa: F401  (re-exported)

BOUNDED_CACHES = {
    "RotatingKVCache": "sliding window, bounded by the model's window",
    "ArraysCache": "recurrent state, fixed size",
    "MambaCache": "recurrent state, fixed size",
    "ChunkedKVCache": "chunked attention, bounded by the model's chunk",
}
"""Cache classes the builder keeps as they are, and why their memory is bounded."""


@dataclass(frozen=True)
class CacheSlot:
    """One cache of a model's cache list (a top-level entry or a ``CacheList`` member).

    Attributes:
        path: index in the cache list, then indexes inside nested ``CacheList``s.
        cache_type: class name of the model's own cache there.
        n_kv_heads, key_dim, value_dim: ``H_kv`` and ``D`` of the keys and values
            the slot received in the probe (``None`` if not a plain ``KVCache`` or
            never called).
        mla: the keys are a multi-head-latent-attention latent, not per-head keys.
    """

    path: tuple[int, ...]
    cache_type: str
    n_kv_heads: int | None = None
    key_dim: int | None = None
    value_dim: int | None = None
    mla: bool = False

    @property
    def layer(self) -> int:
        """Index of the top-level cache (the layer, for one cache per layer)."""
        return self.path[0]

    @property
    def plain(self) -> bool:
        """A plain ``KVCache`` that received per-head keys: what the builder budgets."""
        return self.cache_type == "KVCache" and self.key_dim is not None and not self.mla

    @property
    def name(self) -> str:
        return ".".join(map(str, self.path))


def default_caches(model) -> list:
    """The caches the model builds for itself (its class's ``make_cache``, else ``KVCache`` per layer).

    The class method is used so that an instance attribute ``model.make_cache``
    set by a previous ``for_model``/``install`` call is not picked up.
    """
    make = getattr(type(model), "make_cache", None)
    if make is not None:
        return list(make(model))
    return [KVCache() for _ in model.layers]


def walk(caches, prefix=()):
    """Yield ``(path, cache)`` for every cache, descending into ``CacheList`` members."""
    for i, c in enumerate(caches):
        if isinstance(c, CacheList):
            yield from walk(c.caches, prefix + (i,))
        else:
            yield prefix + (i,), c


def replace_at(caches: list, path: tuple[int, ...], new) -> None:
    """Put ``new`` at ``path`` (a top-level index, then ``CacheList`` member indexes)."""
    if len(path) == 1:
        caches[path[0]] = new
        return
    inner = caches[path[0]]
    members = list(inner.caches)
    replace_at(members, path[1:], new)
    inner.caches = tuple(members) if isinstance(inner.caches, tuple) else members


class _Probe(KVCache):
    """A ``KVCache`` that records the shapes it receives (isinstance-compatible)."""

    def update_and_fetch(self, keys, values):
        self.seen = (tuple(keys.shape), tuple(values.shape))
        return super().update_and_fetch(keys, values)


def _latent_widths(model) -> set[int]:
    """``kv_lora_rank`` of every module that has one (multi-head latent attention)."""
    widths = set()
    for _, m in model.named_modules():
        r = getattr(m, "kv_lora_rank", None)
        if isinstance(r, int) and not isinstance(r, bool):
            widths.add(r)
    return widths


def probe_layout(model) -> list[CacheSlot]:
    """Every cache slot of ``model`` with what it stores (see the module doc).

    Cost: building (not evaluating) the graph of one 1-token forward pass. The
    model's own caches and parameters are not touched.

    Raises:
        ValueError: the model cannot run a 1-token forward pass with its own
            caches (the error names the cause).
    """
    caches = default_caches(model)
    own = list(walk(caches))
    probes = {}
    for path, c in own:
        if type(c) is KVCache:
            probes[path] = _Probe()
            replace_at(caches, path, probes[path])
    if probes:
        try:
            model(mx.array([[0]], dtype=mx.int32), cache=caches)
        except Exception as err:  # a model that cannot be probed: say so, never guess
            raise ValueError(f"cannot probe {type(model).__module__}.{type(model).__name__}: "
                             f"a 1-token forward pass with its own caches failed "
                             f"({type(err).__name__}: {err})") from err
    latent = _latent_widths(model)
    slots = []
    for path, c in own:
        seen = getattr(probes.get(path), "seen", None)
        if seen is None:
            slots.append(CacheSlot(path, type(c).__name__))
            continue
        (_, hk, _, dk), (_, _, _, dv) = seen
        slots.append(CacheSlot(path, "KVCache", hk, dk, dv, mla=hk == 1 and dk in latent))
    return slots


def budgeted_slots(model) -> list[CacheSlot]:
    """The slots the builder replaces with eviction caches (plain per-head ``KVCache``)."""
    return [s for s in probe_layout(model) if s.plain]


def model_dims(model) -> tuple[int, int, int]:
    """``(n_layers, n_kv_heads, head_dim)`` that a filters file covers.

    A filters file ``[n_layers, n_kv_heads, head_dim]`` covers the budgeted
    attention slots (plain ``KVCache``, see :func:`budgeted_slots`) in cache
    order: for a plain-attention model, every layer. ``head_dim`` is the key width.

    Raises:
        ValueError: no slot is budgeted, or budgeted slots differ in KV heads or
            key width (one tensor cannot hold their filters; use an online filter).
    """
    slots = budgeted_slots(model)
    if not slots:
        raise ValueError("the model has no plain attention layer (per-head keys in a KVCache): "
                         "no filters can be calibrated or applied")
    shapes = {(s.n_kv_heads, s.key_dim) for s in slots}
    if len(shapes) > 1:
        by = {}
        for s in slots:
            by.setdefault((s.n_kv_heads, s.key_dim), []).append(s.name)
        raise ValueError("a filters file [n_layers, n_kv_heads, head_dim] needs one shape for all "
                         "budgeted layers; this model's layers differ "
                         f"({', '.join(f'{k}: layers {v}' for k, v in sorted(by.items()))}): "
                         "use an online filter (no filters file)")
    (n_kv, hd), = shapes
    return len(slots), int(n_kv), int(hd)


def model_head_dim(model) -> int:
    """Key head width of the budgeted layers (see :func:`model_dims`; raises if they differ)."""
    return model_dims(model)[2]


def filters_dims(model) -> tuple[int, int, int]:
    """``(n_layers, n_kv_heads, head_dim)`` of a filters file for ``model``: :func:`model_dims`
    of the whole model, also on one rank of a tensor-parallel model (whose caches hold
    ``n_kv_heads / group size`` of the heads, see :mod:`qfilters_mlx.sharding`)."""
    from qfilters_mlx.sharding import shard_info

    n_layers, n_kv, hd = model_dims(model)
    info = shard_info(model, {n_kv})
    return (n_layers, n_kv, hd) if info is None else (n_layers, info.n_kv_heads, hd)


def check_filters_shape(filters, model) -> None:
    """Check ``filters`` against :func:`filters_dims` (the whole model's heads).

    Raises:
        ValueError: wrong shape (naming the expected one), or a model that no
            filters file can cover.
        TypeError: not floating point.
    """
    want = filters_dims(model)
    if not isinstance(filters, mx.array) or tuple(filters.shape) != want:
        raise ValueError(f"filters must have shape [n_layers, n_kv_heads, head_dim] = {want}, "
                         f"got {getattr(filters, 'shape', type(filters).__name__)}")
    if not mx.issubdtype(filters.dtype, mx.floating):
        raise TypeError(f"filters must be floating point, got {filters.dtype}")
