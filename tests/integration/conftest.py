"""Integration tier: give MLX fast float32 BLAS before anything imports mlx.

MLX's CPU backend only uses OpenBLAS when the library is loaded before the
first ``import mlx.core`` (see ``qfilters_mlx/blas.py``; the package imports
mlx lazily, so importing the helper is safe).

This conftest is imported before any mlx import when pytest runs
``tests/integration`` on its own. In a full run ``tests/conftest.py`` calls
``enable_fast_blas()`` first, before any test folder is collected, which covers every
order; if mlx was imported before either (e.g. by a plugin) the tests still pass,
only slower.
"""

from __future__ import annotations

import pytest

from qfilters_mlx.blas import enable_fast_blas

# Returns the library when loaded now or by an earlier call (e.g. from
# tests/conftest.py); warns (RuntimeWarning) and returns None if mlx came first.
FAST_BLAS = enable_fast_blas()


@pytest.fixture(scope="session")
def model_path():
    """SmolLM2-135M-Instruct prepared in the user cache folder (skipped without the wheel)."""
    from qfilters_mlx.assets.prepare_model import prepare_model

    try:
        return prepare_model()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 not available: {err}")
