"""tools/mkdocs_hooks.py: links of README.md and docs/ to repository files are checked and
rewritten to where the site puts those files (rules of the module docstring, written out);
every Python block of the documents compiles (tests/integration/test_readme.py runs them)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    pytest.importorskip("mkdocs")  # the docs extra
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "tools" / "mkdocs_hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "REPO", tmp_path)
    monkeypatch.setattr(mod, "DOCS", tmp_path / "docs")
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "r.md").write_text("# results\n")
    (tmp_path / "README.md").write_text("[page](docs/a.md) [r](bench/r.md#x) [web](https://example.org/a.md)\n")
    return mod


def page(path: Path, src_uri: str):
    return SimpleNamespace(file=SimpleNamespace(abs_src_path=str(path), src_uri=src_uri))


def test_links_are_rewritten_to_the_site_layout(hooks, tmp_path):
    a = tmp_path / "docs" / "a.md"
    a.write_text("x")
    text = ("See [r](../bench/r.md), ![p](../bench/r.md#t) and [b](a.md#h).\n"
            "```python\nf = d[0](../nope.md)\n```\n")
    out = hooks.on_page_markdown(text, page(a, "a.md"), None, None)
    assert out == ("See [r](repo/bench/r.md), ![p](repo/bench/r.md#t) and [b](a.md#h).\n"
                   "```python\nf = d[0](../nope.md)\n```\n")  # fenced code untouched
    readme = tmp_path / "README.md"
    out = hooks.on_page_markdown(readme.read_text(), page(readme, "index.md"), None, None)
    assert out == "[page](a.md) [r](repo/bench/r.md#x) [web](https://example.org/a.md)\n"
    # a copied Markdown file (repo/bench/r.md) linking back into docs/
    out = hooks.on_page_markdown("[a](../docs/a.md)", page(tmp_path / "bench" / "r.md", "repo/bench/r.md"),
                                 None, None)
    assert out == "[a](../../a.md)"


def test_linked_files_are_found_and_a_missing_one_is_named(hooks, tmp_path):
    from mkdocs.exceptions import PluginError

    a = tmp_path / "docs" / "a.md"
    a.write_text("[r](../bench/r.md) [w](https://x.org)\n```\n[n](missing.md)\n```\n")
    assert hooks._linked(a) == [tmp_path / "bench" / "r.md"]
    a.write_text("fine [r](../bench/r.md), broken [n](../bench/gone.md)\n")
    with pytest.raises(PluginError, match=r"docs/a.md: the link '../bench/gone.md'"):
        hooks._linked(a)


def test_every_python_block_of_the_documents_compiles():
    """The fast tier's share of tests/integration/test_readme.py (which runs the blocks): syntax."""
    spec = importlib.util.spec_from_file_location("doc_blocks", REPO / "tests" / "integration" / "test_readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    found = mod.blocks("python")
    assert {p.name for p, _ in found} >= {"README.md", "getting-started.md", "method.md", "serving.md"}
    for path, block in found:
        compile(block, str(path), "exec")
