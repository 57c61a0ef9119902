"""Interpreter-start hook of qfilters-mlx, run by ``qfilters_mlx.pth`` in site-packages.

It installs :mod:`qfilters_mlx.prompt_cache_hook`'s import finder, so that mlx-lm's
``load_prompt_cache`` (``mlx_lm.generate --prompt-cache-file``) finds our cache classes
in a process that never imports ``qfilters_mlx``. It imports neither ``qfilters_mlx``
nor MLX: it loads the hook's file (standard library only) by path, so the package
is imported only when ``mlx_lm.models.cache`` is, from wherever ``sys.path`` points
then (a process that puts another copy of the package first still gets that copy).
"""

import importlib.util
import os
import sys
import warnings

HOOK_NAME = "_qfilters_mlx_prompt_cache_hook"


def install() -> None:
    spec = importlib.util.find_spec("qfilters_mlx")  # locates the package, imports nothing
    if spec is None or not spec.submodule_search_locations:
        warnings.warn("qfilters_mlx.pth: the qfilters_mlx package is not importable, so mlx-lm "
                      "cannot load its prompt-cache files (reinstall qfilters-mlx)", RuntimeWarning,
                      stacklevel=1)
        return
    path = os.path.join(list(spec.submodule_search_locations)[0], "prompt_cache_hook.py")
    hook_spec = importlib.util.spec_from_file_location(HOOK_NAME, path)
    hook = importlib.util.module_from_spec(hook_spec)
    sys.modules[HOOK_NAME] = hook
    hook_spec.loader.exec_module(hook)
    hook.install()


install()
