"""Mutation report: merge ``tools/mutation.py`` runs, their ``--recheck`` and the
hand-classified equivalent mutants into ``bench/results/mutation.json`` and ``mutation.md``.

Usage (after ``python tools/mutation.py ...`` and ``... --resume --recheck`` in each work dir)::

    python tools/mutation_report.py [--workdir NEWEST ... OLDEST]

Several work dirs (newest first) combine per function: a mutant's result comes from the newest
run that checked it on the same function source (mutmut's function hash equal to the newest
run's), so an older run's results stand for the functions unchanged since and a run of the
changed or unchecked functions (``--only``) completes it.

Per module: mutmut's counts (``killed``, ``survived``, ``timeout``, ``no_tests``,
``not_checked``), then the final verdict of every mutant mutmut did not count as killed:
killed by a test of the recheck (its first failing test; or its test process crashed or
hung, the unmutated code having passed first), or ``equivalent: <reason>``
from ``tools/mutation_equivalents.json`` (``[{function, diff, reason}]``: matched by the
mutated function and the one-line diff, as mutmut renumbers mutants), or ``unexplained``
(or ``not rechecked``). ``score`` is killed / (checked - equivalent), checked = every
mutant mutmut ran (not "not checked" or "no tests"). README's table is rendered from the
JSON by :func:`table` (``tools/readme_results.py``, block ``mutation.json#table``).

``--previous COMMIT`` carries verdicts of the report committed at ``COMMIT`` (its
``bench/results/mutation.json``) where the code they judged is unchanged: a mutant the work
dirs did not check, of a function whose source (docstring aside) is the same at ``COMMIT``
and now, keeps its verdict there (killed, unless that report lists it otherwise), counted as
``carried``; a module no work dir holds is carried whole when its file is the same at
``COMMIT`` and now. Tests may have changed since; the carried count says how much rests on it.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no_tests", 33: "no_tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", None: "not_checked"}
RUNS = {  # work dir -> the command that made it, newest first
    "/tmp/qfm-loaded": "python tools/mutation.py --mutmut-path /work/mut-pkgs --workdir /tmp/qfm-loaded --modules "
                       "cache/quantized.py --only 'qfilters_mlx.cache.quantized.xǁQuantizedRowsǁloaded*' "
                       "'qfilters_mlx.cache.quantized.xǁQuantizedRowsǁsaved*' (QuantizedRows.loaded after it "
                       "changed during the run below)",
    "/tmp/qfm-engine": "python tools/mutation.py --mutmut-path /work/mut-pkgs --workdir /tmp/qfm-engine --modules "
                       "<the scorers and cache modules of tools/mutation.py's MODULES> [--resume --only <every "
                       "function of the scorers and of the cache modules first mutated here, and the functions "
                       "of kv_cache.py, journal.py, persistence.py and calibration.py changed since the "
                       "previous report>]",
}


def functions(path: Path) -> dict[str, str]:
    """``{name: source lines}`` of every function (sliced by line numbers: ``ast.get_source_segment``
    rescans the whole file per function, minutes on mutmut's mutant files)."""
    text = path.read_text()
    lines = text.splitlines()
    return {n.name: "\n".join(lines[n.lineno - 1 : n.end_lineno]) for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.FunctionDef)}


def mutant_diff(funcs: dict[str, str], name: str) -> str:
    """One line: the changed source lines of mutant ``name`` against the original."""
    mut = name.rsplit(".", 1)[1]
    orig = mut.split("__mutmut_")[0] + "__mutmut_orig"
    if mut not in funcs or orig not in funcs:
        return "?"
    a, b = funcs[orig].splitlines(), funcs[mut].splitlines()
    b[0] = b[0].replace(mut, orig)
    lines = [x for x in difflib.unified_diff(a, b, lineterm="", n=0)
             if x[:1] in "+-" and x[:3] not in ("+++", "---")]
    return " | ".join(" ".join(x.split()) for x in lines).replace(orig, "def")


def rechecks(work: Path) -> dict:
    """``{mutant: {"exit_code", "killed_by"}}`` from the recheck logs (also cut-short ones),
    recheck.json, and last ``recheck-manual.log`` (a mutant whose forked recheck crashed, re-run
    alone with pytest under ``MUTANT_UNDER_TEST``: ``NAME EXIT_CODE FIRST_FAILING_TEST`` per line)."""
    def read(log: Path) -> dict:
        found = {}
        for line in log.read_text().splitlines():
            parts = line.split(" ")
            if "__mutmut_" in parts[0] and len(parts) >= 2 and parts[1].lstrip("-").isdigit():
                found[parts[0]] = {"exit_code": int(parts[1]), "killed_by": " ".join(parts[2:])}
        return found

    found = {}
    for log in sorted(work.glob("recheck-*.log")):
        if log.name != "recheck-manual.log":
            found.update(read(log))
    if (work / "recheck.json").exists():
        found.update(json.loads((work / "recheck.json").read_text()))
    if (work / "recheck-manual.log").exists():  # mutants re-run one at a time by hand (same line format)
        found.update(read(work / "recheck-manual.log"))
    return found


def equivalent_key(mutant: str, diff: str) -> tuple[str, str]:
    """How ``tools/mutation_equivalents.json`` identifies mutant ``mutant`` (a mutmut name, or the
    entry's ``function``) with diff ``diff``: mutmut numbers a function's mutants anew when the
    covered lines change, so the key is the function and the diff's first 400 characters, not
    the number."""
    return mutant.split("__mutmut_")[0], diff[:400]


def load_equivalents() -> dict[tuple[str, str], str]:
    """``{equivalent_key: reason}`` of ``tools/mutation_equivalents.json``."""
    return {equivalent_key(e["function"], e["diff"]): e["reason"]
            for e in json.loads((REPO / "tools" / "mutation_equivalents.json").read_text())}


def _function(name: str) -> str:
    """The mutated function's key in mutmut's ``hash_by_function_name`` (``xǁClassǁmethod``, ``x_function``)."""
    return name.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]


def load_run(work: Path) -> dict:
    """``{module: {"codes", "hashes", "meta", "work"}}`` of one work dir's mutmut ``.meta`` files."""
    out = {}
    for meta in sorted((work / "mutants" / "src").rglob("*.py.meta")):
        module = str(meta.relative_to(work / "mutants" / "src" / "qfilters_mlx"))[: -len(".meta")]
        data = json.loads(meta.read_text())
        out[module] = {"codes": data["exit_code_by_key"], "hashes": data["hash_by_function_name"],
                       "meta": meta, "work": work}
    return out


def _sources(text: str) -> dict[str, str]:
    """``{mutmut function key: ast dump of its body without the docstring}`` of a module's text."""
    out = {}

    def add(key, node):
        body = node.body[1:] if (node.body and isinstance(node.body[0], ast.Expr)
                                 and isinstance(node.body[0].value, ast.Constant)
                                 and isinstance(node.body[0].value.value, str)) else node.body
        out[key] = ast.dump(ast.Module(body=body, type_ignores=[])) + ast.dump(node.args)

    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            add(f"x_{node.name}", node)
        elif isinstance(node, ast.ClassDef):
            for n in node.body:
                if isinstance(n, ast.FunctionDef):
                    add(f"xǁ{node.name}ǁ{n.name}", n)
    return out


class Previous:
    """The report committed at ``commit`` and the sources it judged (see the module doc)."""

    def __init__(self, commit: str):
        self.commit = commit
        self.report = json.loads(_git("show", f"{commit}:bench/results/mutation.json"))
        self.verdicts = {s["mutant"]: s for s in self.report["survivors"]}
        self._texts, self._functions = {}, {}

    def _module_text(self, module: str) -> tuple[str | None, str | None]:
        """The module's text at the commit and now (``None`` where it does not exist), read once."""
        if module not in self._texts:
            try:
                old = _git("show", f"{self.commit}:python/qfilters_mlx/{module}")
            except subprocess.CalledProcessError:
                old = None
            path = REPO / "python" / "qfilters_mlx" / module
            self._texts[module] = (old, path.read_text() if path.exists() else None)
        return self._texts[module]

    def same_module(self, module: str) -> bool:
        old, new = self._module_text(module)
        return old is not None and old == new

    def same_function(self, module: str, fn: str) -> bool:
        if module not in self.report["modules"]:  # (not judged by that report)
            return False
        if module not in self._functions:  # parsed once per module, not per mutant
            self._functions[module] = tuple(_sources(t) if t is not None else {} for t in self._module_text(module))
        old, new = self._functions[module]
        return fn in old and old[fn] == new.get(fn)

    def verdict(self, name: str) -> tuple[str, str]:
        """``(final key, verdict text)`` the earlier report gave mutant ``name``."""
        s = self.verdicts.get(name)
        if s is None:
            return "killed", f"killed (carried from {self.commit})"
        key = "equivalent" if s["status"].startswith("equivalent") else (
            "killed" if s["status"].startswith("killed") else s["status"].replace(" ", "_"))
        return key, f"{s['status']} (carried from {self.commit})"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def carried_modules(previous: Previous, modules: dict, survivors: list) -> list[str]:
    """Add the modules of the earlier report that no work dir holds and whose file is unchanged;
    returns the others (left out of this report)."""
    left = []
    for module, stats in previous.report["modules"].items():
        if module in modules:
            continue
        if not previous.same_module(module):
            left.append(module)
            continue
        modules[module] = {**stats, "carried": stats["total"]}
        survivors += [{**s, "status": f"{s['status']} (carried from {previous.commit})"}
                      for s in previous.report["survivors"] if s["module"] == module]
    return left


def verdicts(runs: list[dict], equivalents: dict, modules: dict, survivors: list,
             previous: Previous | None = None) -> None:
    """Add every module of ``runs`` (work dirs, newest first) to ``modules`` and its non-killed
    mutants to ``survivors``. A module's mutants are those of the newest run holding it; each
    mutant's result comes from the newest run that checked it *on the same function source*
    (mutmut's function hash equal to the newest run's): an older run's results stand for
    the functions unchanged since."""
    rechecked = {}
    for module in dict.fromkeys(m for run in runs for m in run):
        holding = [run[module] for run in runs if module in run]
        newest = holding[0]
        funcs = {}
        raw, final = Counter(), Counter()
        for name in sorted(newest["codes"]):
            fn = _function(name)
            src = next((r for r in holding if r["codes"].get(name) is not None
                        and r["hashes"].get(fn) == newest["hashes"].get(fn)), newest)
            code = src["codes"].get(name)
            status = STATUS.get(code, "suspicious")
            if code is None and previous is not None and previous.same_function(module, fn):
                key, verdict = previous.verdict(name)
                raw["carried"] += 1
                final[key] += 1
                final["carried"] += 1
                if name in previous.verdicts:
                    survivors.append({**previous.verdicts[name], "status": verdict})
                continue
            raw[status] += 1
            if status in ("not_checked", "skipped", "killed"):
                final[status] += 1
                continue
            work = src["work"]
            if work not in rechecked:
                rechecked[work] = rechecks(work)
            if src["meta"] not in funcs:
                funcs[src["meta"]] = functions(src["meta"].with_suffix(""))
            r = rechecked[work].get(name)
            diff = mutant_diff(funcs[src["meta"]], name)
            reason = equivalents.get(equivalent_key(name, diff))
            if status == "no_tests" and reason is None:
                final[status] += 1
                verdict = "no tests"
            elif r and r["exit_code"] == 1:
                verdict = "killed by " + r["killed_by"]
                final["killed"] += 1
            elif r and r["exit_code"] < 0 and r["killed_by"].startswith("(test process"):
                # crashed or hung (the recheck ran the unmutated code first: it passed)
                verdict = "killed: " + r["killed_by"].strip("()")
                final["killed"] += 1
            elif reason is not None:
                verdict = "equivalent: " + reason
                final["equivalent"] += 1
            else:
                verdict = "unexplained" if r else "not rechecked"
                final[verdict.replace(" ", "_")] += 1
            survivors.append({"mutant": name, "module": module, "mutmut": status,
                              "diff": diff, "status": verdict})
        checked = sum(v for k, v in raw.items() if k not in ("not_checked", "no_tests", "skipped", "carried"))
        modules[module] = {
            "total": len(newest["codes"]), "mutmut": dict(raw),
            "mutmut_score": round((raw["killed"] + raw["timeout"]) / max(checked, 1), 4),
            "final": dict(final), "checked": checked, "carried": final["carried"],
            "score": round(final["killed"] / max(checked + final["carried"] - final["equivalent"], 1), 4),
        }


def _percent(x: float, mutants: int) -> str:
    return f"{100 * x:.1f}%" if mutants else "-"  # (a module of class attributes only has no mutant)


def table(results: dict) -> str:
    """README/markdown table of the per-module scores in ``results`` (mutation.json)."""
    rows = ["| module | mutants | checked | carried | killed | equivalent | unexplained | not checked / no tests "
            "| mutmut's score | score |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, s in results["modules"].items():
        f = s["final"]
        rows.append(f"| {m} | {s['total']} | {s['checked']} | {s.get('carried', 0)} | {f.get('killed', 0)} "
                    f"| {f.get('equivalent', 0)} "
                    f"| {f.get('unexplained', 0) + f.get('not_rechecked', 0)} "
                    f"| {f.get('not_checked', 0)} / {f.get('no_tests', 0)} "
                    f"| {_percent(s['mutmut_score'], s['checked'])} "
                    f"| {_percent(s['score'], s['checked'] + s.get('carried', 0))} |")
    return "\n".join(rows) + "\n"


def markdown(results: dict) -> str:
    """The whole report: commands, table, every non-killed mutant's verdict grouped by test / reason."""
    out = ["# Mutation check (mutmut 3.8.1): the eviction core", "", "Commands (from the repository root):", ""]
    out += [f"    {c}" for c in results["commands"]]
    prev = results.get("previous")
    out += ["    python tools/mutation.py ... --resume --recheck [TEST ...]   # per work dir: survivors, timeouts, crashes",
            "    python tools/mutation_report.py --workdir " + " ".join(results.get("workdirs", []))
            + (f" --previous {prev['commit']}" if prev else ""), ""]
    if prev:
        out += [f"*Carried*: mutants of functions (or whole modules) whose source is the same as when the report "
                f"committed at {prev['commit']} judged them keep that report's verdict (its runs: "
                + "; ".join(f"`{c}`" for c in prev["commands"]) + "). The tests may have changed since. "
                + (f"Left out (changed since, not re-run here): {', '.join(prev['left_out'])}." if prev["left_out"]
                   else ""), ""]
    out += [table(results),
            "Score = killed / (checked + carried - equivalent); checked = mutants mutmut ran. mutmut's score = "
            "(killed + timeout) / checked, before the recheck. Below: every mutant mutmut did not count "
            "as killed (survived, timeout, suspicious = crashed, no tests) and what became of it.", ""]
    groups = defaultdict(list)
    for s in results["survivors"]:
        key = s["status"].split(":")[0] if s["status"].startswith("equivalent") else s["status"]
        groups[key].append(s)
    for key in sorted(groups, key=lambda k: (not k.startswith("killed"), k)):
        out += [f"## {key} ({len(groups[key])})", ""]
        for s in groups[key]:
            reason = s["status"][len("equivalent: "):] if key == "equivalent" else ""
            out.append(f"- `{s['mutant'].split('.', 2)[-1]}` ({s['mutmut']}): `{s['diff'][:200]}`"
                       + (f" — {reason}" if reason else ""))
        out.append("")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", nargs="+", default=[d for d in RUNS if Path(d).exists()])
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "mutation"))
    p.add_argument("--previous", metavar="COMMIT", default=None,
                   help="carry the verdicts of the report committed at COMMIT for unchanged code (module doc)")
    a = p.parse_args()
    previous = Previous(a.previous) if a.previous else None
    equivalents = load_equivalents()
    modules, survivors = {}, []
    verdicts([load_run(Path(w)) for w in a.workdir], equivalents, modules, survivors, previous)
    left = carried_modules(previous, modules, survivors) if previous else []
    results = {"commands": [RUNS.get(w, f"python tools/mutation.py --workdir {w} ...") for w in a.workdir],
               "workdirs": list(a.workdir),
               "score": "killed / (checked + carried - equivalent); checked: mutants mutmut ran",
               "modules": modules, "survivors": survivors}
    if previous:
        results["previous"] = {"commit": previous.commit, "commands": previous.report["commands"],
                               "left_out": left}
    Path(a.out + ".json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    Path(a.out + ".md").write_text(markdown(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
