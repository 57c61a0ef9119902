"""The scorer registry: method name -> :class:`~qfilters_mlx.scorers.base.Scorer` class.

Configs (``KVCacheConfig(method=...)``), saved caches and the command line resolve method
names here; the cache engine holds a scorer object and never compares names.
"""

from __future__ import annotations

from qfilters_mlx.scorers.base import Scorer

__all__ = ["insertion_scores", "register", "scorer_class", "scorer_names", "unregister"]

_SCORERS: dict[str, type[Scorer]] = {}


def register(cls: type[Scorer]) -> type[Scorer]:
    """Register a :class:`Scorer` subclass under ``cls.name`` (usable as a class decorator).

    Raises:
        TypeError: ``cls`` is not a :class:`Scorer` subclass.
        ValueError: an empty name, or the name is taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Scorer)):
        raise TypeError(f"register takes a Scorer subclass, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name:
        raise ValueError(f"{cls.__name__}.name must be a non-empty string")
    if _SCORERS.get(cls.name, cls) is not cls:
        raise ValueError(f"method name {cls.name!r} is already registered by "
                         f"{_SCORERS[cls.name].__name__}")
    _SCORERS[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the scorer registered as ``name`` (configs naming it are refused from then on).

    Raises:
        ValueError: no scorer has that name.
    """
    if _SCORERS.pop(name, None) is None:
        raise ValueError(f"no scorer named {name!r} is registered")


def scorer_names() -> tuple[str, ...]:
    """The registered method names, in registration order (the built-ins first)."""
    return tuple(_SCORERS)


def scorer_class(name: str) -> type[Scorer]:
    """The scorer class registered as ``name``.

    Raises:
        ValueError: no scorer has that name (the message lists the registered ones).
    """
    try:
        return _SCORERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"method must be one of {tuple(_SCORERS)}, got {name!r}") from None


def insertion_scores(method: str, keys, positions, *, filters=None, sign: int = 1, seed: int = 0,
                     layer: int = 0, backend=None, finite: bool = True):
    """Scores ``[B, H_kv, L]`` float32 of new keys ``[B, H_kv, L, D]`` by the scorer named
    ``method`` (:meth:`Scorer.insertion_scores`; ``finite=False``: :meth:`Scorer.scores`, the
    non-finite values kept). ``filters``: ``[H_kv, D]`` for a scorer that reads one.

    Raises:
        ValueError: ``method`` is not registered.
    """
    scorer = scorer_class(method)(layer=layer, sign=sign, seed=seed)
    fn = scorer.insertion_scores if finite else scorer.scores
    return fn(keys, positions, filters, backend)
