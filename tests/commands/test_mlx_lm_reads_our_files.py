"""mlx-lm's own command reads a prompt-cache file written by ``qfilters-mlx cache-prompt`` in a
fresh process that never imports ``qfilters_mlx`` (the ``qfilters_mlx.pth`` startup hook, which
imports neither ``qfilters_mlx`` nor MLX at interpreter start).

The fresh process runs ``python -m mlx_lm generate --prompt-cache-file F`` on a tiny random model
(``tools/tiny_model.py``). Where the package under test is installed (a wheel, ``pip install .``:
``qfilters_mlx.pth`` sits next to it in site-packages) the process starts as any other; for a
source tree on ``PYTHONPATH`` it processes the tree's ``qfilters_mlx.pth`` the way interpreter
start processes site-packages (``site.addsitedir``), and a control process without it fails
naming the class. The reference is the same command run here, where ``qfilters_mlx`` is imported
(saved caches reload bit for bit: tests/cache/test_prompt_cache_files.py): the answer must be the same,
and the prompt it reports must be only the new turn (the cached tokens were not fed again).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx.core as mx
import pytest

import qfilters_mlx
from qfilters_mlx.commands.cli import main as qfilters_main

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(qfilters_mlx.__file__).resolve().parent
# installed (a wheel, `pip install .`) or a source tree on PYTHONPATH (python/ holds the .pth too)
INSTALLED = str(PACKAGE_DIR.parent) in {str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("purelib", "platlib")}
# an installed copy of the package (e.g. an earlier `pip install .`) puts the hook in site-packages
HOOK_IN_ENVIRONMENT = any((Path(sysconfig.get_paths()[k]) / "qfilters_mlx.pth").exists()
                          for k in ("purelib", "platlib"))
QUESTION = "Which number?"
MAX_TOKENS = "5"


def _tiny_model(folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_model", REPO / "tools" / "tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_tiny_model(folder)


def _mlx_lm_generate(cache_file: Path, tmp_path: Path, with_hook: bool) -> subprocess.CompletedProcess:
    argv = ["generate", "--prompt-cache-file", str(cache_file), "--prompt", QUESTION, "--max-tokens", MAX_TOKENS]
    env = dict(os.environ)
    if INSTALLED:
        code = None
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent), env.get("PYTHONPATH", "")])
        site_dir = tmp_path / ("site" if with_hook else "site-without-hook")
        site_dir.mkdir(exist_ok=True)
        if with_hook:
            (site_dir / "qfilters_mlx.pth").write_text((PACKAGE_DIR.parent / "qfilters_mlx.pth").read_text())
        code = (f"import runpy, site, sys; site.addsitedir({str(site_dir)!r}); "
                "assert 'qfilters_mlx' not in sys.modules and 'mlx.core' not in sys.modules; "
                f"sys.argv = ['mlx_lm', *{argv!r}]; "
                "runpy.run_module('mlx_lm', run_name='__main__')")
    cmd = [sys.executable, "-m", "mlx_lm", *argv] if code is None else [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def _answer_and_prompt_tokens(out: str) -> tuple[str, int]:
    m = re.search(r"==========\n(.*)\n==========\nPrompt: (\d+) tokens", out, re.S)
    assert m, out
    return m.group(1), int(m.group(2))


def test_mlx_lm_generate_reads_a_cache_prompt_file_in_a_fresh_process(tmp_path, capsys, monkeypatch):
    model = _tiny_model(tmp_path / "tiny")
    cache_file = tmp_path / "prompt.safetensors"
    prompt = "The number is 7. " + "abc " * 40  # ~180 tokens: past the budget, so the file holds an eviction
    assert qfilters_main(["cache-prompt", "--model", str(model), "--prompt", prompt, "--prompt-cache-file",
                          str(cache_file), "--budget", "32", "--filter-source", "keys"]) == 0
    capsys.readouterr()

    fresh = _mlx_lm_generate(cache_file, tmp_path, with_hook=True)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    answer, prompt_tokens = _answer_and_prompt_tokens(fresh.stdout)

    from mlx_lm.generate import main as mlx_lm_main
    from mlx_lm.models.cache import load_prompt_cache

    caches = load_prompt_cache(str(cache_file))
    assert type(caches[0]).__name__ == "QFiltersKVCache" and caches[0].tokens_seen > caches[0].size() == 32
    # the file is in the saved format 2: a format marker, the build options apart from the config
    meta = json.loads("".join(chr(c) for c in mx.load(str(cache_file))["0.6"].tolist()))
    assert meta["format"] == 2 and "qfilters_backend" not in meta["config"] and "backend" in meta["build"]
    monkeypatch.setattr(sys, "argv", ["mlx_lm.generate", "--prompt-cache-file", str(cache_file),
                                      "--prompt", QUESTION, "--max-tokens", MAX_TOKENS])
    mlx_lm_main()
    ref_answer, ref_prompt_tokens = _answer_and_prompt_tokens(capsys.readouterr().out)
    assert (answer, prompt_tokens) == (ref_answer, ref_prompt_tokens)
    assert prompt_tokens < caches[0].tokens_seen  # only the new turn was fed

    # The control: without the startup hook mlx-lm cannot resolve our class (only possible from a
    # source tree whose environment has no installed copy of the hook).
    if not INSTALLED and not HOOK_IN_ENVIRONMENT:
        control = _mlx_lm_generate(cache_file, tmp_path, with_hook=False)
        assert control.returncode != 0 and "KeyError: 'QFiltersKVCache'" in control.stderr, control.stderr[-3000:]


@pytest.mark.skipif(not INSTALLED, reason="the package under test is a source tree, not installed")
def test_the_startup_hook_is_installed_next_to_the_package():
    site = PACKAGE_DIR.parent
    assert (site / "qfilters_mlx.pth").read_text().strip() == "import _qfilters_mlx_startup"
    assert (site / "_qfilters_mlx_startup.py").is_file()
