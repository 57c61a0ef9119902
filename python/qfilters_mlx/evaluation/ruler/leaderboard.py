"""Per-sample RULER records to kvpress's leaderboard rows, with bootstrap 95% intervals.

A row: ``dataset`` (``"ruler"``), ``data_dir`` (the context length, as kvpress names its
RULER folders ``"4096"``), ``model``, ``method`` (the arm; ``full`` is kvpress's
``no_press``), ``protocol``, ``compression_ratio`` (0 for the full cache), ``metric``,
``subset``, ``scores`` (per task, the mean over samples), ``n_samples`` per task, ``average``
(the mean of the task scores) and ``average_ci95``.

Metrics (per sample, per answer key): ``forced_match`` (100 x the share of expected strings
greedy decoding would write after the gold answer's prefix, :mod:`.forced`), ``loglik`` (the
gold answer's teacher-forced log-likelihood per token, nats), ``string_match`` (RULER's
``string_match_all`` of the greedy answer: the full cache on every sample, the other rows on
the validation subset). Subsets: ``all`` samples, and ``full_correct``: the samples whose
full-cache greedy answer scores 100 (a compressed method cannot be judged where the model
itself fails).

The interval is a percentile bootstrap over samples (``n_boot`` resamples, seeded) of the mean
of the task means: stratified by task once every task has :data:`MIN_STRATIFIED` samples,
else over the pooled samples (:func:`bootstrap_average`). Paired
differences (``paired``: every pair of methods at a (length, protocol, ratio, metric, subset))
resample the same samples for both; ``separated`` says whether the interval excludes 0, and is
``None`` below :data:`MIN_PAIRED` samples (a bootstrap of a handful of samples is too narrow to
trust).
``agreement`` compares ``forced_match`` with ``string_match`` on the rows that have both.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import combinations

import numpy as np

from qfilters_mlx.evaluation.ruler.tasks import TASKS

__all__ = ["METRICS", "MIN_PAIRED", "N_BOOT", "agreement", "bootstrap_average", "leaderboard"]

N_BOOT = 2000
MIN_PAIRED = 10
MIN_STRATIFIED = 5
METRICS = ("forced_match", "loglik", "string_match")
SUBSETS = ("all", "full_correct")


def bootstrap_average(per_task: list[np.ndarray], n_boot: int = N_BOOT, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """``(average, low, high)`` of the mean over tasks of each task's mean score.

    Stratified (each task's samples drawn with replacement, its own count) when every task has
    at least :data:`MIN_STRATIFIED` samples; below that a task whose few samples happen to agree
    would contribute no spread, so the samples of all tasks are drawn as one pool and each
    resample's statistic is the mean over the tasks it drew of their means.

    Args:
        per_task: per task, the per-sample values (``[n_t]``, or ``[k, n_t]`` for ``k``
            series resampled together: the statistic is then taken of ``series[0] - series[1]``).

    Raises:
        ValueError: no tasks, or a task without samples.
    """
    if not per_task or any(np.asarray(x).shape[-1] == 0 for x in per_task):
        raise ValueError("every task needs at least one sample")
    rng = np.random.default_rng(seed)
    xs = []
    for x in per_task:
        x = np.asarray(x, np.float64)
        xs.append(x[0] - x[1] if x.ndim == 2 else x)
    point = float(np.mean([x.mean() for x in xs]))
    a = (1 - level) / 2
    if min(len(x) for x in xs) >= MIN_STRATIFIED:  # stratified: each task's samples, its own count
        avg = np.mean([x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1) for x in xs], axis=0)
    else:  # pooled draws, the statistic the mean of the drawn tasks' means
        vals = np.concatenate(xs)
        task = np.concatenate([np.full(len(x), i) for i, x in enumerate(xs)])
        idx = rng.integers(0, len(vals), size=(n_boot, len(vals)))
        rows = np.repeat(np.arange(n_boot), len(vals))
        sums = np.zeros((n_boot, len(xs)))
        counts = np.zeros((n_boot, len(xs)))
        np.add.at(sums, (rows, task[idx].ravel()), vals[idx].ravel())
        np.add.at(counts, (rows, task[idx].ravel()), 1.0)
        drawn = counts > 0
        avg = (np.where(drawn, sums / np.maximum(counts, 1), 0.0).sum(axis=1) / drawn.sum(axis=1))
    low, high = np.quantile(avg, [a, 1 - a])
    return point, float(low), float(high)


def _split(key: str) -> tuple[str, str, float]:
    if key == "full":
        return "both", "full", 0.0
    protocol, rest = key.split("/")
    arm, ratio = rest.split("@")
    return protocol, arm, float(ratio)


def _values(r: dict) -> dict[str, dict[str, float]]:
    """``metric -> answer key -> value`` of one record."""
    out = {"forced_match": {}, "loglik": {}, "string_match": {}}
    for key, f in r.get("forced", {}).items():
        out["forced_match"][key] = 100.0 * f["match"]
        out["loglik"][key] = f["loglik"] / f["tokens"]
    for key, s in r.get("scores", {}).items():
        out["string_match"][key] = 100.0 * s
    return out


def _full_correct(r: dict) -> bool:
    return r.get("scores", {}).get("full") == 1.0


def agreement(records: list[dict]) -> dict:
    """How often ``forced_match`` and the greedy ``string_match`` agree, over every (sample,
    answer key) that has both: ``rows``, ``equal`` (the same share), and counts of
    ``both_right`` / ``greedy_only`` / ``forced_only`` / ``both_wrong`` (right: share 1), per
    protocol (``both`` is the full cache) and ``total``."""
    out = defaultdict(lambda: dict.fromkeys(("rows", "equal", "both_right", "greedy_only", "forced_only",
                                             "both_wrong"), 0))
    for r in records:
        for key, g in r.get("scores", {}).items():
            f = r.get("forced", {}).get(key)
            if f is None:
                continue
            for group in (_split(key)[0], "total"):
                d = out[group]
                d["rows"] += 1
                d["equal"] += g == f["match"]
                gr, fr = g == 1.0, f["match"] == 1.0
                d["both_right" if gr and fr else "greedy_only" if gr else "forced_only" if fr else "both_wrong"] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def leaderboard(records: list[dict], meta: dict | None = None) -> dict:
    """``{"meta", "rows", "paired", "agreement"}`` from per-sample records (see the module doc).

    ``meta["compute_seconds"]``: per length, the records' summed wall-clock seconds per stage and
    in total; ``meta["samples"]``: per length, samples and samples the full cache answers correctly;
    ``meta["does_not_fit"]``: per length, the ``"task/index"`` of samples that do not fit it (their
    records hold no answers and count nowhere else).
    """
    meta = dict(meta or {})
    # (length, metric, subset, answer key) -> task -> {index: value}
    by = defaultdict(lambda: defaultdict(dict))
    seconds = defaultdict(lambda: defaultdict(float))
    counts = defaultdict(lambda: {"samples": 0, "full_correct": 0, "validation": 0})
    unfit = defaultdict(list)
    for r in records:
        if "does_not_fit" in r:
            unfit[str(r["length"])].append(f"{r['task']}/{r['index']}")
            continue
        vals = _values(r)
        subsets = ("all", "full_correct") if _full_correct(r) else ("all",)
        for metric, keyed in vals.items():
            for key, v in keyed.items():
                for subset in subsets:
                    by[(r["length"], metric, subset, key)][r["task"]][r["index"]] = v
        for stage, sec in r.get("seconds", {}).items():
            seconds[str(r["length"])][stage] += sec
        c = counts[str(r["length"])]
        c["samples"] += 1
        c["full_correct"] += _full_correct(r)
        c["validation"] += bool(r.get("validation"))
    model = meta.get("model", "")
    order = {t: i for i, t in enumerate(TASKS)}
    tsort = lambda items: sorted(items, key=lambda kv: (order.get(kv[0], len(order)), kv[0]))  # noqa: E731
    rows = []
    for (length, metric, subset, key), tasks in sorted(
            by.items(), key=lambda kv: (kv[0][0], METRICS.index(kv[0][1]), SUBSETS.index(kv[0][2]), _split(kv[0][3]))):
        protocol, arm, ratio = _split(key)
        per_task = [np.array(list(v.values())) for _, v in tsort(tasks.items())]
        avg, low, high = bootstrap_average(per_task)
        rows.append({"dataset": "ruler", "data_dir": str(length), "model": model, "method": arm,
                     "protocol": protocol, "compression_ratio": ratio, "metric": metric, "subset": subset,
                     "scores": {t: float(np.mean(list(v.values()))) for t, v in tsort(tasks.items())},
                     "n_samples": {t: len(v) for t, v in tsort(tasks.items())},
                     "average": avg, "average_ci95": [low, high]})
    paired = []
    groups = defaultdict(list)  # (length, metric, subset, protocol, ratio) -> methods
    for length, metric, subset, key in by:
        protocol, arm, ratio = _split(key)
        if arm != "full":
            groups[(length, metric, subset, protocol, ratio)].append(arm)
    for (length, metric, subset, protocol, ratio), arms in sorted(groups.items(), key=lambda kv: (
            kv[0][0], METRICS.index(kv[0][1]), SUBSETS.index(kv[0][2]), kv[0][3], kv[0][4])):
        for a, b in combinations(sorted(arms), 2):
            ta = by[(length, metric, subset, f"{protocol}/{a}@{ratio:g}")]
            tb = by[(length, metric, subset, f"{protocol}/{b}@{ratio:g}")]
            per_task = []
            for t in sorted(set(ta) & set(tb)):
                common = sorted(set(ta[t]) & set(tb[t]))
                if common:
                    per_task.append(np.array([[ta[t][i] for i in common], [tb[t][i] for i in common]]))
            if not per_task:
                continue
            d, low, high = bootstrap_average(per_task)
            n = int(sum(x.shape[1] for x in per_task))
            paired.append({"data_dir": str(length), "metric": metric, "subset": subset, "protocol": protocol,
                           "compression_ratio": ratio, "a": a, "b": b, "difference": d, "ci95": [low, high],
                           "n_samples": n, "separated": bool(low > 0 or high < 0) if n >= MIN_PAIRED else None})
    meta["compute_seconds"] = {k: dict(v) for k, v in sorted(seconds.items(), key=lambda kv: int(kv[0]))}
    meta["samples"] = dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
    meta["does_not_fit"] = {k: sorted(v) for k, v in sorted(unfit.items(), key=lambda kv: int(kv[0]))}
    meta["bootstrap"] = (f"percentile bootstrap over samples, {N_BOOT} resamples, seed 0, of the mean of the task "
                         f"means: stratified by task when every task has {MIN_STRATIFIED} samples or more, else "
                         "over the pooled samples (each resample's mean over the tasks it drew)")
    return {"meta": meta, "rows": rows, "paired": paired, "agreement": agreement(records)}
