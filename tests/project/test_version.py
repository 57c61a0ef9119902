"""One version: pyproject.toml's, the package's ``__version__`` and the changelog's latest entry."""

import re
from pathlib import Path

import qfilters_mlx

REPO = Path(__file__).resolve().parents[2]


def test_version_is_one_number_everywhere():
    # the [project] table's version line (tomllib needs Python 3.11; the package supports 3.10)
    project = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    latest = re.search(r"^## \[(\d+\.\d+\.\d+)\]", (REPO / "CHANGELOG.md").read_text(), re.M).group(1)
    assert qfilters_mlx.__version__ == project == latest
