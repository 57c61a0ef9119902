"""Importing the package builds, loads and compiles nothing."""

import subprocess
import sys

import pytest


def test_import_loads_no_kernel_and_no_mlx():
    code = (
        "import sys, qfilters_mlx\n"
        "import qfilters_mlx.blas\n"
        "bad = [m for m in ('mlx.core', 'qfilters_mlx._ext', 'qfilters_mlx.backends.metal') if m in sys.modules]\n"
        "print(','.join(bad))\n"
        "from qfilters_mlx import KVCacheConfig, QFiltersKVCache\n"
        "c = QFiltersKVCache(KVCacheConfig(qfilters_filter_source='keys'), backend='reference')\n"
        "print('ext' if 'qfilters_mlx._ext' in sys.modules else 'noext')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    assert lines[0] == ""  # nothing heavy imported by `import qfilters_mlx`
    assert lines[1] == "noext"  # the reference backend never touches the extension


def _modules_importing_mlx_lm() -> list[str]:
    """Package modules whose top level imports ``mlx_lm`` or ``qfilters_mlx.model_info``
    (which does): the ones an import cycle through the prompt-cache hook can reach."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "python"
    out = []
    for path in sorted((root / "qfilters_mlx").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
        if any(x.startswith("mlx_lm") or x == "qfilters_mlx.model_info" for x in names):
            rel = path.relative_to(root).with_suffix("")
            out.append(".".join(rel.parts).removesuffix(".__init__"))
    return out


def test_every_module_importing_mlx_lm_imports_first_in_a_fresh_interpreter(tmp_path):
    """``import qfilters_mlx.model_info`` (or evaluation.run, cache.kv_cache, ...) as the very
    first import: mlx_lm's import runs the prompt-cache hook, which must not need a half-imported
    module, and mlx-lm's ``load_prompt_cache`` then reads our files (no warning either)."""
    mods = _modules_importing_mlx_lm()
    assert "qfilters_mlx.model_info" in mods and "qfilters_mlx.evaluation.run" in mods
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    cfg = KVCacheConfig(qfilters_filter_source="keys", qfilters_budget=8, qfilters_n_sink=1,
                        qfilters_recent=2, qfilters_calib_tokens=2, head_dim=4)
    c = QFiltersKVCache(cfg)
    c.update_and_fetch(mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4)))
    path = tmp_path / "saved.safetensors"
    save_prompt_cache(str(path), [c])
    check = (f"from mlx_lm.models.cache import load_prompt_cache; "
             f"assert [type(x).__name__ for x in load_prompt_cache({str(path)!r})] == ['QFiltersKVCache']")
    for m in mods:
        # (a registration that fails only warns: made an error here; the file loads, in a
        # process that imported no cache module of ours itself)
        res = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", f"import {m}; {check}"],
                             capture_output=True, text=True)
        assert res.returncode == 0, f"import {m} first: {res.stderr[-800:]}"


def test_a_failing_registration_warns_instead_of_breaking_mlx_lm(monkeypatch):
    """The startup hook runs inside ``import mlx_lm.models.cache`` in every process of an
    environment with the package installed: an import failure of ours must not propagate."""
    from qfilters_mlx import prompt_cache_hook

    monkeypatch.setattr(prompt_cache_hook, "OUR_MODULES", ("qfilters_mlx.no_such_module",))
    with pytest.warns(RuntimeWarning, match="qfilters_mlx.no_such_module.*will not load"):
        prompt_cache_hook._register()
