"""The code blocks of README.md and of the pages of docs/ run as written: the ```python blocks
in order in one namespace (README first, then the pages in the site's order: a later block
continues an earlier one, as a reader would), and every `qfilters-mlx` command line of the
```bash blocks in the same order, in a temporary folder, through the console script's `main`.
```console blocks are shown, not run (commands that do not return, launchers, placeholders).

Skipped: `bash .ci/...` (the setup this test runs inside) and `qfilters-mlx eval`
(tests/integration/test_eval_quick.py runs it). Generation lengths are the documents' own
(every generate line there has --max-tokens <= 24).
"""

from __future__ import annotations

import re
import shlex
import textwrap
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# the site's order (mkdocs.yml's nav); every page of docs/ is listed
PAGES = ["getting-started", "method", "configuration", "mlx-lm", "serving", "compress-once", "head-groups", "quantized",
         "distributed", "evaluation", "models", "performance", "kernels", "testing", "api"]
DOCUMENTS = [REPO / "README.md", *(REPO / "docs" / f"{p}.md" for p in PAGES)]
MAX_TOKENS = 24


def blocks(language: str, documents=DOCUMENTS) -> list[tuple[Path, str]]:
    """``(file, block)`` for the fenced blocks of ``language`` (indented ones inside list items
    too, dedented), in reading order."""
    out = []
    for path in documents:
        found = re.findall(rf"^( *)```{language}\n(.*?)^\1```", path.read_text(encoding="utf-8"),
                           re.MULTILINE | re.DOTALL)
        out += [(path, textwrap.dedent(body)) for _, body in found]
    return out


def commands() -> list[list[str]]:
    """Every `qfilters-mlx` invocation of the bash blocks, as argv lists without the program."""
    out = []
    for _, block in blocks("bash"):
        for line in block.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words and words[0].endswith("qfilters-mlx"):
                    out.append(words[1:])
    return out


def test_documents_have_the_blocks_this_test_runs():
    assert sorted(PAGES) == sorted(p.stem for p in (REPO / "docs").glob("*.md"))
    cmds = commands()
    assert cmds[0][:2] == ["generate", "--compare"]  # the front page's first command shows the table
    assert any(c[:1] == ["cache-prompt"] for c in cmds)
    python = blocks("python")
    assert python[0][0].name == "README.md" and len(python) >= 5
    for argv in cmds:
        if argv[:1] == ["generate"]:
            assert "--max-tokens" in argv and int(argv[argv.index("--max-tokens") + 1]) <= MAX_TOKENS


def test_python_blocks_run_as_written(model_path, capsys):
    namespace: dict = {"__name__": "__readme__"}
    for path, block in blocks("python"):
        with warnings.catch_warnings():
            # enable_fast_blas() after pytest imported mlx only warns; the conftest loaded OpenBLAS
            warnings.simplefilter("ignore", RuntimeWarning)
            exec(compile(block, str(path), "exec"), namespace)  # noqa: S102
    caches = namespace["caches"]
    config = namespace["config"]
    from qfilters_mlx import KVCacheConfig

    assert config == KVCacheConfig()
    assert caches[0].tokens_seen > caches[0].size()  # the example evicts
    assert capsys.readouterr().out.count("->") == 2  # the chat recipe answered both turns


def test_command_lines_run_as_written(model_path, tmp_path, monkeypatch, capsys):
    from qfilters_mlx.commands.cli import main

    monkeypatch.chdir(tmp_path)
    ran = 0
    for argv in commands():
        if argv[:1] == ["eval"]:
            continue
        try:
            status = main(argv)
        except SystemExit as exc:  # --version exits 0 through argparse
            status = exc.code
        assert status == 0, argv
        ran += 1
    out = capsys.readouterr().out
    assert "| full " in out and "key found" in out  # the comparison table on the shipped prompt
    assert ran >= 8
