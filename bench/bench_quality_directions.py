"""Directions for the eviction score and window, against StreamingLLM on the two held-out segments.

Every arm is evaluated by streaming eviction simulated in one forward pass per (arm, budget,
segment) (:mod:`qfilters_mlx.evaluation.simulate`: per-layer, per-KV-head attention masks of
the kept sets; the same per-token NLLs as feeding the caches token by token, tested, and the
StreamingLLM and calibrated cells reproduce ``eval_segments_{a,b}.json``). Protocol of
``qfilters-mlx eval --parts segments``: 128-token prefix, 2,048 scored tokens, 4 sinks, budgets
64-512, gap ratio to StreamingLLM with a 95% moving-block bootstrap interval.

Arms (``--arms``; scores fixed at insertion, statistics from the post-RoPE queries and keys of
the filters file's calibration text, the first 4,096 tokens of
:func:`qfilters_mlx.assets.prompts.calibration_text`):

* ``streaming_llm``; ``qfilters-calibrated@r1/2`` (the filters file, recent budget/2: the
  library's default rule); ``qfilters-perhead`` (the file's per-head windows, output rule);
  ``qfilters-decoded`` (the same filters, windows chosen by the decoded loss:
  ``bench/bench_decoded_windows.py``);
* ``soft-recency-<beta>@r1/2``: ``<k, u> + beta * sigma_h * position`` (``sigma_h``: the std of
  the head's calibration projections): an exponential recency prior in the attention's own
  units on top of the hard window, still one score per key at insertion;
* ``query-mean@r1/2``: ``<k, mu_h>``, the mean post-RoPE query of the GQA group instead of its top
  singular direction;
* ``pyramid-<alpha>@r1/2``: the calibrated filter with a budget per layer at the same total
  (:func:`pyramid_budgets`: linear in depth, ``alpha > 0`` more for the lower layers as in
  PyramidKV), each layer's recent window half its budget (simulated only: a cache takes one
  budget);
* ``expected-attention@r1/2``: ``log E[exp(q.k / sqrt(D))]`` for Gaussian queries ``N(mu_h,
  Sigma_h)``: ``mu_h.k / sqrt(D) + k^T Sigma_h k / (2 D)`` (the Gaussian query model of kvpress's
  ExpectedAttentionPress, with calibration statistics instead of the recent queries).

Usage (resumable: cells in the output are kept)::

    python bench/bench_quality_directions.py [--segments A,B] [--budgets 64,128,256,512]

Writes ``bench/results/quality_directions.json`` and ``.md`` (tables of
:func:`qfilters_mlx.evaluation.segment_report.segment_markdown`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import common  # noqa: F401  (fast BLAS before MLX)
import mlx.core as mx
from mlx_lm import load

from qfilters_mlx.assets.prepare_model import prepare_model
from qfilters_mlx.assets.prompts import calibration_text, source_text
from qfilters_mlx.config import KVCacheConfig, default_recent
from qfilters_mlx.evaluation.perplexity import full_cache_nll, perplexity
from qfilters_mlx.evaluation.segment_report import segment_markdown
from qfilters_mlx.evaluation.segments import segment_tokens
from qfilters_mlx.evaluation.simulate import MaskedArm, simulated_nll
from qfilters_mlx.filters.calibration import load_filters
from qfilters_mlx.filters.window_capture import keys_and_queries
from qfilters_mlx.filters.windows import load_windows

FILTERS = common.RESULTS / "smollm2_filters.safetensors"
DECODED = common.RESULTS / "smollm2_filters_decoded.safetensors"  # bench_decoded_windows.py
ARMS = ("streaming_llm,qfilters-calibrated@r1/2,qfilters-perhead,soft-recency-0.003@r1/2,"
        "query-mean@r1/2,expected-attention@r1/2")
PREFIX, SCORED, N_SINK, CALIB_TOKENS = 128, 2048, 4, 4096


def calibration_stats(model, tokenizer, filters) -> list[tuple]:
    """Per layer ``(mu [H, D], Sigma [H, D, D], sigma_proj [H])`` from one forward pass over the
    calibration tokens: the GQA group's post-RoPE queries pooled, and the std of the keys'
    projections on the filter."""
    text, _ = calibration_text()
    ids = tokenizer.encode(text, add_special_tokens=False)[:CALIB_TOKENS]
    (layers,) = keys_and_queries(model, [ids])
    stats = []
    for layer, (keys, queries, _) in enumerate(layers):
        q, k = mx.array(queries), mx.array(keys)  # [H_q, T, D], [H_kv, T, D] float32
        H, D = k.shape[0], k.shape[2]
        g = q.reshape(H, -1, D)  # query head h belongs to KV head h // (H_q / H_kv)
        mu = g.mean(axis=1)
        c = g - mu[:, None]
        proj = (k @ filters[layer][:, :, None])[..., 0]
        stats.append((mu, c.transpose(0, 2, 1) @ c / g.shape[1], mx.sqrt(proj.var(axis=1))))
        mx.eval(stats[-1])
    return stats


class LazyStats:
    """:func:`calibration_stats`, computed at the first ``stats[layer]`` (a forward pass of the
    4,096 calibration tokens that the window and budget arms do not need)."""

    def __init__(self, model, tokenizer, filters):
        self.args, self.value = (model, tokenizer, filters), None

    def __getitem__(self, layer: int) -> tuple:
        if self.value is None:
            self.value = calibration_stats(*self.args)
        return self.value[layer]


def scorer(name: str, filters, stats, budget: int):
    """``score(layer, keys [1, H, T, D]) -> [1, H, T]`` of a named direction at ``budget``."""
    def proj(layer, k):
        return (k @ filters[layer][:, :, None])[..., 0]

    if name.startswith("soft-recency-"):
        c = name[len("soft-recency-"):]
        beta = float(c[1:]) / budget if c.startswith("c") else float(c)

        def soft(layer, keys):
            k = keys[0].astype(mx.float32)
            pos = mx.arange(k.shape[1]).astype(mx.float32)
            return (proj(layer, k) + beta * stats[layer][2][:, None] * pos)[None]
        return soft
    if name == "query-mean":
        return lambda layer, keys: (keys[0].astype(mx.float32) @ stats[layer][0][:, :, None])[None, ..., 0]
    if name == "expected-attention":
        def expected(layer, keys):
            mu, sigma, _ = stats[layer]
            k = keys[0].astype(mx.float32)
            scale = k.shape[-1] ** -0.5
            return ((k @ mu[:, :, None])[..., 0] * scale
                    + ((k @ sigma) * k).sum(-1) * (scale * scale / 2))[None]
        return expected
    raise ValueError(f"unknown direction {name!r}")


def pyramid_budgets(budget: int, n_layers: int, alpha: float) -> list[int]:
    """Budgets per layer ``budget * (1 + alpha * (1 - 2 l / (L - 1)))`` rounded, summing to
    ``n_layers * budget`` exactly (the same bytes as one budget everywhere): ``alpha > 0`` gives
    the lower layers more (PyramidKV's shape), ``alpha < 0`` the upper ones."""
    if n_layers < 2:
        raise ValueError(f"pyramid budgets need 2 layers or more, got {n_layers}")
    raw = [budget * (1 + alpha * (1 - 2 * i / (n_layers - 1))) for i in range(n_layers)]
    out = [int(round(r)) for r in raw]
    out[n_layers // 2] += n_layers * budget - sum(out)  # rounding, put in the middle layer
    return out


def masked_arm(arm: str, budget: int, hd: int, filters, stats) -> tuple[MaskedArm, dict]:
    """The :class:`MaskedArm` of ``arm`` at ``budget`` and its description for the tables."""
    desc = {"arm": arm, "budget": budget, "n_sink": N_SINK}
    if arm == "streaming_llm":
        cfg = KVCacheConfig(method="streaming_llm", head_dim=hd, qfilters_budget=budget)
        return MaskedArm(cfg), {**desc, "method": "streaming_llm"}
    if arm.startswith("pyramid-"):
        alpha, _, window = arm[len("pyramid-"):].partition("@")
        if window != "r1/2":
            raise ValueError(f"{arm!r}: the pyramid arms take each layer's budget/2 window: write @r1/2")
        alpha = float(alpha)
        budgets = pyramid_budgets(budget, len(filters), alpha)
        windows = [[default_recent(b, N_SINK)] * filters.shape[1] for b in budgets]
        cfg = KVCacheConfig(method="qfilters", head_dim=hd, qfilters_budget=max(budgets), qfilters_n_sink=N_SINK,
                            qfilters_recent=windows)
        return (MaskedArm(cfg, filters=filters, budgets=tuple(budgets)),
                {**desc, "method": "qfilters", "recent": "budget/2 per layer", "budgets": budgets})
    if arm in ("qfilters-perhead", "qfilters-decoded"):
        path = FILTERS if arm == "qfilters-perhead" else DECODED
        name, recent = "qfilters-calibrated", load_windows(str(path), budget, N_SINK)
    else:
        name, window = arm.split("@")
        fractions = {"r0": 0, "r1/4": budget // 4, "r1/2": None, "r3/4": 3 * budget // 4}
        if window not in fractions:
            raise ValueError(f"unknown window {window!r} ({', '.join(fractions)} or qfilters-perhead)")
        recent = fractions[window]  # None: the streaming mode's default, budget // 2
    cfg = KVCacheConfig(method="qfilters", head_dim=hd, qfilters_budget=budget, qfilters_n_sink=N_SINK,
                        qfilters_recent=recent)
    per_head = arm in ("qfilters-perhead", "qfilters-decoded")
    desc.update(method="qfilters", recent="per head" if per_head else cfg.qfilters_recent)
    if name == "qfilters-calibrated":
        return MaskedArm(cfg, filters=filters), desc
    return MaskedArm(cfg, score=scorer(name, filters, stats, budget)), desc


def write_markdown(out, results: dict) -> None:
    """``out`` with ``.md``: the commands and the tables of every segment in ``results``."""
    out.with_suffix(".md").write_text(
        "# Quality directions (simulated streaming eviction, SmolLM2-135M-Instruct)\n\n"
        "Commands (each adds its cells to the same file):\n\n" + "".join(f"    {c}\n" for c in results["commands"])
        + "\n"
        "Segment `calibration` (the tuning text): tokens 4,096 to 6,271 of the calibration text, after "
        "the 4,096 the filters and the statistics come from, and the text `qfilters-decoded`'s windows were "
        "searched on (its cells there are in-sample); segments A and B are held out.\n\n"
        + segment_markdown(results))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default=ARMS)
    p.add_argument("--budgets", type=common.int_list, default=[64, 128, 256, 512])
    p.add_argument("--segments", default="A,B")
    p.add_argument("--out", default=str(common.RESULTS / "quality_directions.json"))
    a = p.parse_args()
    model, tokenizer = load(str(prepare_model()))
    filters, _ = load_filters(str(FILTERS), model)
    hd = filters.shape[-1]
    out = common.Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    old = results.get("segments_settings", {}).get("budgets", [])
    results["segments_settings"] = {"budgets": sorted(set(old) | set(a.budgets)), "n_sink": N_SINK,
                                    "ppl_prefix": PREFIX, "ppl_scored": SCORED}
    results.setdefault("meta", common.run_meta())
    command = " ".join(["python bench/bench_quality_directions.py", *sys.argv[1:]])
    if command not in results.setdefault("commands", []):
        results["commands"].append(command)
    stats = LazyStats(model, tokenizer, filters)  # only the score directions read them
    text = source_text()
    for seg in a.segments.split(","):
        if seg == "calibration":  # tuning text: after the tokens the statistics come from
            ctext, _ = calibration_text()
            ids = tokenizer.encode(ctext, add_special_tokens=False)[CALIB_TOKENS:CALIB_TOKENS + PREFIX + SCORED]
            span = None  # (tokens 4,096..6,271 of the calibration text; see the .md)
        else:
            ids, span = segment_tokens(tokenizer, text, seg, PREFIX + SCORED)
        results.setdefault("segment_spans", {})[seg] = span
        cells = results.setdefault("segments", {}).setdefault(seg, {})
        if "full" not in cells:
            nll = full_cache_nll(model, ids, PREFIX)
            cells["full"] = {"arm": "full", "ppl": perplexity(nll), "gap": 0.0, "nll": nll}
        for budget in a.budgets:
            for arm in a.arms.split(","):
                if f"{arm}@{budget}" in cells:
                    continue
                start = time.perf_counter()
                m, desc = masked_arm(arm, budget, hd, filters, stats)
                nll = simulated_nll(model, ids, m, PREFIX)
                ppl = perplexity(nll)
                cells[f"{arm}@{budget}"] = {**desc, "ppl": ppl, "gap": ppl - cells["full"]["ppl"],
                                            "nll": [round(x, 5) for x in nll]}
                print(f"{seg} {arm}@{budget}: {ppl:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
                out.write_text(json.dumps(results))
    write_markdown(out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
