"""Mutation check (not in CI: too slow on 2 cores): mutmut over the eviction core.

Mutates ``backends/reference.py``, ``cache/kv_cache.py``, ``cache/scorers.py`` and
the cache mixins ``slots.py``, ``persistence.py``, ``rewind.py`` (``--modules``)
and runs a fast subset of the unit tests against every mutant (mutmut runs, per
mutant, only the tests that call the mutated function, and stops at the first
failure). mutmut wants the package under ``src/``, so the run happens in a
scratch copy (``--workdir``): ``src/qfilters_mlx``, ``tests/`` and
``pyproject.toml`` with a ``[tool.mutmut]`` section added. The repository is
not touched.

mutmut is not a dependency of the package: install it apart, e.g.
``python -m pip install --target /work/mut-pkgs mutmut`` (then pass
``--mutmut-path /work/mut-pkgs``) or into its own venv. The tests run under the
Python that runs this script (the project's venv, with mlx/mlx-lm/hypothesis);
mutmut's own path is appended after the venv's site-packages so that the
venv's pytest wins.

Usage (from the repository root)::

    python tools/mutation.py --mutmut-path /work/mut-pkgs --max-children 2
    python tools/mutation.py --modules backends/reference.py --tests tests/test_reference.py

Prints the mutation score ``(killed + timeout) / (total - skipped)`` and the
surviving mutants (``mutmut show NAME`` in the work dir shows one's diff); the
stats are in ``WORKDIR/mutants/mutmut-cicd-stats.json``. Hypothesis tests run
with ``QF_TEST_EXAMPLES_SCALE`` (default 0.2 here) times their examples.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODULES = ["backends/reference.py", "cache/kv_cache.py", "cache/scorers.py",
           "cache/slots.py", "cache/persistence.py", "cache/rewind.py"]
TESTS = ["tests/test_reference.py", "tests/test_cache.py", "tests/test_decode_step.py",
         "tests/test_cache_oracle.py", "tests/test_properties.py", "tests/test_cache_round_trip.py",
         "tests/test_rewind.py"]


def toml_list(items) -> str:
    return "[" + ", ".join(json.dumps(x) for x in items) + "]"


def prepare(workdir: Path, modules, tests) -> None:
    if workdir.exists():
        shutil.rmtree(workdir)
    (workdir / "src").mkdir(parents=True)
    shutil.copytree(REPO / "python" / "qfilters_mlx", workdir / "src" / "qfilters_mlx",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tests", workdir / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "integration", "metal_emu"))
    for extra in ("metal", "csrc", "README.md"):  # read by some tests
        src = REPO / extra
        if src.is_dir():
            shutil.copytree(src, workdir / extra)
        elif src.exists():
            shutil.copy2(src, workdir / extra)
    pyproject = (REPO / "pyproject.toml").read_text()
    pyproject += (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f"only_mutate = {toml_list('src/qfilters_mlx/' + m for m in modules)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
        "mutate_only_covered_lines = true\n"
        # MLX's thread pools do not survive a fork of a process that ran them: fork each
        # mutant's test process from a server that has imported nothing else.
        'process_isolation = "forkserver"\n'
        'forkserver_warmup = "none"\n'
    )
    (workdir / "pyproject.toml").write_text(pyproject)


def mutmut(args, mutmut_path: str, workdir: Path, env) -> subprocess.CompletedProcess:
    boot = ("import sys; sys.path.append(%r); from mutmut.__main__ import cli; "
            "sys.argv = ['mutmut'] + sys.argv[1:]; cli()" % mutmut_path)
    return subprocess.run([sys.executable, "-c", boot, *args], cwd=workdir, env=env,
                          text=True, capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modules", nargs="+", default=MODULES, help="paths under python/qfilters_mlx")
    p.add_argument("--tests", nargs="+", default=TESTS)
    p.add_argument("--workdir", default="/tmp/qfilters-mutation")
    p.add_argument("--mutmut-path", default=os.environ.get("MUTMUT_PATH", ""),
                   help="folder holding the mutmut package (pip install --target)")
    p.add_argument("--max-children", type=int, default=2)
    p.add_argument("--examples-scale", default="0.2")
    p.add_argument("--only", nargs="*", default=[],
                   help="mutant name patterns (fnmatch), e.g. 'qfilters_mlx.backends.reference.x_select_keep*'")
    p.add_argument("--resume", action="store_true", help="keep the work dir and the results already there")
    a = p.parse_args()
    workdir = Path(a.workdir)
    if not (a.resume and workdir.exists()):
        prepare(workdir, a.modules, a.tests)
    env = dict(os.environ, QF_TEST_EXAMPLES_SCALE=a.examples_scale, PYTHONPATH="")
    run = mutmut(["run", "--max-children", str(a.max_children), *a.only], a.mutmut_path, workdir, env)
    (workdir / "run.log").write_text(run.stdout + run.stderr)
    mutmut(["export-cicd-stats"], a.mutmut_path, workdir, env)
    stats_path = workdir / "mutants" / "mutmut-cicd-stats.json"
    if not stats_path.exists():
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
        return 1
    stats = json.loads(stats_path.read_text())
    tested = stats["total"] - stats.get("skipped", 0)
    score = (stats["killed"] + stats.get("timeout", 0)) / max(tested, 1)
    print(json.dumps(stats))
    print(f"mutation score: {100 * score:.1f}% ({stats['killed'] + stats.get('timeout', 0)} of {tested})")
    res = mutmut(["results"], a.mutmut_path, workdir, env)
    (workdir / "survivors.txt").write_text(res.stdout)
    print("surviving / not checked mutants:")
    print(res.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
