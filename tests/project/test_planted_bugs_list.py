"""The planted-bug list of ``tools/planted_bugs.py`` stays true to the source:
every ``old`` snippet occurs exactly once in its file of ``python/qfilters_mlx``, the
planted file still parses (the bug is a wrong rule, not a syntax error), every named
test exists, and the five kinds of fault are all covered. No pytest run inside: the
planted runs themselves are ``python tools/planted_bugs.py`` (not in CI).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "python" / "qfilters_mlx"


def load_tool():
    spec = importlib.util.spec_from_file_location("planted_bugs", REPO / "tools" / "planted_bugs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = load_tool()
BUGS = TOOL.BUGS


def test_names_are_unique_and_every_kind_is_covered():
    names = [b["name"] for b in BUGS]
    assert len(names) == len(set(names))
    assert {b["kind"] for b in BUGS} == {1, 2, 3, 4, 5}
    for b in BUGS:
        assert set(b) == {"name", "kind", "file", "what", "old", "new", "tests"}, b["name"]
        assert b["old"] != b["new"] and b["tests"], b["name"]


@pytest.mark.parametrize("bug", BUGS, ids=[b["name"] for b in BUGS])
def test_old_snippet_occurs_exactly_once_and_the_planted_file_parses(bug):
    path = PACKAGE / bug["file"]
    assert path.is_file(), f"{bug['name']}: no {path}"
    text = path.read_text()
    assert text.count(bug["old"]) == 1, (
        f"{bug['name']}: 'old' occurs {text.count(bug['old'])} times in {bug['file']}: "
        "update BUGS in tools/planted_bugs.py")
    planted = text.replace(bug["old"], bug["new"])
    assert planted != text
    ast.parse(planted, str(path))
    assert TOOL.planted_source(bug) == planted


@pytest.mark.parametrize("bug", BUGS, ids=[b["name"] for b in BUGS])
def test_named_tests_exist(bug):
    for test in bug["tests"]:
        file, _, node = test.partition("::")
        path = REPO / file
        assert path.is_file(), f"{bug['name']}: no {file}"
        if node:
            func = node.split("[")[0].split("::")[-1]
            assert re.search(rf"^\s*def {re.escape(func)}\(", path.read_text(), re.M), \
                f"{bug['name']}: no test {func} in {file}"


@pytest.mark.parametrize("copies", [0, 2])
def test_a_rotten_entry_is_refused_before_anything_runs(tmp_path, copies):
    bug = dict(BUGS[0], file="m.py")
    (tmp_path / "m.py").write_text("x = 1\n" + bug["old"] * copies)
    with pytest.raises(ValueError, match=rf"^{bug['name']}: 'old' occurs {copies} times in "):
        TOOL.planted_source(bug, tmp_path)
