"""Recent windows chosen by the decoded loss (:mod:`qfilters_mlx.evaluation.decoded_windows`) on
SmolLM2-135M-Instruct, written into a copy of the shipped filters file.

Search text: tokens 4,096 to 6,271 of the calibration text (128-token prefix, 2,048 scored), after
the 4,096 tokens the filters come from; the held-out segments A and B are disjoint from it. Each
budget's search is saved as soon as it ends (resumable).

Usage::

    python bench/bench_decoded_windows.py [--budgets 64,128,256,512] [--group 5]

Writes ``bench/results/decoded_windows.json`` (windows, search settings and trace per budget;
a budget already there with other settings is refused), its table ``decoded_windows.md``, and
``bench/results/smollm2_filters_decoded.safetensors`` (the filters of
``smollm2_filters.safetensors`` with the windows of every budget searched so far; evaluate with
``bench/bench_quality_directions.py --arms qfilters-decoded``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import common  # noqa: F401  (fast BLAS before MLX)
import numpy as np
from mlx_lm import load

from qfilters_mlx.assets.prepare_model import prepare_model
from qfilters_mlx.assets.prompts import calibration_text
from qfilters_mlx.filters.calibration import load_filters, save_filters
from qfilters_mlx.evaluation.decoded_windows import (DECODED_FRACTIONS, DECODED_PREFIX, decoded_summary,
                                                  search_windows)
from qfilters_mlx.filters.windows import window_tensors

FILTERS = common.RESULTS / "smollm2_filters.safetensors"
DECODED = common.RESULTS / "smollm2_filters_decoded.safetensors"
CALIB_TOKENS, SCORED, N_SINK = 4096, 2048, 4


def write_markdown(out, results: dict) -> None:
    """``out`` with ``.md``: the command and, per budget, the chosen window of each group of layers
    and the search text's perplexity at the default window and after the search."""
    st = results["settings"]
    rows = []
    for b, r in sorted(results["budgets"].items(), key=lambda kv: int(kv[0])):
        tr = r["trace"]
        groups = " / ".join(f"{g['chosen']}" for g in tr["groups"])
        rows.append(f"| {b} | {tr['start']} | {groups} | {np.mean(r['windows']):.1f} | "
                    f"{math.exp(tr['start_nll']):.3f} | {math.exp(tr['nll']):.3f} | {r['seconds'] / 60:.1f} |")
    layers = ", ".join(f"{g['layers'][0]}-{g['layers'][1] - 1}"
                       for g in next(iter(results["budgets"].values()))["trace"]["groups"])
    out.with_suffix(".md").write_text(
        "# Recent windows chosen by the decoded loss (SmolLM2-135M-Instruct)\n\n"
        "Commands:\n\n" + "".join(f"    {c}\n" for c in results["commands"]) + "\n"
        f"Search text: {st['search_text']} ({st['prefix']}-token first call, {st['scored']} scored tokens); "
        f"filters `{st['filters']}`; {st['n_sink']} sinks; candidates: the default window (budget/2) and "
        f"round(f x (budget - n_sink)) for f in {st['fractions']}; groups of {st['group']} layers "
        f"({layers}), searched bottom-up. Perplexity: of the scored search tokens under simulated "
        "streaming eviction (held-out results: `quality_directions.md`, arm `qfilters-decoded`).\n\n"
        "| budget | default window | chosen window per group of layers | mean window | perplexity at the "
        "default window | after the search | search minutes |\n|---|---|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=common.int_list, default=[64, 128, 256, 512])
    p.add_argument("--group", type=int, default=5)
    p.add_argument("--out", default=str(common.RESULTS / "decoded_windows.json"))
    a = p.parse_args()
    model, tokenizer = load(str(prepare_model()))
    filters, meta = load_filters(str(FILTERS), model)
    text, source = calibration_text()
    ids = tokenizer.encode(text, add_special_tokens=False)[CALIB_TOKENS:CALIB_TOKENS + DECODED_PREFIX + SCORED]
    out = common.Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", common.run_meta())
    search = {"filters": FILTERS.name, "group": a.group, "fractions": list(DECODED_FRACTIONS)}
    results["settings"] = {**search, "search_text": f"{source}, tokens {CALIB_TOKENS}..{CALIB_TOKENS + len(ids) - 1}",
                           "prefix": DECODED_PREFIX, "scored": len(ids) - DECODED_PREFIX, "n_sink": N_SINK}
    budgets = results.setdefault("budgets", {})
    for b in a.budgets:  # a budget searched before with other settings is not passed off as this run's
        old = budgets.get(str(b), {}).get("search", search)
        if old != search:
            raise SystemExit(f"{out}: budget {b} was searched with {old}, not {search}: use another --out")
    command = " ".join(["python bench/bench_decoded_windows.py", *sys.argv[1:]])
    if any(str(b) not in budgets for b in a.budgets) and command not in results.setdefault("commands", []):
        results["commands"].append(command)  # (a run that searches nothing only writes the files)
    for b in a.budgets:
        if str(b) in budgets:
            continue
        start = time.perf_counter()
        w, trace = search_windows(model, ids, np.array(filters), b, N_SINK, group=a.group,
                                  progress=lambda line: print(line, flush=True))
        budgets[str(b)] = {"windows": w.tolist(), "trace": trace, "seconds": time.perf_counter() - start,
                           "search": search}
        print(f"budget {b}: mean NLL {trace['start_nll']:.4f} -> {trace['nll']:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        out.write_text(json.dumps(results, indent=1))
    done = sorted(int(b) for b in budgets)
    windows = np.stack([np.array(budgets[str(b)]["windows"], np.int32) for b in done])
    summary = {b: decoded_summary(windows[i], budgets[str(b)]["trace"]) for i, b in enumerate(done)}
    save_filters(str(DECODED), filters, model, windows=window_tensors(windows, done, N_SINK, summary, rule="decoded"),
                 **{k: v for k, v in meta.items() if k.startswith("calibration")})
    write_markdown(out, results)
    print(f"wrote {DECODED} (budgets {done})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
