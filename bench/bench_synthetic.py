"""Synthetic harness: which tokens does each eviction score keep, and what does it cost the attention output?

No model: keys, values and queries are drawn per (regime, length, seed, head), every arm selects
``budget`` tokens with the package's own scorers and selection (``qfilters_mlx.backends.reference``,
``qfilters_mlx.scorers``), and the attention output of held-out probe queries over the kept set is
compared with the output over all tokens.

Regimes
  paper_like: keys and queries share a dominant axis ``u`` (per head, random). Queries point along
      ``+u`` (plus noise), so tokens with a large ``<k, u>`` receive the attention. The keys' mean
      projection on ``u`` is *negative* (``-mu``), as measured on SmolLM2 (docs/method.md, "Filters": the key-SVD
      direction, oriented so that keys project positively, points against the queries): the key-SVD
      filter is ``~ -u``, so sign -1 is the right sign here and +1 keeps the wrong tokens.
  isotropic: plain Gaussian keys and queries (no shared axis): no score can know what attention
      wants; every arm should be close to random.

Arms (n_sink 4 everywhere; scored arms keep no recent window, the synthetic data having no recency)
  qfilters-keys+1 / -1: key-SVD filter from the first ``calib`` keys, score ``sign * <k, u_hat>``;
  best-of-sign: per (head, seed) the better of the two, reported as a *selection bonus* (it looks at
      the answer), not a method;
  qfilters-queries: the paper's estimator from ``calib`` calibration queries (same distribution as the
      probes, different draws);
  l2norm: ``-||k||``; streaming_llm: 4 sinks + the last ``budget - 4``; random: seeded;
  h2o: cumulative attention mass each key received from ``calib`` observation queries (H2O-style;
      observation queries are not the probe queries).

Metrics: output perturbation ``1 - cos(out_kept, out_full)`` averaged over probe queries, heads and
seeds; ``filter_cosine`` between the (signed) filter and the planted axis (paper_like only); bytes
kept (float32 K/V + float32 scores + the filter, as ``QFiltersKVCache.qfilters_kept_bytes``); time per
eviction (for all heads: filter estimation (SVD) for the Q-Filters arms, the observation
queries' attention for h2o, scoring and selection of ``T`` tokens; ``mx.eval``-timed, median).

Run: ``python bench/bench_synthetic.py`` (about a minute on 2 cores); writes
``bench/results/synthetic.json`` and ``bench/results/synthetic.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import common  # noqa: E402,I001  (first: fast BLAS before MLX; same folder)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from qfilters_mlx.backends import reference  # noqa: E402
from qfilters_mlx.cache.kv_cache import insertion_scores  # noqa: E402

LENGTHS = (256, 512, 1024)
BUDGETS = (64, 128)
HEAD_DIM = 64
HEADS = 4
SEEDS = (0, 1, 2)
N_SINK = 4
CALIB = 128
PROBES = 32
REGIMES = ("paper_like", "isotropic")
ARMS = ("qfilters-keys+1", "qfilters-keys-1", "best-of-sign", "qfilters-queries", "l2norm",
        "streaming_llm", "h2o", "random")


def draw(regime: str, T: int, seed: int, H: int = HEADS, D: int = HEAD_DIM):
    """keys, values [H, T, D]; probe, observation and calibration queries [H, n, D]; axes [H, D]."""
    rng = np.random.default_rng(seed)
    axes = rng.normal(size=(H, D))
    axes /= np.linalg.norm(axes, axis=1, keepdims=True)
    values = rng.normal(size=(H, T, D))
    n_q = PROBES + 2 * CALIB
    if regime == "paper_like":
        # <k, u> = -mu + sigma * z: mean points against the queries; spread decides attention.
        proj = -3.0 + 1.5 * rng.normal(size=(H, T))
        keys = rng.normal(size=(H, T, D)) + proj[..., None] * axes[:, None, :]
        qproj = 4.0 + 0.5 * rng.normal(size=(H, n_q))
        queries = 0.5 * rng.normal(size=(H, n_q, D)) + qproj[..., None] * axes[:, None, :]
    elif regime == "isotropic":
        keys = rng.normal(size=(H, T, D))
        queries = 2.0 * rng.normal(size=(H, n_q, D))
    else:
        raise ValueError(regime)
    probe, obs, calib = np.split(queries, [PROBES, PROBES + CALIB], axis=1)
    return keys, values, probe, obs, calib, axes


def attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v per head; q [H, n, D], k/v [H, S, D]."""
    logits = q @ np.swapaxes(k, 1, 2) / math.sqrt(q.shape[-1])
    logits -= logits.max(axis=-1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(axis=-1, keepdims=True)
    return w @ v, w


def arm_scores(arm: str, keys: np.ndarray, obs: np.ndarray, calib: np.ndarray, seed: int):
    """``([H, T] float32 scores or None for streaming_llm, filter [H, D] or None)``."""
    k = mx.array(keys[None], dtype=mx.float32)  # [1, H, T, D]
    H, T, _ = keys.shape
    pos = mx.broadcast_to(mx.arange(T, dtype=mx.int64)[None, None], (1, H, T))
    filt = None
    if arm.startswith("qfilters-keys"):
        filt = reference.estimate_filter_from_keys(k[:, :, :CALIB])
        sign = 1 if arm.endswith("+1") else -1
        s = insertion_scores("qfilters", k, pos, filters=filt, sign=sign)
        filt = filt * sign
    elif arm == "qfilters-queries":
        filt = reference.estimate_filter_from_queries(mx.array(calib[None], dtype=mx.float32), H)
        s = insertion_scores("qfilters", k, pos, filters=filt, sign=1)
    elif arm == "l2norm":
        s = insertion_scores("l2norm", k, pos)
    elif arm == "random":
        s = insertion_scores("random", k, pos, seed=seed, layer=0)
    elif arm == "h2o":
        _, w = attention(obs, keys, keys)  # values unused
        s = mx.array(w.sum(axis=1)[None], dtype=mx.float32)
    elif arm == "streaming_llm":
        s = mx.zeros((1, H, T), mx.float32)
    else:
        raise ValueError(arm)
    return s, filt


def select(arm: str, scores: mx.array, budget: int) -> mx.array:
    recent = budget - N_SINK if arm == "streaming_llm" else 0
    return reference.select_keep(scores, budget, N_SINK, recent)  # [1, H, budget]


def kept_bytes(arm: str, budget: int, H: int = HEADS, D: int = HEAD_DIM) -> int:
    kv = 2 * H * budget * D * 4
    scores = 0 if arm in ("streaming_llm",) else H * budget * 4
    filt = H * D * 4 if arm.startswith("qfilters") else 0
    return kv + scores + filt


def time_eviction(arm: str, keys, obs, calib, budget: int, seed: int, reps: int = 5) -> float:
    """Median seconds to score ``T`` tokens and select ``budget`` of them (all heads), over ``reps`` calls."""
    def evict():
        return select(arm, arm_scores(arm, keys, obs, calib, seed)[0], budget)

    return common.time_call(evict, min_time=0.0, min_iters=reps, warmup=0)["median_s"]


def run(lengths=LENGTHS, budgets=BUDGETS, seeds=SEEDS, regimes=REGIMES) -> dict:
    cells = []
    for regime in regimes:
        for T in lengths:
            for budget in budgets:
                per_arm = {a: {"perturbation": [], "filter_cosine": [], "seconds": []} for a in ARMS}
                for seed in seeds:
                    keys, values, probe, obs, calib, axes = draw(regime, T, seed)
                    full, _ = attention(probe, keys, values)
                    pert = {}
                    for arm in ARMS:
                        if arm == "best-of-sign":
                            continue
                        s, filt = arm_scores(arm, keys, obs, calib, seed)
                        kept = np.array(select(arm, s, budget)[0])  # [H, budget]
                        out = np.stack([attention(probe[h:h + 1], keys[h:h + 1, kept[h]],
                                                  values[h:h + 1, kept[h]])[0][0] for h in range(HEADS)])
                        cos = (out * full).sum(-1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(full, axis=-1))
                        pert[arm] = (1.0 - cos).mean(axis=1)  # per head
                        per_arm[arm]["perturbation"].extend(pert[arm].tolist())
                        if filt is not None and regime == "paper_like":
                            per_arm[arm]["filter_cosine"].extend((np.array(filt) * axes).sum(-1).tolist())
                        if seed == seeds[0]:
                            per_arm[arm]["seconds"].append(time_eviction(arm, keys, obs, calib, budget, seed))
                    best = np.minimum(pert["qfilters-keys+1"], pert["qfilters-keys-1"])
                    per_arm["best-of-sign"]["perturbation"].extend(best.tolist())
                for arm in ARMS:
                    d = per_arm[arm]
                    cells.append({
                        "regime": regime, "length": T, "budget": budget, "arm": arm,
                        "perturbation_mean": float(np.mean(d["perturbation"])),
                        "perturbation_std": float(np.std(d["perturbation"])),
                        "n": len(d["perturbation"]),
                        "filter_cosine_mean": float(np.mean(d["filter_cosine"])) if d["filter_cosine"] else None,
                        "bytes_kept": kept_bytes(arm, budget),
                        "bytes_full": 2 * HEADS * T * HEAD_DIM * 4,
                        "seconds_per_eviction": float(np.median(d["seconds"])) if d["seconds"] else None,
                    })
    return {
        "settings": {"lengths": list(lengths), "budgets": list(budgets), "head_dim": HEAD_DIM,
                     "heads": HEADS, "seeds": list(seeds), "n_sink": N_SINK, "calib": CALIB,
                     "probes": PROBES, "regimes": list(regimes)},
        "note": "best-of-sign picks, per (head, seed), the better of key-SVD sign +1 and -1 after seeing "
                "the result: a selection bonus, not a method.",
        "cells": cells,
    }


def table(res: dict) -> str:
    lines = []
    for regime in res["settings"]["regimes"]:
        lines.append(f"\n{regime}: 1 - cos(attention output kept vs full), mean over probes x heads x seeds")
        cols = [(T, b) for T in res["settings"]["lengths"] for b in res["settings"]["budgets"]]
        lines.append(f"{'arm':18s}" + "".join(f"  T={T:<4d} b={b:<3d}" for T, b in cols)
                     + "  filter_cos  us/evict(T=1024,b=128)")
        for arm in ARMS:
            cs = {(c["length"], c["budget"]): c for c in res["cells"]
                  if c["regime"] == regime and c["arm"] == arm}
            fc = cs[cols[-1]]["filter_cosine_mean"]
            sec = cs[cols[-1]]["seconds_per_eviction"]
            lines.append(f"{arm:18s}" + "".join(f"  {cs[c]['perturbation_mean']:12.4f}" for c in cols)
                         + f"  {'' if fc is None else f'{fc:+.3f}':>10s}"
                         + f"  {'' if sec is None else f'{sec * 1e6:8.0f}':>8s}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = res["settings"]["regimes"]
    budgets = res["settings"]["budgets"]
    fig, axes = plt.subplots(len(regimes), len(budgets), figsize=(6 * len(budgets), 4 * len(regimes)),
                             squeeze=False)
    for i, regime in enumerate(regimes):
        for j, b in enumerate(budgets):
            ax = axes[i][j]
            for arm in ARMS:
                cs = sorted((c for c in res["cells"] if c["regime"] == regime and c["budget"] == b
                             and c["arm"] == arm), key=lambda c: c["length"])
                ax.plot([c["length"] for c in cs], [c["perturbation_mean"] for c in cs], marker="o",
                        ls="--" if arm == "best-of-sign" else "-", label=arm)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{regime}, budget {b}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("1 - cos(output)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(common.RESULTS / "synthetic.json"))
    ap.add_argument("--quick", action="store_true", help="one length, one seed (smoke run)")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    res = run(lengths=(256,), seeds=(0,)) if args.quick else run()
    res["seconds"] = time.perf_counter() - t
    out = Path(args.out)
    common.write_results(out, res)
    plot(res, out.with_suffix(".png"))
    print(table(res))
    print(f"\n{res['note']}\nwrote {out} and {out.with_suffix('.png')} in {res['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
