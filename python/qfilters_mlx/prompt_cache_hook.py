"""Let mlx-lm's ``load_prompt_cache`` find ``QFiltersKVCache`` after ``import qfilters_mlx``.

``mlx_lm.models.cache.load_prompt_cache`` resolves each saved cache class with
``globals()[name]`` in its own module, so the class must be an attribute of
``mlx_lm.models.cache``. :mod:`qfilters_mlx.cache.kv_cache` adds it when it is
imported; this module makes that happen as soon as ``mlx_lm.models.cache`` is
imported (or at once if it already is), without importing MLX itself: a finder
on ``sys.meta_path`` wraps the loader of ``mlx_lm.models.cache`` and imports our
cache module right after mlx-lm's has run. Nothing else in mlx-lm changes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

TARGET = "mlx_lm.models.cache"
OUR_MODULE = "qfilters_mlx.cache.kv_cache"


def _register() -> None:
    importlib.import_module(OUR_MODULE)  # sets mlx_lm.models.cache.QFiltersKVCache


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``mlx_lm.models.cache``, then registers our class."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # get_code, get_source, ... of the real loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``mlx_lm.models.cache`` with the other finders and wraps its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now if ``mlx_lm.models.cache`` is imported, else when it is (idempotent)."""
    if TARGET in sys.modules:
        _register()
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
