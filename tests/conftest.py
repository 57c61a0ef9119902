import os
import sys

# Load OpenBLAS before anything imports MLX (float32 matmul ~40x faster on Linux;
# see qfilters_mlx/blas.py). Conftest modules are imported before test modules.
from qfilters_mlx.blas import enable_fast_blas

enable_fast_blas()

# Tests import the shared helpers (tests/helpers/: `from helpers.oracle import ...`) from this
# folder; a test module imports another of its own folder by name (pytest puts the folder on
# sys.path).
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def qfilters_home(tmp_path_factory):
    """Tests never write to the user's cache: ``QFILTERS_MLX_HOME`` is a folder of this session
    (subprocesses inherit it), where the default filters are stored once per model; its
    ``models`` links to the user's, so the prepared SmolLM2 is still found. A test that needs an
    empty cache sets ``QFILTERS_MLX_HOME`` again (``monkeypatch``)."""
    from qfilters_mlx.assets.prepare_model import cache_root

    models = cache_root() / "models"
    home = tmp_path_factory.mktemp("qfilters_mlx_home")
    (home / "models").symlink_to(models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QFILTERS_MLX_HOME", str(home))
        yield home
