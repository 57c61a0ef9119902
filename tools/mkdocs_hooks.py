"""MkDocs hooks (``mkdocs.yml``: ``hooks:``): one set of Markdown files for GitHub and the site.

The pages are written to be read on GitHub, so they link with paths relative to their own
place in the repository: ``docs/x.md`` from README.md, ``../bench/results/y.md`` from a
page of docs/. For the site:

- README.md becomes the home page (``index.md``);
- CHANGELOG.md, and every repository file a page links to outside docs/ (results files,
  plots), is copied into the site under ``repo/`` (Markdown ones rendered as pages),
  found transitively, and a link to a file that does not exist stops the build, naming
  the page and the link;
- each such link is rewritten to the file's place in the site, so MkDocs' own checks
  (strict mode: broken links and anchors fail) see them like links between pages.

Links inside fenced code blocks and links with a scheme (``https:``) are left alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
COPIED = "repo"  # site folder of the repository files linked from the pages
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
FENCE = re.compile(r"^( *)(```|~~~).*?^\1\2", re.S | re.M)


def _outside_fences(text: str, fn) -> str:
    """Apply ``fn`` to the parts of ``text`` outside fenced code blocks."""
    out, pos = [], 0
    for m in FENCE.finditer(text):
        out += [fn(text[pos:m.start()]), m.group(0)]
        pos = m.end()
    return "".join(out + [fn(text[pos:])])


def _local(target: str) -> bool:
    return not (re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"))


def _site_path(real: Path) -> str:
    """Where a repository file lives in the site (``src_uri``)."""
    if real == REPO / "README.md":
        return "index.md"
    if DOCS in real.parents:
        return real.relative_to(DOCS).as_posix()
    return f"{COPIED}/{real.relative_to(REPO).as_posix()}"


def _linked(source: Path) -> list[Path]:
    """The repository files ``source`` links to; raises naming a link to a missing file."""
    found = []

    def scan(part):
        for m in LINK.finditer(part):
            if _local(m.group(2)):
                target = (source.parent / m.group(2)).resolve()
                if not target.exists() or REPO not in target.parents:
                    raise PluginError(f"{source.relative_to(REPO)}: the link {m.group(2)!r} points to "
                                      f"{target}, which is not a file of the repository")
                found.append(target)
        return part

    _outside_fences(source.read_text(encoding="utf-8"), scan)
    return found


def on_files(files, config):
    changelog = REPO / "CHANGELOG.md"  # in the site's navigation
    copied = {_site_path(changelog): changelog}
    todo = [REPO / "README.md", changelog, *sorted(DOCS.glob("*.md"))]
    seen = set(todo)
    while todo:
        source = todo.pop()
        for target in _linked(source) if source.suffix == ".md" else []:
            if target.is_dir():
                raise PluginError(f"{source.relative_to(REPO)}: links to the folder {target}; link a file")
            if target not in seen:
                seen.add(target)
                todo.append(target)
            if target != REPO / "README.md" and DOCS not in target.parents:
                copied[_site_path(target)] = target
    files.append(File.generated(config, "index.md", abs_src_path=str(REPO / "README.md")))
    for uri, real in sorted(copied.items()):
        files.append(File.generated(config, uri, abs_src_path=str(real)))
    return files


def on_page_markdown(markdown, page, config, files):
    real = Path(page.file.abs_src_path).resolve()
    here = Path(page.file.src_uri).parent

    def rewrite(part):
        def one(m):
            if not _local(m.group(2)):
                return m.group(0)
            target = (real.parent / m.group(2)).resolve()
            new = os.path.relpath(_site_path(target), here.as_posix() or ".")
            return m.group(1) + Path(new).as_posix() + m.group(3)

        return LINK.sub(one, part)

    return _outside_fences(markdown, rewrite)
