"""Importing the package builds, loads and compiles nothing (CASES 9)."""

import subprocess
import sys


def test_import_loads_no_kernel_and_no_mlx():
    code = (
        "import sys, qfilters_mlx\n"
        "import qfilters_mlx.blas\n"
        "bad = [m for m in ('mlx.core', 'qfilters_mlx._ext', 'qfilters_mlx.backends.metal') if m in sys.modules]\n"
        "print(','.join(bad))\n"
        "from qfilters_mlx import KVCacheConfig, QFiltersKVCache\n"
        "c = QFiltersKVCache(KVCacheConfig(qfilters_backend='reference'))\n"
        "print('ext' if 'qfilters_mlx._ext' in sys.modules else 'noext')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    assert lines[0] == ""  # nothing heavy imported by `import qfilters_mlx`
    assert lines[1] == "noext"  # the reference backend never touches the extension
