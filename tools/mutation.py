"""Mutation check (not in CI: too slow on 2 cores): mutmut over the eviction core.

Mutates ``backends/reference.py``, ``cache/kv_cache.py`` (the cache's hot path), the cache's
component modules (rewinds, compress-once, calibration, journal, persistence, bytes, input
checks, attention reads, quantized storage) and the scorers (``--modules``)
and runs the unit tests in ``TESTS`` against every mutant: mutmut runs, per mutant,
only the tests that call the mutated function, and stops at the first failure.
mutmut wants the package under ``src/``, so the run happens in a scratch copy
(``--workdir``): ``src/qfilters_mlx``, ``tests/`` and ``pyproject.toml`` with a
``[tool.mutmut]`` section added. The repository is not touched.

Speed (2 shared cores; about 6x faster than mutmut's defaults here): every mutant's
pytest is forked from a server that already imported MLX, hypothesis and the package
(``forkserver_warmup = "import"``: MLX may be imported but not run before a fork);
the scratch conftest orders a mutant's tests by how many mutants each has killed so
far, then by duration, and turns hypothesis shrinking off; the three slow rewind
tests (``DESELECT``) are left out; hypothesis examples x0.1; ``nice -n 19``.

On a loaded machine a niced test process can starve past mutmut's wall-clock limit:
such "timeouts" (and crashed test processes) are not trusted. ``--recheck`` re-runs
them (all of ``TESTS``) and the survivors (``RECHECK_TESTS``: the files holding the tests written for
survivors), one fork each, into ``WORKDIR/recheck.json``; ``tools/mutation_report.py``
merges that with the hand-classified equivalent mutants (``tools/mutation_equivalents.json``) into
``bench/results/mutation.json``.

mutmut is not a dependency of the package: install it apart, e.g.
``python -m pip install --target /work/mut-pkgs mutmut`` (then pass
``--mutmut-path /work/mut-pkgs``) or into its own venv. The tests run under the
Python that runs this script (the project's venv, with mlx/mlx-lm/hypothesis);
mutmut's own path is appended after the venv's site-packages so that the
venv's pytest wins.

Usage (from the repository root)::

    python tools/mutation.py --mutmut-path /work/mut-pkgs \\
        --modules backends/reference.py cache/kv_cache.py cache/calibration.py
    python tools/mutation.py --mutmut-path /work/mut-pkgs --resume      # continue it
    python tools/mutation.py --mutmut-path /work/mut-pkgs --resume --recheck
    python tools/mutation_report.py

``--resume`` only continues a run cut short on unchanged code: after editing a mutated
module or the test selection, start afresh (a resumed run over a changed module once lost
the stored results of its other functions here).

Prints the mutation score ``(killed + timeout) / (total - skipped)`` and the
surviving mutants (``mutmut show NAME`` in the work dir shows one's diff); the
stats are in ``WORKDIR/mutants/mutmut-cicd-stats.json``.
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
MODULES = ["backends/reference.py", "cache/kv_cache.py", "cache/calibration.py", "cache/journal.py",
           "cache/persistence.py", "cache/rewind.py", "cache/compression.py", "cache/accounting.py",
           "cache/inputs.py", "cache/attention.py", "cache/dense.py", "cache/quantized.py", "scorers/base.py",
           "scorers/registry.py", "scorers/qfilters.py", "scorers/l2norm.py",
           "scorers/seeded_random.py", "scorers/full.py", "scorers/streaming_llm.py", "cache/speculative.py"]
# Tests run against the survivors of mutmut's run (``--recheck``): the files holding the
# tests written for them (they are in TESTS too: a fresh run counts them as kills directly).
RECHECK_TESTS = ["tests/backends/test_reference.py", "tests/cache/test_cache.py",
                 "tests/cache/test_slot_mode.py", "tests/cache/test_rewind.py",
                 "tests/cache/test_compression.py", "tests/cache/test_quantized.py",
                 "tests/cache/test_scorers.py", "tests/cache/test_speculative_draft.py",
                 "tests/cache/test_cache_construction.py"]
TESTS = ["tests/backends/test_reference.py", "tests/cache/test_cache.py", "tests/backends/test_decode_step.py",
         "tests/cache/test_cache_oracle.py", "tests/cache/test_properties.py", "tests/cache/test_cache_round_trip.py",
         "tests/cache/test_rewind.py", "tests/backends/test_perhead_recent.py",
         "tests/filters/test_query_filters.py::test_auto_sign_points_the_key_filter_at_the_queries",
         "tests/cache/test_cache_construction.py", "tests/cache/test_no_silent_rewind.py",
         "tests/cache/test_copies.py", "tests/cache/test_scorers.py",
         "tests/cache/test_compress_once_bytes.py", "tests/cache/test_speculative_draft.py",
         *RECHECK_TESTS]
# Slow (3-5 s each: every surviving mutant of the cache pays them) and covered by the
# differential tests (test_cache_oracle, test_properties) for everything but rewinds.
DESELECT = ["tests/cache/test_rewind.py::test_speculative_kept_sets_equal_the_numpy_model_fed_the_same_calls",
            "tests/cache/test_rewind.py::test_speculative_decoding_rewinds_exactly",
            "tests/cache/test_rewind.py::test_rewind_is_bit_identical_to_never_seeing_the_tokens"]


# Imported once by mutmut's fork server; every mutant's test process is forked from it.
PRELOAD = '''from qfilters_mlx.blas import enable_fast_blas
enable_fast_blas()
import importlib
for name in ("numpy", "mlx.core", "mlx.nn", "mlx_lm.models.cache", "mlx_lm.models.base",
             "hypothesis", "hypothesis.strategies", "hypothesis.extra.numpy", "pytest",
             "qfilters_mlx._ext", "qfilters_mlx.cache.kv_cache", "qfilters_mlx.cache.builder",
             "qfilters_mlx.backends.reference", "qfilters_mlx.backends.dispatch"):
    importlib.import_module(name)
'''

# Appended to the scratch copy's tests/conftest.py. mutmut stops at the first failing
# test (-x), so run the tests that killed the most mutants so far first, then the
# fastest (durations from mutmut's stats run); each failure under a mutant is
# counted in WORKDIR/kills.txt. Hypothesis does not shrink.
TEST_ORDER = '''

# A mutant needs one failing example, not the smallest: no shrinking (it cost minutes
# and ran mutants into mutmut's timeout).
import hypothesis as _hypothesis

_hypothesis.settings.register_profile("mutation", phases=[
    _hypothesis.Phase.explicit, _hypothesis.Phase.reuse, _hypothesis.Phase.generate])
_hypothesis.settings.load_profile("mutation")

def _mutation_files():
    from pathlib import Path
    mutants = Path(__file__).resolve().parent.parent
    return mutants / "mutmut-stats.json", mutants.parent / "kills.txt"


def pytest_collection_modifyitems(session, config, items):
    import collections
    import json
    stats, kills = _mutation_files()
    durations = json.loads(stats.read_text()).get("duration_by_test", {}) if stats.exists() else {}
    counts = collections.Counter(kills.read_text().split()) if kills.exists() else {}
    items.sort(key=lambda item: (-counts.get(item.nodeid, 0), durations.get(item.nodeid, 0.0)))


def pytest_runtest_logreport(report):
    if report.failed and "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", ""):
        with open(_mutation_files()[1], "a") as f:
            f.write(report.nodeid + "\\n")
'''


# Re-checks the survivors of a run (``--recheck``) with tests mutmut's run left out:
# a process that imported everything forks one child per survivor, which runs the
# tests under that mutant (mutmut's trampolines read MUTANT_UNDER_TEST at call time).
RECHECK = '''
import json, os, signal, sys, time
sys.path.append(sys.argv[1])
os.chdir(sys.argv[2])
sys.path.insert(0, os.path.join(sys.argv[2], "src"))
import _qf_mutation_preload  # noqa: F401  (MLX imported, not run: fork-safe)
import pytest
tests, survivors = json.loads(sys.argv[3]), json.loads(sys.argv[4])
out = {}
limit = 0  # (no limit on the control; then 10x its time, at least 120 s: a hang under a mutant)
# "" first: the unmutated code must pass the tests, or every "kill" would be false
for name in ["", *survivors]:
    r, w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(limit)
        sys.stdout = sys.stderr = open(os.devnull, "w")
        os.environ["MUTANT_UNDER_TEST"] = name
        class First:
            failed = ""
            def pytest_runtest_logreport(self, report):
                if report.failed and not self.failed:
                    self.failed = report.nodeid
        first = First()
        code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--rootdir=.", *tests], plugins=[first])
        os.write(w, json.dumps([int(code), first.failed]).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    _, status = os.waitpid(pid, 0)
    if data:
        code, failed = json.loads(data)
    elif os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
        code, failed = -signal.SIGALRM, f"(test process hung: no result within {limit} s)"
    else:  # the test process died: a crash under the mutant (the unmutated code passed)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        code, failed = -sig or -1, f"(test process crashed: signal {sig}, exit {os.waitstatus_to_exitcode(status)})"
    if not name:
        limit = max(120, int(10 * (time.monotonic() - start)))
        if code != 0:
            print("CONTROL FAILED: the unmutated code fails", failed, flush=True)
            sys.exit(1)
        continue
    out[name] = {"exit_code": code, "killed_by": failed}
    print(name, code, failed, flush=True)
print("RESULT " + json.dumps(out))
'''


def toml_list(items) -> str:
    return "[" + ", ".join(json.dumps(x) for x in items) + "]"


def prepare(workdir: Path, modules, tests, deselect) -> None:
    if workdir.exists():
        shutil.rmtree(workdir)
    (workdir / "src").mkdir(parents=True)
    shutil.copytree(REPO / "python" / "qfilters_mlx", workdir / "src" / "qfilters_mlx",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for extra in ("metal", "csrc", "README.md", "docs"):  # read by some tests
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
        f"pytest_add_cli_args = {toml_list(['-p', 'no:cacheprovider', '-q'] + [x for d in deselect for x in ('--deselect', d)])}\n"
        "mutate_only_covered_lines = true\n"
        # CPU limit (estimated test time + 3 s) * 10, wall limit half that
        "timeout_multiplier = 5.0\ntimeout_constant = 3.0\n"
        # MLX's thread pools do not survive a fork of a process that ran them, so
        # pytest's collection (which runs MLX) cannot warm the fork server; importing
        # MLX, hypothesis and the package without running them can (saves ~3 s a mutant).
        'process_isolation = "forkserver"\n'
        'forkserver_warmup = "import"\n'
        'preload_modules_file = "preload_modules.txt"\n'
    )
    (workdir / "pyproject.toml").write_text(pyproject)
    (workdir / "src" / "_qf_mutation_preload.py").write_text(PRELOAD)
    (workdir / "preload_modules.txt").write_text("_qf_mutation_preload\n")
    copy_tests(workdir)


def copy_tests(workdir: Path) -> None:
    """(Re)copy ``tests/`` into the work dir, with :data:`TEST_ORDER` in its conftest."""
    shutil.copytree(REPO / "tests", workdir / "tests", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "integration", "metal_emu"))
    with open(workdir / "tests" / "conftest.py", "a") as f:
        f.write(TEST_ORDER)


def mutmut(args, mutmut_path: str, workdir: Path, env, log: Path | None = None):
    """Run ``mutmut ARGS`` in ``workdir`` (niced: the tests are CPU-bound); output to ``log`` if given."""
    boot = ("import sys; sys.path.append(%r); from mutmut.__main__ import cli; "
            "sys.argv = ['mutmut'] + sys.argv[1:]; cli()" % mutmut_path)
    cmd = ["nice", "-n", "19", sys.executable, "-c", boot, *args]
    if log is None:
        return subprocess.run(cmd, cwd=workdir, env=env, text=True, capture_output=True)
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=workdir, env=env, text=True, stdout=f, stderr=subprocess.STDOUT)


TIMEOUT_CODES = (24, -24, 152, 255, 36)  # mutmut's "timeout" exit codes
# Re-run with the whole selection like timeouts: a test process that crashed (mutmut's
# "suspicious" and "segfault": SIGABRT, SIGKILL, SIGSEGV) may have died of the fork, not the mutant.
CRASH_CODES = (-6, -9, -11, 35)


def mutants_with(workdir: Path, codes) -> list[str]:
    """Names of the mutants whose exit code in mutmut's .meta files is in ``codes``."""
    names = []
    for meta in sorted((workdir / "mutants").rglob("*.py.meta")):
        found = json.loads(meta.read_text())["exit_code_by_key"]
        names += [k for k, code in sorted(found.items()) if code in codes]
    return names


def classified_equivalent(workdir: Path, names: list[str]) -> set[str]:
    """The mutants among ``names`` that ``tools/mutation_equivalents.json`` lists (matched by
    function and diff, as ``tools/mutation_report.py`` matches them)."""
    sys.path.insert(0, str(REPO / "tools"))
    from mutation_report import equivalent_key, functions, load_equivalents, mutant_diff

    eq = load_equivalents()
    funcs, out = {}, set()
    for name in names:
        module = name.rsplit(".", 1)[0]
        path = workdir / "mutants" / "src" / (module.replace(".", "/") + ".py")
        if path not in funcs:
            funcs[path] = functions(path)
        if equivalent_key(name, mutant_diff(funcs[path], name)) in eq:
            out.add(name)
    return out


def recheck(workdir: Path, tests, full_tests, mutmut_path: str, env) -> int:
    """Run ``tests`` against every survivor of mutmut's run (but those already classified
    equivalent: they survive any test) and ``full_tests`` against
    every mutant it timed out (on a loaded machine a timeout can be starvation, not a
    hang) or whose test process crashed; write ``WORKDIR/recheck.json``
    ``{mutant: {"exit_code", "killed_by", "tests"}}`` (exit code 1 and the first failing test: killed)."""
    copy_tests(workdir)
    (workdir / "mutants" / "tests").mkdir(exist_ok=True)
    shutil.copytree(workdir / "tests", workdir / "mutants" / "tests", dirs_exist_ok=True)
    result = {}
    survivors = mutants_with(workdir, (0,))
    equivalent = classified_equivalent(workdir, survivors)
    print(f"{len(equivalent)} of {len(survivors)} survivors already classified equivalent: not re-run")
    for group, names in (("survivors", [n for n in survivors if n not in equivalent]),
                         ("timeouts", mutants_with(workdir, TIMEOUT_CODES + CRASH_CODES))):
        group_tests = list(tests) if group == "survivors" else list(full_tests)
        cmd = ["nice", "-n", "19", sys.executable, "-c", RECHECK, mutmut_path,
               str(workdir / "mutants"), json.dumps(group_tests), json.dumps(names)]
        log = workdir / f"recheck-{group}.log"
        with open(log, "w") as f:  # one line per mutant as it goes
            subprocess.run(cmd, env=env, text=True, stdout=f, stderr=subprocess.STDOUT)
        lines = [x for x in log.read_text().splitlines() if x.startswith("RESULT ")]
        if not lines:
            print(log.read_text()[-3000:])
            return 1
        part = json.loads(lines[-1][len("RESULT "):])
        for v in part.values():
            v["tests"] = group
        result.update(part)
        killed = [k for k, v in part.items() if v["exit_code"] == 1]
        print(f"{group}: {len(killed)} of {len(part)} killed by {' '.join(group_tests)}")
    (workdir / "recheck.json").write_text(json.dumps(result, indent=1))
    for k, v in sorted(result.items()):
        print(("killed by " + v["killed_by"]) if v["exit_code"] == 1 else f"survives (exit {v['exit_code']})", k)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modules", nargs="+", default=MODULES, help="paths under python/qfilters_mlx")
    p.add_argument("--tests", nargs="+", default=TESTS)
    p.add_argument("--workdir", default="/tmp/qfilters-mutation")
    p.add_argument("--mutmut-path", default=os.environ.get("MUTMUT_PATH", ""),
                   help="folder holding the mutmut package (pip install --target)")
    p.add_argument("--max-children", type=int, default=2)
    p.add_argument("--deselect", nargs="*", default=DESELECT, help="test ids left out of the run")
    p.add_argument("--examples-scale", default="0.1")
    p.add_argument("--only", nargs="*", default=[],
                   help="mutant name patterns (fnmatch), e.g. 'qfilters_mlx.backends.reference.x_select_keep*'")
    p.add_argument("--resume", action="store_true", help="keep the work dir and the results already there")
    p.add_argument("--recheck", nargs="*", default=None, metavar="TEST",
                   help="no mutmut run: re-run each survivor of the work dir's run against these "
                        "tests (default: RECHECK_TESTS and the --deselect tests); "
                        "results in WORKDIR/recheck.json")
    a = p.parse_args()
    workdir = Path(a.workdir)
    if not (a.resume and workdir.exists()):
        prepare(workdir, a.modules, a.tests, a.deselect)
    else:
        copy_tests(workdir)  # new tests count; the configuration stays as prepared
    env = dict(os.environ, QF_TEST_EXAMPLES_SCALE=a.examples_scale, PYTHONPATH="")
    if a.recheck is not None:
        extra = a.recheck or [*RECHECK_TESTS, *a.deselect]
        return recheck(workdir, extra, list(dict.fromkeys([*a.tests, *extra])), a.mutmut_path, env)
    mutmut(["run", "--max-children", str(a.max_children), *a.only], a.mutmut_path, workdir, env,
           log=workdir / "run.log")
    mutmut(["export-cicd-stats"], a.mutmut_path, workdir, env)
    stats_path = workdir / "mutants" / "mutmut-cicd-stats.json"
    if not stats_path.exists():
        print((workdir / "run.log").read_text()[-4000:])
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
