"""The default configuration (the calibrated query filter) on SmolLM2-135M-Instruct.

Four measurements, in one run:

1. **First and second use**: ``KVCacheBuilder.for_model(model, KVCacheConfig(), tokenizer=tok)``
   with an empty ``QFILTERS_MLX_HOME`` (a temporary folder): the first build calibrates and
   stores the file (seconds, wall clock, including the progress bar); the second finds and
   loads it. Also the first use without a tokenizer (the model samples its calibration text).
2. **Streaming perplexity** (:mod:`qfilters_mlx.evaluation`: prefix 128, 2,048 scored tokens of
   the evaluation text, budget 256, 4 sinks, recent 128) of the default caches against the
   evaluation's calibrated arm (``bench/results/smollm2_filters.safetensors``: 4,096 tokens of
   the same calibration text, ``qfilters-mlx calibrate``'s default), both rows in one batch.
3. **Decode speed** at a 4,096-token prompt, budget 256 (``bench_generate.run_once``: mlx-lm's
   ``generate_step``, prefill steps of 2,048): the default (``qfilters-cpp-calibrated``), the
   previous default (the online query filter inside ``observe_queries``,
   ``qfilters-cpp-queries``) and mlx-lm's ``RotatingKVCache(max_size=256, keep=4)``, run
   interleaved ``--repeats`` times; reported as generation tokens/s and the ratio of each
   Q-Filters arm to the rotating run of the same repeat.

4. **Per-head windows at first use**: the time to choose per-head recent windows
   (:func:`qfilters_mlx.filters.windows.calibrate_windows`, the output rule, budget 256) on the
   same 512 calibration tokens (one forward pass capturing keys, queries and values, then the
   search), against the filters' calibration time.

Writes ``bench/results/default.json`` and ``default.md``::

    python bench/bench_default.py [--repeats 2] [--max-tokens 64] [--skip-ppl] [--skip-speed]
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

BUDGET, PREFIX, SCORED, CONTEXT = 256, 128, 2048, 4096
ARMS = ("rotating", "qfilters-cpp-queries", "qfilters-cpp-calibrated")


def first_and_second_use(model, tokenizer, with_sampling: bool = True) -> dict:
    from qfilters_mlx import KVCacheBuilder, KVCacheConfig

    out = {}
    for label, tok in (("text", tokenizer), ("no_tokenizer", None))[:2 if with_sampling else 1]:
        with tempfile.TemporaryDirectory() as home:
            os.environ["QFILTERS_MLX_HOME"] = home
            t0 = time.perf_counter()
            first = KVCacheBuilder.for_model(model, KVCacheConfig(), tokenizer=tok)
            t1 = time.perf_counter()
            loads = []
            for _ in range(3):
                t2 = time.perf_counter()
                second = KVCacheBuilder.for_model(model, KVCacheConfig(), tokenizer=tok)
                loads.append(time.perf_counter() - t2)
            out[label] = {"first_use_s": t1 - t0, "second_use_s": statistics.median(loads),
                          "loads_s": loads, "first": first.report.filters,
                          "second": second.report.filters}
            if label == "text":
                out["default_filters"] = mx.stack([c.filter for c in first])
    return out


def window_time(model, tokenizer, filters) -> dict:
    import numpy as np

    from qfilters_mlx.assets.prompts import calibration_text
    from qfilters_mlx.filters.default_filters import CALIBRATION_TOKENS, encode_quietly
    from qfilters_mlx.filters.window_capture import keys_and_queries
    from qfilters_mlx.filters.windows import calibrate_windows

    ids = encode_quietly(tokenizer, calibration_text()[0])[:CALIBRATION_TOKENS]
    t0 = time.perf_counter()
    data = list(keys_and_queries(model, [ids]))
    t1 = time.perf_counter()
    windows, summary = calibrate_windows(data, np.array(filters), n_sink=4, budgets=(BUDGET,))
    t2 = time.perf_counter()
    m = summary[BUDGET]
    return {"tokens": len(ids), "budget": BUDGET, "capture_s": t1 - t0, "search_s": t2 - t1,
            "total_s": t2 - t0, "mean_window": m["mean_window"],
            "output_error_chosen": m["output_chosen"], "output_error_half": m["output_half"]}


def perplexities(model, tokenizer, default_filters) -> dict:
    from qfilters_mlx import KVCacheConfig, QFiltersKVCache
    from qfilters_mlx.assets.prompts import source_text
    from qfilters_mlx.evaluation.perplexity import batched_streaming_nll, perplexity
    from qfilters_mlx.filters.calibration import load_filters

    arm_filters, meta = load_filters(str(common.RESULTS / "smollm2_filters.safetensors"), model)
    ids = tokenizer.encode(source_text(), add_special_tokens=False)[:PREFIX + SCORED]
    cfg = KVCacheConfig(qfilters_budget=BUDGET, head_dim=64)
    rows = {"default (512 tokens, for_model)": default_filters,
            f"calibrated arm ({meta['calibration_tokens']} tokens, eval)": arm_filters}
    caches = [[QFiltersKVCache(cfg, layer_idx=i, filters=f[i]) for i in range(f.shape[0])]
              for f in rows.values()]
    t0 = time.perf_counter()
    nll = batched_streaming_nll(model, ids, caches, prefix=PREFIX)
    return {"budget": BUDGET, "n_sink": cfg.qfilters_n_sink, "recent": cfg.qfilters_recent,
            "prefix": PREFIX, "scored": SCORED, "seconds": time.perf_counter() - t0,
            "ppl": {k: perplexity(v) for k, v in zip(rows, nll)}}


def decode_speed(model, tokenizer, repeats: int, max_tokens: int) -> dict:
    import bench_generate

    prompt = common.prompts(tokenizer, [CONTEXT])[CONTEXT]
    runs = {a: [] for a in ARMS}
    for r in range(repeats):
        for arm in ARMS:
            res = bench_generate.run_once(model, prompt, arm, BUDGET, max_tokens)
            runs[arm].append(res)
            print(f"repeat {r} {arm}: {res['generation_tps']:.2f} tok/s", flush=True)
    ratios = {a: [runs[a][i]["generation_tps"] / runs["rotating"][i]["generation_tps"]
                  for i in range(repeats)] for a in ARMS[1:]}
    return {"context": CONTEXT, "budget": BUDGET, "max_tokens": max_tokens, "repeats": repeats,
            "generation_tps": {a: [x["generation_tps"] for x in v] for a, v in runs.items()},
            "cache_ms_per_step": {a: [x.get("cache_ms_per_step") for x in v] for a, v in runs.items()},
            "ratio_to_rotating": ratios,
            "median_ratio_to_rotating": {a: statistics.median(v) for a, v in ratios.items()},
            "tokens_equal_across_qfilters_arms": [
                runs[ARMS[1]][i]["tokens_head"] == runs[ARMS[2]][i]["tokens_head"]
                for i in range(repeats)]}


def markdown(res: dict) -> str:
    lines = ["# The default configuration (calibrated query filter), SmolLM2-135M-Instruct", "",
             "`python bench/bench_default.py` (" + res["meta"]["machine"] + f", load average at start "
             f"{res['meta']['loadavg_start'][0]:.1f})", "", "## First and second use of `for_model`", ""]
    u = res["use"]
    lines += common.md_table(["tokens from", "first use (calibrate + store), s", "next builds (load), s"],
                             [[k + f" ({u[k]['first'].split(' tokens of ')[0].split('; ')[-1]} tokens)",
                               f"{u[k]['first_use_s']:.1f}",
                               ", ".join(f"{x:.3f}" for x in u[k].get("loads_s", [u[k]["second_use_s"]]))]
                              for k in ("text", "no_tokenizer") if k in u], "lrr")
    w = res.get("windows")
    lines += [] if w is None else ["", f"Choosing per-head recent windows at first use (budget {w['budget']}, the same "
                  f"{w['tokens']} tokens): {w['total_s']:.1f} s ({w['capture_s']:.1f} s capturing keys, "
                  f"queries and values, {w['search_s']:.1f} s searching); mean window "
                  f"{w['mean_window']:.1f}, attention-output error {w['output_error_chosen']:.4g} vs "
                  f"{w['output_error_half']:.4g} at budget/2."]
    if "perplexity" in res:
        p = res["perplexity"]
        lines += ["", f"## Streaming perplexity (budget {p['budget']}, {p['n_sink']} sinks, recent "
                      f"{p['recent']}, prefix {p['prefix']}, {p['scored']} scored tokens)", ""]
        lines += common.md_table(["filters", "perplexity"], [[k, f"{v:.3f}"] for k, v in p["ppl"].items()],
                                 "lr")
    if "speed" in res:
        s = res["speed"]
        lines += ["", f"## Decode speed ({s['context']}-token prompt, budget {s['budget']}, "
                      f"{s['max_tokens']} tokens, {s['repeats']} interleaved repeats)", ""]
        rows = [[a, ", ".join(f"{x:.2f}" for x in s["generation_tps"][a]),
                 "1" if a == "rotating" else ", ".join(f"{x:.3f}" for x in s["ratio_to_rotating"][a])]
                for a in ARMS]
        lines += common.md_table(["arm", "generation tok/s", "ratio to rotating (same repeat)"], rows, "lrr")
        med = s["median_ratio_to_rotating"]
        lines += ["", f"Default / previous default (medians of the paired ratios): "
                      f"{med[ARMS[2]] / med[ARMS[1]]:.3f}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-windows", action="store_true")
    p.add_argument("--skip-sampling", action="store_true", help="no first use without a tokenizer")
    p.add_argument("--out", type=Path, default=common.RESULTS / "default.json")
    args = p.parse_args(argv)
    model, tokenizer = common.load_model()
    res = {"meta": common.run_meta()}
    use = first_and_second_use(model, tokenizer, not args.skip_sampling)
    default_filters = use.pop("default_filters")
    res["use"] = use
    if not args.skip_windows:
        res["windows"] = window_time(model, tokenizer, default_filters)
    common.write_results(args.out, res, markdown(res))
    if not args.skip_ppl:
        res["perplexity"] = perplexities(model, tokenizer, default_filters)
        common.write_results(args.out, res, markdown(res))
    if not args.skip_speed:
        with tempfile.TemporaryDirectory() as home:  # the calibrated arm's file, made once
            os.environ["QFILTERS_MLX_HOME"] = home
            from qfilters_mlx.filters.calibration import save_filters
            from qfilters_mlx.filters.default_filters import stored_path
            from qfilters_mlx.identity import model_identity

            path = stored_path(model_identity(model))
            path.parent.mkdir(parents=True)
            save_filters(str(path), default_filters, model)
            res["speed"] = decode_speed(model, tokenizer, args.repeats, args.max_tokens)
        common.write_results(args.out, res, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
