"""Smoke test of an installed qfilters-mlx (a built wheel in a fresh virtual environment).

Run it with the environment's Python from outside the source tree (``.ci/wheel`` does)::

    /tmp/venv/bin/python tools/wheel_smoke.py

It checks what ``pip install`` gives a user, without network: the package imports from
that environment (not from a source tree) at the version its metadata states; the
compiled extension loads and its eviction keeps exactly the positions of the pure-MLX
reference; the Metal kernel sources (and, with ``QFILTERS_EXPECT_METALLIB=1``, the
metallib) are installed; the startup hook ``qfilters_mlx.pth`` sits in site-packages;
the console script answers ``--version`` and generates with a tiny random model written
to a temporary folder (``tools/tiny_model.py``); and ``mlx_lm.generate
--prompt-cache-file`` answers from a file written by ``qfilters-mlx cache-prompt`` in a
process that never imports ``qfilters_mlx``. Exits non-zero naming the first failure.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from tiny_model import write_tiny_model

BIN = Path(sys.executable).parent


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"wheel smoke test failed: {what}")
    print(f"ok: {what}")


def run(*argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        check(False, f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    import qfilters_mlx

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    pkg = Path(qfilters_mlx.__file__).resolve().parent
    check(pkg.parent == site, f"qfilters_mlx imported from the environment ({pkg})")
    version = importlib.metadata.version("qfilters-mlx")
    check(qfilters_mlx.__version__ == version, f"__version__ {qfilters_mlx.__version__} = metadata {version}")
    check((site / "qfilters_mlx.pth").is_file() and (site / "_qfilters_mlx_startup.py").is_file(),
          "the startup hook qfilters_mlx.pth is in site-packages")
    for name in ("metal/qfilters.h", "metal/qfilters.metal"):
        check((pkg / name).is_file(), f"package data {name}")
    from qfilters_mlx import _ext

    if os.environ.get("QFILTERS_EXPECT_METALLIB") == "1":
        check(_ext.metal_library_path() is not None, "the metallib is installed next to the extension")

    import mlx.core as mx
    import numpy as np

    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((1, 2, 96, 16)).astype(np.float32))
    kept = {}
    for backend in ("reference", "cpp"):
        cache = QFiltersKVCache(KVCacheConfig(qfilters_budget=32, qfilters_n_sink=2, qfilters_recent=8,
                                              qfilters_calib_tokens=16, qfilters_filter_source="keys"),
                                backend=backend)
        cache.update_and_fetch(keys, keys)
        kept[backend] = np.array(cache.kept_positions())
    check(kept["cpp"].shape == (1, 2, 32) and np.array_equal(kept["cpp"], kept["reference"]),
          "the C++ extension keeps the reference backend's positions")

    cli = str(BIN / "qfilters-mlx")
    out = run(cli, "--version")  # argparse's version action
    check(out.strip() == f"qfilters-mlx {version}", f"qfilters-mlx --version prints {out.strip()!r}")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny"))
        prompt = "The number is 7. " + "abc " * 40
        out = run(cli, "generate", "--model", model, "--prompt", prompt, "--max-tokens", "4",
                  "--budget", "32", "--filter-source", "keys")
        check("KV bytes" in out, "qfilters-mlx generate with a tiny model prints its summary")
        cache_file = str(Path(tmp) / "prompt.safetensors")
        run(cli, "cache-prompt", "--model", model, "--prompt", prompt, "--prompt-cache-file", cache_file,
            "--budget", "32", "--filter-source", "keys")
        out = run(str(BIN / "mlx_lm.generate"), "--prompt-cache-file", cache_file, "--prompt", "Which?",
                  "--max-tokens", "3")
        check("Generation:" in out,
              "mlx_lm.generate --prompt-cache-file reads a file written by qfilters-mlx cache-prompt")
    print("wheel smoke test passed")


if __name__ == "__main__":
    main()
