"""The package's layout rules, read from the sources with ``ast`` (nothing is imported):

* no import cycle between the package's modules; module-level and function-level
  imports both count (a function-level import still ties the two modules together);
  ``from qfilters_mlx.x import y`` is an edge to ``x``, and to ``x.y`` when that is a
  module; relative imports are resolved; the lazy exports of ``__init__.py``
  (``import_module`` strings) are not imports;
* no module uses another module's ``_private`` name, neither imported
  (``from m import _name``) nor reached as an attribute of an imported module
  (``m._name``); dunder names are public, and ``qfilters_mlx._ext``, the compiled
  extension, is allowed;
* no import cycle between the package's folders either (a module of a subpackage belongs to its
  first-level folder, ``qfilters_mlx.cache.batch`` to ``cache``; a top-level module is a folder
  of its own), and a folder imports only the folders below it in :data:`LAYERS`;
* no module over 350 lines unless its docstring says why ("Longer than 350 lines because ...").

The checks are pure functions of a source tree, so each one is also run on a small
planted tree that breaks the rule (the checks are not vacuous).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "qfilters_mlx"
ROOT = Path(__file__).resolve().parents[2] / "python" / PACKAGE
MAX_LINES = 350
LONG_REASON = "Longer than 350 lines because"
ALLOWED_PRIVATE = {f"{PACKAGE}._ext"}
LAYERS = ({"assets", "backends"}, {"scorers"}, {"config"}, {"filters"}, {"cache"}, {"evaluation"},
          {"commands"})
"""The subpackages, lowest first: each imports only those of earlier sets (and the top-level
modules, which import no subpackage at module level but ``prompt_cache_hook``'s strings)."""

# Violations in files other helpers are changing at the same time; the test
# xfails while every violation it finds is one of these, and fails on any other.
PENDING_MERGE: dict = {}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def load_tree(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    """``{module name: (path, parsed source)}`` for every ``.py`` file below ``root``."""
    return {module_name(p, root): (p, ast.parse(p.read_text(), str(p))) for p in sorted(root.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(tree: dict) -> list[tuple[str, str, str, int]]:
    """``(importer, imported module, imported name or "", line)`` for every import of a package
    module, at any depth of the file. For ``from m import n``: one row ``(m, n)``, and one row
    ``(m.n, "")`` when ``m.n`` is a module of the tree."""
    rows = []
    for mod, (path, t) in tree.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(t):
            if isinstance(node, ast.Import):
                rows += [(mod, a.name, "", node.lineno) for a in node.names
                         if a.name.split(".")[0] == PACKAGE]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node, mod, is_pkg)
                if target.split(".")[0] != PACKAGE:
                    continue
                for a in node.names:
                    rows.append((mod, target, a.name, node.lineno))
                    if f"{target}.{a.name}" in tree or f"{target}.{a.name}" in ALLOWED_PRIVATE:
                        rows.append((mod, f"{target}.{a.name}", "", node.lineno))
    return rows


def import_graph(tree: dict) -> dict[str, set[str]]:
    graph = {m: set() for m in tree}
    for src, dst, _, _ in imports(tree):
        if dst in tree and dst != src:
            graph[src].add(dst)
    return graph


def folder_of(module: str, tree: dict) -> str:
    """``module``'s folder: its first-level subpackage's name, else the module's own name
    (a top-level module, or the package itself)."""
    parts = module.split(".")
    sub = ".".join(parts[:2])
    if len(parts) > 2 or (len(parts) == 2 and tree[sub][0].name == "__init__.py"):
        return parts[1]
    return module


def folder_graph(tree: dict) -> dict[str, dict[str, list[str]]]:
    """``{folder: {imported folder: ["module:line", ...]}}``. ``from pkg import mod`` counts
    as an import of ``mod`` alone (not of ``pkg/__init__``), and the compiled extension as none."""
    graph = {folder_of(m, tree): {} for m in tree}
    for src, dst, name, line in imports(tree):
        full = f"{dst}.{name}"
        if dst not in tree or full in ALLOWED_PRIVATE or (name and full in tree):
            continue
        a, b = folder_of(src, tree), folder_of(dst, tree)
        if a != b:
            graph[a].setdefault(b, []).append(f"{src}:{line}")
    return graph


def upward_imports(graph: dict, layers=LAYERS) -> list[str]:
    """``"a -> b (module:line)"`` for each import of a subpackage ``a`` of a folder ``b`` that is
    not below it: a subpackage of the same or a later set of ``layers``, or one not in them."""
    rank = {name: i for i, names in enumerate(layers) for name in names}
    out = []
    for a, targets in sorted(graph.items()):
        if a.startswith(PACKAGE):  # a top-level module or the package: checked for cycles only
            continue
        for b, where in sorted(targets.items()):
            if a not in rank or (not b.startswith(PACKAGE) and rank.get(b, len(layers)) >= rank[a]):
                out.append(f"{a} -> {b} ({where[0]})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(tree: dict) -> list[tuple[str, int, str]]:
    """``(importer, line, "module._name")`` for every use of another module's private name."""
    out = []
    for src, dst, name, line in imports(tree):
        full = f"{dst}.{name}" if name else dst
        if full in ALLOWED_PRIVATE or dst == src:
            continue
        if name and _private(name) and full not in tree:
            out.append((src, line, full))
        elif any(_private(p) for p in dst.split(".")[1:]) and dst not in ALLOWED_PRIVATE:
            out.append((src, line, dst))
    # m._name where m is bound to a module of the tree (import m / from pkg import m)
    for mod, (path, t) in tree.items():
        bound = {}
        for node in ast.walk(t):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in tree:
                        bound[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node, mod, path.name == "__init__.py")
                for a in node.names:
                    if f"{target}.{a.name}" in tree:
                        bound[a.asname or a.name] = f"{target}.{a.name}"
        for node in ast.walk(t):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, v = [node.attr], node.value
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id in bound:
                    target = ".".join([bound[v.id], *reversed(chain[1:])])
                    full = f"{target}.{node.attr}"
                    if target != mod and full not in ALLOWED_PRIVATE:
                        out.append((mod, node.lineno, full))
    return sorted(set(out))


def oversized(tree: dict) -> list[tuple[str, int]]:
    """``(module, lines)`` over ``MAX_LINES`` without the reason in the docstring."""
    out = []
    for mod, (path, t) in tree.items():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and LONG_REASON not in (ast.get_docstring(t) or ""):
            out.append((mod, n))
    return out


def _file(mod: str, tree: dict) -> str:
    return tree[mod][0].relative_to(ROOT.parent).as_posix()


def _check(violations: list[tuple[str, str]], what: str) -> None:
    """Fail on violations outside PENDING_MERGE; xfail while only pending files violate."""
    own = [v for f, v in violations if f not in PENDING_MERGE]
    assert not own, f"{what}:\n" + "\n".join(own)
    if violations:
        pytest.xfail("pending_merge: " + "; ".join(f"{f}: {v}" for f, v in violations))


@pytest.fixture(scope="module")
def tree():
    return load_tree(ROOT)


def test_walks_the_whole_package(tree):
    assert {"qfilters_mlx", "qfilters_mlx.config", "qfilters_mlx.cache.kv_cache",
            "qfilters_mlx.evaluation.run", "qfilters_mlx.commands.cli"} <= set(tree)
    graph = import_graph(tree)
    assert "qfilters_mlx.backends.reference" in graph["qfilters_mlx.cache.calibration"]
    assert sum(map(len, graph.values())) > 30


def test_no_import_cycle(tree):
    found = []
    for c in cycles(import_graph(tree)):
        files = [_file(m, tree) for m in c]
        # a cycle is pending when one of its modules is a pending file
        found.append((next((f for f in files if f in PENDING_MERGE), files[0]), " <-> ".join(c)))
    _check(found, "import cycles")


def test_no_import_cycle_between_folders(tree):
    graph = folder_graph(tree)
    found = cycles({a: set(b) for a, b in graph.items()})
    assert not found, "import cycles between folders:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_folders_import_only_folders_below(tree):
    graph = folder_graph(tree)
    assert {"config", "filters", "cache", "evaluation", "commands"} <= set(graph)
    assert "config" in graph["cache"] and "cache" in graph["evaluation"]
    found = upward_imports(graph)
    assert not found, "imports of a folder that is not below:\n" + "\n".join(found)


def test_no_private_name_crosses_modules(tree):
    found = private_uses(tree)
    _check([(_file(m, tree), f"{m}:{line} uses {name}") for m, line, name in found],
           "private names used across modules")


def test_no_module_over_350_lines_without_a_reason(tree):
    found = oversized(tree)
    _check([(_file(m, tree), f"{m}: {n} lines") for m, n in found],
           f"modules over {MAX_LINES} lines without '{LONG_REASON} ...' in the docstring")


def test_checks_catch_planted_violations(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": '"""Package."""\n',
        "a.py": "from qfilters_mlx.sub import b\n\ndef f():\n    return b._hidden\n",
        "sub/__init__.py": "",
        "sub/b.py": "def g():\n    from .. import a\n    from qfilters_mlx import _ext\n    return a\n",
        "c.py": "from qfilters_mlx.sub.b import _helper, g\nimport qfilters_mlx.a as aa\nx = aa._y\n"
                "__all__ = [g.__name__]\n",
        "big.py": "\n" * 351,
        "big_ok.py": f'"""{LONG_REASON} it is a table."""\n' + "\n" * 351,
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    t = load_tree(pkg)
    # relative `from .. import a` in sub/b resolves to the package, then to module a
    assert cycles(import_graph(t)) == [["qfilters_mlx.a", "qfilters_mlx.sub.b"]]
    assert [name for _, _, name in private_uses(t)] == [
        "qfilters_mlx.sub.b._hidden", "qfilters_mlx.sub.b._helper", "qfilters_mlx.a._y"]
    assert oversized(t) == [("qfilters_mlx.big", 351)]


def test_folder_checks_catch_planted_violations(tmp_path):
    pkg = tmp_path / PACKAGE
    for sub in ("config", "filters", "cache"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    files = {
        "__init__.py": "",
        "top.py": "",
        "config/method.py": "from qfilters_mlx import top\nfrom qfilters_mlx import _ext\n",
        "config/recent.py": "def f():\n    from qfilters_mlx.filters.windows import g\n",
        "filters/windows.py": "from qfilters_mlx.config import method\ndef g():\n    pass\n",
        "cache/kv.py": "from qfilters_mlx.filters import windows\nfrom qfilters_mlx.config.method import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    t = load_tree(pkg)
    assert cycles(import_graph(t)) == []  # no cycle between modules ...
    graph = folder_graph(t)  # ... but config <-> filters between folders
    assert graph["config"] == {"qfilters_mlx.top": ["qfilters_mlx.config.method:1"],
                               "filters": ["qfilters_mlx.config.recent:2"]}
    assert cycles({a: set(b) for a, b in graph.items()}) == [["config", "filters"]]
    assert upward_imports(graph) == ["config -> filters (qfilters_mlx.config.recent:2)"]
    (pkg / "config/recent.py").write_text("")
    graph = folder_graph(load_tree(pkg))
    assert cycles({a: set(b) for a, b in graph.items()}) == [] and upward_imports(graph) == []
    assert upward_imports({"cache": {"evaluation": ["m:1"]}, "evaluation": {}}) == [
        "cache -> evaluation (m:1)"]
    assert upward_imports({"extra": {"config": ["m:1"]}}) == ["extra -> config (m:1)"]
