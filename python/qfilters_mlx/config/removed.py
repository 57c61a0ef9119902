"""The configuration spellings of 0.1 that 0.3.0 removed, and what each is now.

:class:`~qfilters_mlx.config.KVCacheConfig` refuses them with ``TypeError`` naming the new
spelling (:func:`refuse_removed`), and reading one of them from a configuration raises
``AttributeError`` naming where the value is now (:func:`missing_attribute`); saved prompt
caches of format 1, which store them, are read through
:func:`qfilters_mlx.config.state.from_format1` (the table :data:`REMOVED` says where each value
went).
"""

from __future__ import annotations

MODE, BUILD = "mode", "build"

REMOVED = {
    "qfilters_mode": (MODE, "name"),
    "qfilters_compression_ratio": (MODE, "ratio"),
    "qfilters_growth": (MODE, "growth"),
    "qfilters_compress_at": (MODE, "at"),
    "qfilters_backend": (BUILD, "backend"),
    "qfilters_max_rewind": (BUILD, "max_rewind"),
    "kv_bits": (BUILD, "kv_bits"),
    "kv_group_size": (BUILD, "kv_group_size"),
}
"""Removed field -> ``(part, name)``: ``("mode", f)`` is field ``f`` of the mode
(:class:`CompressOnce`; ``"name"``: the mode's class), ``("build", k)`` the build keyword ``k``
of ``KVCacheBuilder(...)``, ``for_model``, ``install`` and the cache constructors."""

_BUILT_WHERE = ("(KVCacheBuilder(...), KVCacheBuilder.for_model, KVCacheBuilder.install, the cache "
                "constructors)")


def new_spelling(old: str) -> str:
    """How the removed field ``old`` (a key of :data:`REMOVED`) is written now."""
    part, name = REMOVED[old]
    if part == BUILD:
        return f"the keyword {name}= where the caches are built {_BUILT_WHERE}"
    if name == "name":
        return "mode=Streaming() (the default) or mode=CompressOnce(...)"
    return f"mode=CompressOnce({name}=...)"


def refuse_removed(keywords) -> None:
    """Raise ``TypeError`` naming each removed spelling among ``keywords`` and its new one.

    Raises:
        TypeError: ``keywords`` holds a key of :data:`REMOVED`.
    """
    given = [k for k in keywords if k in REMOVED]
    if given:
        uses = "; ".join(f"{k}: use {new_spelling(k)}" for k in given)
        raise TypeError(f"KVCacheConfig got removed keyword arguments {given} (the 0.1 spellings, "
                        f"removed in 0.3.0): {uses}")


_READ_FROM = {"backend": "cache.backend.name", "max_rewind": "cache.max_rewind",
              "kv_bits": "cache.bits", "kv_group_size": "cache.group_size"}
"""Build option -> where a built cache holds it."""


def missing_attribute(owner: str, name: str) -> AttributeError:
    """The error of reading attribute ``name`` that a ``owner`` (a class name) does not have:
    for a key of :data:`REMOVED`, it names where the value is read now.

    Returns:
        AttributeError: to raise.
    """
    if name not in REMOVED:
        return AttributeError(f"{owner!r} object has no attribute {name!r}")
    part, new = REMOVED[name]
    now = (f"config.mode.{new}" if part == MODE else
           f"{_READ_FROM[new]} of a built cache (the build option {new}=)")
    return AttributeError(f"{owner}.{name} was removed in 0.3.0 (a 0.1/0.2 spelling): read {now}")
