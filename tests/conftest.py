import os
import sys

# Load OpenBLAS before anything imports MLX (float32 matmul ~40x faster on Linux;
# see qfilters_mlx/blas.py). Conftest modules are imported before test modules.
from qfilters_mlx.blas import enable_fast_blas

enable_fast_blas()

# Tests import the oracle module from this folder.
sys.path.insert(0, os.path.dirname(__file__))
