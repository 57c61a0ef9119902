"""Let mlx-lm's ``load_prompt_cache`` find our cache classes in any process.

``mlx_lm.models.cache.load_prompt_cache`` resolves each saved cache class with
``globals()[name]`` in its own module, so ``QFiltersKVCache``,
``QuantizedQFiltersKVCache``, ``BatchQFiltersCache`` and ``HeadGroupsKVCache`` must be attributes of
``mlx_lm.models.cache``. Our cache modules add them when they are imported; this
module makes that happen as soon as ``mlx_lm.models.cache`` is imported (or at once
if it already is), without importing MLX itself: a finder on ``sys.meta_path`` wraps
the loader of ``mlx_lm.models.cache`` and imports our cache modules right after
mlx-lm's has run. Nothing else in mlx-lm changes.

Two callers install it: ``import qfilters_mlx``, and, in an installed package, the
``qfilters_mlx.pth`` startup file (through ``_qfilters_mlx_startup``), so that a
process that never imports ``qfilters_mlx`` (``mlx_lm.generate --prompt-cache-file``)
still reads files written by ``qfilters-mlx cache-prompt``. This module imports only
the standard library, so the startup file can load it without importing the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

TARGET = "mlx_lm.models.cache"
# importing each registers its classes in mlx_lm.models.cache
OUR_MODULES = ("qfilters_mlx.cache.kv_cache", "qfilters_mlx.cache.batch", "qfilters_mlx.cache.head_groups")
MARKER = "_registers_qfilters_mlx_caches"


def _register(partial_ok: bool = False) -> bool:
    """Import our cache modules (they register their classes); ``True`` when all are. A failure
    here must not break ``import mlx_lm.models.cache`` for every mlx-lm command in the
    environment: it is reported as a warning naming the package, and only our saved caches stay
    unreadable. ``partial_ok``: a module of ours still being imported (``mlx_lm`` imported from
    inside it, e.g. ``import qfilters_mlx.model_info`` first) is no failure: the classes are
    registered at the first ``load_prompt_cache`` instead (:func:`_registering`)."""
    for name in OUR_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure of ours, reported
            if partial_ok and isinstance(err, ImportError) and "partially initialized" in str(err):
                return False
            import warnings

            warnings.warn(f"qfilters-mlx: could not register its cache classes with mlx-lm "
                          f"({name}: {type(err).__name__}: {err}); prompt-cache files written "
                          "by qfilters-mlx will not load in this process", RuntimeWarning,
                          stacklevel=2)
            return False
    return True


def _registering(load):
    """mlx-lm's ``load_prompt_cache`` registering our classes first (idempotent), so that a file
    of ours loads even when the registration at import time met a half-imported module."""
    if getattr(load, MARKER, False):
        return load

    def load_prompt_cache(*args, **kwargs):
        _register()
        return load(*args, **kwargs)

    load_prompt_cache.__doc__, load_prompt_cache.__wrapped__ = load.__doc__, load
    setattr(load_prompt_cache, MARKER, True)
    return load_prompt_cache


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``mlx_lm.models.cache``, then registers our classes."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.load_prompt_cache = _registering(module.load_prompt_cache)
        _register(partial_ok=True)

    def __getattr__(self, name):  # get_code, get_source, ... of the real loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``mlx_lm.models.cache`` with the other finders and wraps its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if getattr(finder, MARKER, False) or not hasattr(finder, "find_spec"):
                continue  # this finder, or the same one installed by the other caller
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


setattr(_Finder, MARKER, True)


def install() -> None:
    """Register now if ``mlx_lm.models.cache`` is imported, else when it is (idempotent,
    also across the two callers, which may hold two copies of this module)."""
    if TARGET in sys.modules:
        module = sys.modules[TARGET]
        module.load_prompt_cache = _registering(module.load_prompt_cache)
        _register()
        return
    if not any(getattr(f, MARKER, False) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
