"""Per-sample RULER records to kvpress's leaderboard rows, with bootstrap 95% intervals.

A row: ``dataset`` (``"ruler"``), ``data_dir`` (the context length, as kvpress names its
RULER folders ``"4096"``), ``model``, ``method`` (the arm; ``full`` is kvpress's
``no_press``), ``protocol``, ``compression_ratio`` (0 for the full cache), ``scores``
(per task: RULER's ``string_match_all``, 0 to 100), ``n_samples`` per task, ``average``
(the mean of the task scores) and ``average_ci95``.

The interval is a stratified percentile bootstrap over samples: each task's samples are
drawn with replacement (its own count), the task means averaged; ``n_boot`` resamples,
seeded. While some task has a single sample (which has no spread of its own) the samples
of all tasks are resampled as one pool instead (the mean of the pooled samples). Differences
between two methods (``paired``) resample the same samples for both.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from qfilters_mlx.evaluation.ruler.tasks import TASKS

__all__ = ["N_BOOT", "bootstrap_average", "leaderboard"]

N_BOOT = 2000


def bootstrap_average(per_task: list[np.ndarray], n_boot: int = N_BOOT, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """``(average, low, high)`` of the mean over tasks of each task's mean score.

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
    if min(len(x) for x in xs) >= 2:  # stratified: each task's samples, its own count
        avg = np.mean([x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1) for x in xs], axis=0)
    else:  # a task with one sample has no spread of its own: resample the pooled samples
        pooled = np.concatenate(xs)
        avg = pooled[rng.integers(0, len(pooled), size=(n_boot, len(pooled)))].mean(axis=1)
    low, high = np.quantile(avg, [a, 1 - a])
    return point, float(low), float(high)


def _split(key: str) -> tuple[str, str, float]:
    if key == "full":
        return "both", "full", 0.0
    protocol, rest = key.split("/")
    arm, ratio = rest.split("@")
    return protocol, arm, float(ratio)


def leaderboard(records: list[dict], meta: dict | None = None,
                pairs=(("qfilters", "streaming_llm"), ("qfilters", "knorm"),
                       ("qfilters_online", "streaming_llm"))) -> dict:
    """``{"meta", "rows", "paired"}`` from per-sample records (see the module doc).

    ``paired``: per (length, protocol, ratio), the average difference ``a - b`` of each pair
    of :data:`pairs` present, with its bootstrap interval (same samples for both).
    """
    meta = dict(meta or {})
    by = defaultdict(lambda: defaultdict(dict))  # (length, answer key) -> task -> {index: score}
    seconds = defaultdict(float)
    for r in records:
        for key, score in r["scores"].items():
            by[(r["length"], key)][r["task"]][r["index"]] = 100.0 * score
        seconds[r["length"]] += r["seconds"].get("total", 0.0)
    model = meta.get("model", "")
    order = {t: i for i, t in enumerate(TASKS)}
    tsort = lambda items: sorted(items, key=lambda kv: (order.get(kv[0], len(order)), kv[0]))  # noqa: E731
    rows = []
    for (length, key), tasks in sorted(by.items(), key=lambda kv: (kv[0][0], _split(kv[0][1]))):
        protocol, arm, ratio = _split(key)
        per_task = [np.array(list(v.values())) for _, v in tsort(tasks.items())]
        avg, low, high = bootstrap_average(per_task)
        rows.append({"dataset": "ruler", "data_dir": str(length), "model": model, "method": arm,
                     "protocol": protocol, "compression_ratio": ratio,
                     "scores": {t: float(np.mean(list(v.values()))) for t, v in tsort(tasks.items())},
                     "n_samples": {t: len(v) for t, v in tsort(tasks.items())},
                     "average": avg, "average_ci95": [low, high]})
    paired = []
    keys = {(length, key) for length, key in by}
    for length in sorted({k[0] for k in keys}):
        for protocol in ("compress_once", "streaming"):
            ratios = sorted({_split(k)[2] for ln, k in keys if ln == length and _split(k)[0] == protocol})
            for ratio in ratios:
                for a, b in pairs:
                    ka, kb = f"{protocol}/{a}@{ratio:g}", f"{protocol}/{b}@{ratio:g}"
                    if (length, ka) not in keys or (length, kb) not in keys:
                        continue
                    ta, tb = by[(length, ka)], by[(length, kb)]
                    per_task = []
                    for t in sorted(set(ta) & set(tb)):
                        common = sorted(set(ta[t]) & set(tb[t]))
                        per_task.append(np.array([[ta[t][i] for i in common], [tb[t][i] for i in common]]))
                    d, low, high = bootstrap_average(per_task)
                    paired.append({"data_dir": str(length), "protocol": protocol, "compression_ratio": ratio,
                                   "a": a, "b": b, "difference": d, "ci95": [low, high]})
    meta["compute_seconds"] = {str(k): v for k, v in sorted(seconds.items())}
    meta["bootstrap"] = (f"percentile bootstrap over samples, {N_BOOT} resamples, seed 0: stratified by "
                         "task when every task has two samples or more, else over the pooled samples")
    return {"meta": meta, "rows": rows, "paired": paired}
