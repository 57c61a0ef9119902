"""Mutation report: merge a ``tools/mutation.py`` run, its ``--recheck`` and the
hand-classified equivalent mutants into ``bench/results/mutation.json`` and ``.md``.

Usage (after ``python tools/mutation.py ...`` and ``... --resume --recheck``)::

    python tools/mutation_report.py [--workdir /tmp/qfilters-mutation]

Per module: mutmut's counts (``killed``, ``survived``, ``timeout``, ``no_tests``,
``not_checked``), then the final verdicts after the recheck: a survivor or timeout
killed by a test, or ``equivalent: <reason>`` from ``tools/mutation_equivalents.json``
(``{mutant name: reason}``), or ``unexplained``. ``score`` is killed / (checked -
equivalent), checked = every mutant mutmut ran (not "not checked" or "no tests").
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no_tests", 33: "no_tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", None: "not_checked"}


def functions(path: Path) -> dict[str, str]:
    text = path.read_text()
    return {n.name: ast.get_source_segment(text, n) for n in ast.walk(ast.parse(text))
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/qfilters-mutation")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "mutation"))
    p.add_argument("--command", default="python tools/mutation.py --mutmut-path /work/mut-pkgs "
                   "--modules backends/reference.py cache/scorers.py cache/kv_cache.py")
    a = p.parse_args()
    work = Path(a.workdir)
    recheck_path = work / "recheck.json"
    recheck = {}
    for log in sorted(work.glob("recheck-*.log")):  # one line per mutant, also of a cut-short recheck
        for line in log.read_text().splitlines():
            parts = line.split(" ")
            if "__mutmut_" in parts[0] and len(parts) >= 2 and parts[1].lstrip("-").isdigit():
                recheck[parts[0]] = {"exit_code": int(parts[1]), "killed_by": " ".join(parts[2:])}
    if recheck_path.exists():
        recheck.update(json.loads(recheck_path.read_text()))
    equivalents = json.loads((REPO / "tools" / "mutation_equivalents.json").read_text())
    modules, survivors = {}, []
    for meta in sorted((work / "mutants" / "src").rglob("*.py.meta")):
        module = str(meta.relative_to(work / "mutants" / "src" / "qfilters_mlx"))[: -len(".meta")]
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        funcs = functions(meta.with_suffix(""))
        raw = Counter(STATUS.get(c, "suspicious") for c in codes.values())
        final = Counter()
        for name, code in sorted(codes.items()):
            status = STATUS.get(code, "suspicious")
            if status in ("not_checked", "no_tests", "skipped", "killed"):
                final[status] += 1
                continue
            r = recheck.get(name)
            if r and r["exit_code"] == 1:
                verdict = "killed by " + r["killed_by"]
                final["killed"] += 1
            elif name in equivalents:
                verdict = "equivalent: " + equivalents[name]
                final["equivalent"] += 1
            else:
                verdict = "unexplained" if r else "not rechecked"
                final[verdict.replace(" ", "_")] += 1
            survivors.append({"mutant": name, "module": module, "mutmut": status,
                              "diff": mutant_diff(funcs, name), "status": verdict})
        checked = sum(v for k, v in raw.items() if k not in ("not_checked", "no_tests", "skipped"))
        denom = checked - final["equivalent"]
        modules[module] = {
            "total": len(codes), "mutmut": dict(raw),
            "mutmut_score": round((raw["killed"] + raw["timeout"]) / max(checked, 1), 4),
            "final": dict(final), "checked": checked,
            "score": round(final["killed"] / max(denom, 1), 4),
        }
    out = {"command": a.command, "recheck": a.command + " --resume --recheck",
           "score": "killed / (checked - equivalent); checked: mutants mutmut ran",
           "modules": modules, "survivors": survivors}
    Path(a.out + ".json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    rows = ["| module | mutants | checked | killed | equivalent | unexplained | not checked | score |",
            "|---|---|---|---|---|---|---|---|"]
    for m, s in modules.items():
        f = s["final"]
        rows.append(f"| {m} | {s['total']} | {s['checked']} | {f.get('killed', 0)} | {f.get('equivalent', 0)} "
                    f"| {f.get('unexplained', 0) + f.get('not_rechecked', 0)} "
                    f"| {f.get('not_checked', 0) + f.get('no_tests', 0)} | {100 * s['score']:.1f}% |")
    print("\n".join(rows))
    Path(a.out + ".table.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
