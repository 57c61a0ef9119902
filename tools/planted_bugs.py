"""Planted one-line bugs: each must make the
tests named for it fail. Not in CI (a pytest process per bug and per named test: about 2
minutes on 2 shared cores).

Each entry of ``BUGS``: ``name``; ``kind`` (1-5, the kind of fault: 1 saving a cache
mid-decode, 2 non-finite keys and the tie-break, 3 the recent window, 4 ``eval
--quick``'s own checks, 5 error messages and the Metal refusal); ``file``
(relative to ``python/qfilters_mlx``); ``old``, the exact source snippet, which
must occur exactly once in that file; ``new``, what replaces it; ``tests``, the
pytest ids (files or node ids, relative to the repository root) expected to catch
it. ``tests/project/test_planted_bugs_list.py`` checks that every ``old`` is still in the
source exactly once, so the list cannot rot silently.

For each bug the script copies ``python/qfilters_mlx`` (with the compiled
``_ext*.so`` and ``metal/`` that the source tree holds) into a scratch directory,
applies the one substitution (refusing, before running anything, when ``old`` is
not found exactly once), and runs ``pytest -x -q -p no:cacheprovider`` on the named
tests with ``PYTHONPATH`` = the scratch directory first, under the Python that
runs this script, ``nice -n 19``. A control run (no substitution, the union of all
tests) must pass first; if it does not, no bug is run. Every pytest process loads a tiny plugin (``-p
_planted_probe``, written into the scratch directory) that records
``qfilters_mlx.__file__`` as the tests imported it; a run whose package did not
come from its scratch copy (an installed package or ``python/`` shadowing it) is an
error, not a result.

Result per bug: ``caught`` (pytest exit 1; the first failing test id is recorded),
``missed`` (exit 0) or ``error`` (any other exit, a timeout, a shadowed import).

Usage (from the repository root; writes ``bench/results/planted_bugs.json`` and
``.md``; exits 1 unless the control passes and every bug is caught)::

    python tools/planted_bugs.py                  # all bugs
    python tools/planted_bugs.py --only decode_recent_off_by_one --keep
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "python" / "qfilters_mlx"
RESULTS = REPO / "bench" / "results"

ROUND_TRIP = "tests/cache/test_cache_round_trip.py"
NON_FINITE = "tests/cache/test_cache_oracle.py::test_non_finite_and_tied_keys_in_prefill_and_decode"

BUGS: list[dict] = [
    # ---- kind 1: saving a cache mid-decode
    dict(name="state_in_slot_order", kind=1, file="cache/kv_cache.py",
         what="state returns the rows in slot order (the restore to temporal order skipped)",
         old="        if self._free is None:\n"
             "            return self.rows.head(self._n)",
         new="        if True:\n"
             "            return self.rows.head(self._n)",
         tests=[ROUND_TRIP]),
    dict(name="filter_fixed_not_saved", kind=1, file="cache/persistence.py",
         what="filter_fixed not saved (always False in the saved meta)",
         old='"filter_fixed": s.filter_fixed,',
         new='"filter_fixed": False,',
         tests=[ROUND_TRIP]),
    dict(name="filter_fixed_not_restored", kind=1, file="cache/persistence.py",
         what="filter_fixed not restored (always False after loading)",
         old='bool(meta["filter_fixed"]))',
         new="False)",
         tests=[ROUND_TRIP]),
    dict(name="kept_queries_not_saved", kind=1, file="cache/persistence.py",
         what="the kept calibration queries not saved (state carries None)",
         old="return (*s.rows, s.filter, s.queries, json.dumps(meta), *extra)",
         new="return (*s.rows, s.filter, None, json.dumps(meta), *extra)",
         tests=[ROUND_TRIP]),
    # ---- kind 2: non-finite keys, tie-break
    dict(name="prefill_non_finite_kept", kind=2, file="scorers/base.py",
         what="prefill: non-finite scores no longer mapped to -inf",
         old="return mx.where(mx.isfinite(s), s, -mx.inf) if self.ranks else s",
         new="return s",
         tests=["tests/backends/test_reference.py", NON_FINITE]),
    dict(name="decode_non_finite_kept", kind=2, file="backends/reference.py",
         what="decode (decode_select): the new token's non-finite score stored as is",
         old="s_new = mx.where(mx.isfinite(s_new), s_new, -mx.inf)",
         new="s_new = s_new",
         tests=["tests/backends/test_reference.py", NON_FINITE]),
    dict(name="select_keep_tie_later_wins", kind=2, file="backends/reference.py",
         what="select_keep: among equal scores the later position wins",
         old="low = mx.array(0xFFFFFFFF, mx.uint32) - pos",
         new="low = pos",
         tests=["tests/backends/test_reference.py", NON_FINITE]),
    dict(name="decode_tie_later_wins", kind=2, file="backends/reference.py",
         what="decode_select: among equal scores the earlier position is evicted",
         old="victim = mx.argmax(mx.where(tied, positions, -1), axis=-1).astype(mx.int32)",
         new="victim = mx.argmin(mx.where(tied, positions, 2**62), axis=-1).astype(mx.int32)",
         tests=["tests/backends/test_reference.py", NON_FINITE]),
    # ---- kind 3: recent window off by one
    dict(name="decode_recent_off_by_one", kind=3, file="backends/reference.py",
         what="decode_select: the recent window one token shorter",
         old="(positions < position + 1 - recent)",
         new="(positions <= position + 1 - recent)",
         tests=["tests/backends/test_reference.py", "tests/backends/test_decode_step.py"]),
    dict(name="select_keep_recent_off_by_one", kind=3, file="backends/reference.py",
         what="select_keep: the recent window one token shorter",
         old="forced = (pos < n_sink) | (pos >= start)",
         new="forced = (pos < n_sink) | (pos > start)",
         tests=["tests/backends/test_reference.py"]),
    # ---- kind 4: eval --quick's own checks
    dict(name="quick_random_reproducible_always_true", kind=4, file="evaluation/run.py",
         what="eval --quick: the 'random arm reproducible' check always true",
         old='out["random_reproducible"] = bool(rerun) and all(',
         new='out["random_reproducible"] = True or bool(rerun) and all(',
         tests=["tests/evaluation/test_quick_checks.py"]),
    dict(name="quick_budget_covers_always_true", kind=4, file="evaluation/run.py",
         what="eval --quick: the 'budget covering the length equals full' check always true",
         old='"budget_covers_length_equals_full": bool(cover) and all(',
         new='"budget_covers_length_equals_full": True or bool(cover) and all(',
         tests=["tests/evaluation/test_quick_checks.py"]),
    # ---- kind 5: error messages, Metal refusal
    dict(name="config_error_without_field_name", kind=5, file="config/checks.py",
         what="KVCacheConfig's int checks no longer name the field (e.g. qfilters_budget=0)",
         old='raise ValueError(f"{name} must be >= {minimum}, got {value}")',
         new='raise ValueError(f"must be >= {minimum}, got {value}")',
         tests=["tests/cache/test_config_builder.py"]),
    dict(name="cache_input_error_without_name", kind=5, file="cache/inputs.py",
         what="update_and_fetch's type check no longer names keys/values",
         old='raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}")',
         new='raise TypeError(f"must be an mx.array, got {type(x).__name__}")',
         tests=["tests/cache/test_cache.py::test_bad_updates_raise_before_state_changes"]),
    dict(name="metal_falls_back_to_reference", kind=5, file="backends/dispatch.py",
         what="backend='metal' without Metal silently gives the reference backend",
         old='    if name == "reference":\n',
         new='    if name == "reference" or (name == "metal" and not _metal_available()):\n',
         tests=["tests/cache/test_config_builder.py"]),
]


PROBE = """import json, os


def pytest_sessionfinish(session, exitstatus):
    import sys
    mod = sys.modules.get("qfilters_mlx")
    with open(os.environ["PLANTED_PROBE_OUT"], "w") as f:
        json.dump({"file": getattr(mod, "__file__", None)}, f)
"""

# pytest's short summary (-ra): "FAILED <node id>[ - <message>]"; ids may hold spaces in [...]
FAILED = re.compile(r"^(FAILED|ERROR) (\S+?(?:\[.*?\])?)(?: - |$)")


def planted_source(bug: dict, package: Path = PACKAGE) -> str:
    """The text of ``bug["file"]`` with the one substitution applied.

    Raises:
        ValueError: ``old`` is not in the file exactly once, or ``new == old``.
    """
    path = package / bug["file"]
    text = path.read_text()
    n = text.count(bug["old"])
    if n != 1:
        raise ValueError(f"{bug['name']}: 'old' occurs {n} times in {path} (must be exactly once): "
                         f"update BUGS in tools/planted_bugs.py to the current source")
    if bug["new"] == bug["old"]:
        raise ValueError(f"{bug['name']}: 'new' equals 'old'")
    return text.replace(bug["old"], bug["new"])


def copy_package(dest: Path) -> Path:
    """Copy ``python/qfilters_mlx`` (compiled extension and ``metal/`` included, no
    ``__pycache__``) to ``dest/qfilters_mlx``; writes the probe plugin into ``dest``."""
    shutil.copytree(PACKAGE, dest / "qfilters_mlx", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "_planted_probe.py").write_text(PROBE)
    return dest / "qfilters_mlx"


def scratch_env(scratch: Path) -> dict:
    """This process's environment with ``scratch`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_tests(scratch: Path, tests: list[str], timeout: float) -> dict:
    """pytest on ``tests`` with the package from ``scratch``: ``{rc, first_failure,
    imported_from, seconds, tail}`` (``rc`` None on a timeout)."""
    probe_out = scratch / "probe.json"
    probe_out.unlink(missing_ok=True)
    env = scratch_env(scratch)
    env["PLANTED_PROBE_OUT"] = str(probe_out)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = ["nice", "-n", "19", sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-p", "_planted_probe", *tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, out = None, (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
    seconds = time.monotonic() - t0
    first = next((m.group(2) for line in out.splitlines() if (m := FAILED.match(line))), None)
    imported = json.loads(probe_out.read_text())["file"] if probe_out.exists() else None
    return {"rc": rc, "first_failure": first, "imported_from": imported,
            "imported_from_scratch": from_scratch(imported, scratch), "seconds": round(seconds, 1),
            "tail": out.strip().splitlines()[-15:]}


def from_scratch(imported: str | None, scratch: Path) -> bool:
    return imported is not None and Path(imported).resolve().is_relative_to(scratch.resolve())


def check_import(scratch: Path) -> str:
    """``qfilters_mlx.__file__`` in a plain ``python -c`` with the run's environment
    (cwd = repository root, PYTHONPATH = scratch first) after importing the tests'
    conftest; raises RuntimeError unless it is the scratch copy."""
    env = scratch_env(scratch)
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest, qfilters_mlx; "
            "print(qfilters_mlx.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    if not from_scratch(out, scratch):
        raise RuntimeError(f"import qfilters_mlx came from {out}, not from the scratch copy {scratch}")
    return out


def outcome(res: dict, scratch: Path, control: bool) -> str:
    if not from_scratch(res["imported_from"], scratch):
        return "error"
    if control:
        return "pass" if res["rc"] == 0 else "error"
    if res["rc"] == 1 and res["first_failure"]:
        return "caught"
    return "missed" if res["rc"] == 0 else "error"


def write_results(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "planted_bugs.json").write_text(json.dumps(report, indent=1) + "\n")
    c = report["control"]
    lines = ["# Planted bugs", "",
             "Each row: one substitution in a copy of `python/qfilters_mlx` "
             "(`tools/planted_bugs.py`), the named tests run with `pytest -x`.", "",
             f"Control (no substitution, all the tests below): **{c['outcome']}** ({c['seconds']} s, "
             f"{report['machine']}). "
             + ("Every pytest process imported `qfilters_mlx` from its scratch copy (recorded by a "
                "probe plugin)." if all(r["imported_from_scratch"] for r in [c, *report["bugs"]])
                else "**Some runs did not import `qfilters_mlx` from their scratch copy (see the json).**"),
             "",
             "| bug | kind | file | result | caught by (first failing test) | each named test alone |",
             "|---|---|---|---|---|---|"]
    for r in report["bugs"]:
        alone = r.get("alone")
        if alone is None:
            each = "(one test)" if len(r["tests"]) == 1 else "(not run)"
        else:
            misses = [t for t, a in alone.items() if a["outcome"] != "caught"]
            each = "all catch it" if not misses else "missed by " + ", ".join(f"`{t}`" for t in misses)
        lines.append(f"| {r['name']}: {r['what']} | {r['kind']} | `{r['file']}` | {r['outcome']} | "
                     f"`{r['first_failure'] or '-'}` | {each} |")
    n = sum(r["outcome"] == "caught" for r in report["bugs"])
    lines += ["", f"Caught: {n} of {len(report['bugs'])}.", ""]
    (out_dir / "planted_bugs.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these bugs (and the control)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per pytest run (default 300)")
    ap.add_argument("--no-each", dest="each", action="store_false",
                    help="skip running each named test alone (by default a bug with several named "
                         "tests is also run against each one alone, recorded as 'alone')")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (printed)")
    args = ap.parse_args(argv)
    bugs = BUGS if not args.only else [b for b in BUGS if b["name"] in args.only]
    unknown = set(args.only or ()) - {b["name"] for b in bugs}
    if unknown:
        ap.error(f"unknown bug names: {sorted(unknown)}")
    planted = {b["name"]: planted_source(b) for b in bugs}  # every snippet checked before any run
    if not list(PACKAGE.glob("_ext*.so")):
        print("warning: no compiled extension in python/qfilters_mlx: the cpp backend's tests skip")
    root = Path(tempfile.mkdtemp(prefix="planted-"))
    try:
        ctl = root / "control"
        copy_package(ctl)
        imported = check_import(ctl)
        print(f"import qfilters_mlx -> {imported}")
        union = list(dict.fromkeys(t for b in bugs for t in b["tests"]))
        res = run_tests(ctl, union, args.timeout)
        control = {**res, "tests": union, "outcome": outcome(res, ctl, control=True)}
        print(f"control: {control['outcome']} ({res['seconds']} s)")
        if control["outcome"] != "pass":
            print("\n".join(res["tail"]))
        rows = []
        for b in (bugs if control["outcome"] == "pass" else []):  # no verdict against a failing control
            scratch = root / b["name"]
            pkg = copy_package(scratch)
            (pkg / b["file"]).write_text(planted[b["name"]])
            res = run_tests(scratch, b["tests"], args.timeout)
            row = {k: b[k] for k in ("name", "kind", "file", "what", "old", "new", "tests")}
            row.update(res, outcome=outcome(res, scratch, control=False))
            if args.each and len(b["tests"]) > 1:  # does every named test catch it on its own?
                alone = {t: run_tests(scratch, [t], args.timeout) for t in b["tests"]}
                row["alone"] = {t: {"outcome": outcome(r, scratch, control=False),
                                    "first_failure": r["first_failure"], "seconds": r["seconds"]}
                                for t, r in alone.items()}
            rows.append(row)
            print(f"{b['name']}: {row['outcome']} ({res['seconds']} s) {res['first_failure'] or ''}")
            if row["outcome"] == "error":
                print("\n".join(res["tail"]))
        report = {"python": sys.executable, "machine": f"{os.cpu_count()} cores, shared, nice -n 19",
                  "control": control, "bugs": rows}
        write_results(args.out, report)
        print(f"results: {args.out / 'planted_bugs.json'}  table: {args.out / 'planted_bugs.md'}")
    finally:
        if args.keep:
            print(f"scratch kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    ok = control["outcome"] == "pass" and all(r["outcome"] == "caught" for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
