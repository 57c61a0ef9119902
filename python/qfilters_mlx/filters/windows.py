"""Per-head recent windows, calibrated offline (``qfilters-mlx calibrate``).

Rule: for each budgeted layer, KV head and target budget ``b``, the window
``r`` is chosen from the grid ``round(f * (b - n_sink))`` for ``f`` in
:data:`WINDOW_FRACTIONS` (0 up to ``b - n_sink``, i.e. up to StreamingLLM) by
simulating the eviction on calibration text with the calibrated filter's scores
(:mod:`.window_measures`: sinks, the last ``r`` tokens, the top
``b - n_sink - r`` scores of the rest, the query itself) and measuring, with the
model's own queries, keys and values, the **squared error of the head's attention
output** against full attention, averaged over the GQA group and 32 sampled positions
per sequence. The window with the least error wins; equal errors go to the larger
window (the StreamingLLM side). Why this measure: it is what the next layer receives.
The first rule, the most captured attention mass (``rule="mass"``), was tried first
and kept for comparison: it preferred filter-heavy windows that lost to StreamingLLM
in perplexity (docs/evaluation.md, "Per-head recent windows"). Both need no forward pass per candidate window
(every window and budget is scored from one pass), so the search costs a minute of
numpy on a CPU.

File format: the filters file (:mod:`qfilters_mlx.filters.calibration`) gains the
tensor ``"recent_windows"`` ``[n_budgets, n_layers, n_kv_heads]`` int32 and metadata
``recent_budgets`` (JSON list), ``recent_n_sink``, ``recent_rule``; files without it
still load (:func:`~qfilters_mlx.stored_windows.load_windows`, which reads the windows back,
then raises, naming the cause).
"""

from __future__ import annotations

import json

import numpy as np

from qfilters_mlx.filters.window_measures import measure_windows, sample_times
from qfilters_mlx.stored_windows import load_windows  # noqa: F401 (read back here too)

WINDOW_BUDGETS = (64, 128, 256, 512)
WINDOW_FRACTIONS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
_GRID = "r in round(f * (budget - n_sink)), f in {0, 1/8, ..., 1}"
_KEPT = "sinks + last r + top-(budget - n_sink - r) filter scores + the query"
RULES = {
    "output": f"argmin over {_GRID} of the mean squared attention-output error of the next query over "
              f"{_KEPT}, against full attention; ties to the larger r",
    "mass": f"argmax over {_GRID} of the mean attention mass of the next query captured by {_KEPT}; "
            "ties to the larger r",
    "decoded": "greedy bottom-up search over groups of layers of the window (all KV heads of the group) "
               "with the least mean teacher-forced NLL of calibration text under simulated streaming "
               "eviction (qfilters_mlx.evaluation.decoded_windows); ties keep the start window",
}
"""The selection rules, as stored in a filters file's ``recent_rule`` metadata."""
MEASURED_RULES = ("output", "mass")
"""The rules :func:`calibrate_windows` applies (``"decoded"`` is
:func:`qfilters_mlx.evaluation.decoded_windows.search_windows`)."""


def window_grid(budget: int, n_sink: int, fractions=WINDOW_FRACTIONS) -> list[int]:
    """Candidate windows ``round(f * (budget - n_sink))`` for ``f`` in ``fractions``, ascending, unique."""
    return sorted({int(round(f * (budget - n_sink))) for f in fractions})


def choose_windows(measure: np.ndarray, grid, lower_is_better: bool = True) -> np.ndarray:
    """``measure [len(grid), ...]`` -> the best window per head (ties: the larger window)."""
    rev = measure[::-1]
    best = np.argmin(rev, axis=0) if lower_is_better else np.argmax(rev, axis=0)
    return np.asarray(grid)[::-1][best]


def calibrate_windows(layer_data, filters, n_sink: int = 4, budgets=WINDOW_BUDGETS,
                      n_times: int = 32, rule: str = "output") -> tuple[np.ndarray, dict]:
    """Per-head windows from captured keys, queries and values.

    Args:
        layer_data: iterable of sequences; each item is a list over layers of
            ``(keys [H, T, D], queries [H_q, T, D], values [H, T, D_v])`` of one forward
            pass (``values`` may be left out with ``rule="mass"``).
        filters: ``[n_layers, H, D]`` calibrated filters (scores ``+<k, f>``).
        n_sink, budgets, n_times: sinks, target budgets, query positions per sequence.
        rule: ``"output"`` (least attention-output error, the default) or ``"mass"``
            (most captured attention mass); see :mod:`.window_measures`.

    Returns:
        ``(windows [n_budgets, n_layers, H] int32, summary)``; ``summary[budget]`` holds,
        for the rule's measure and for the captured mass, the mean over heads of the
        chosen windows, of the grid window nearest ``budget / 2`` and of
        ``budget - n_sink`` (StreamingLLM), and the mean window.

    Raises:
        ValueError: unknown rule; values missing for ``rule="output"``; no sequence is
            longer than ``budget + 1`` for some budget.
    """
    if rule not in MEASURED_RULES:
        raise ValueError(f"rule must be one of {list(MEASURED_RULES)}, got {rule!r}"
                         + (" (the decoded rule is evaluation.decoded_windows.search_windows)" if rule == "decoded"
                            else ""))
    f = np.asarray(filters, np.float64)
    L, H, _ = f.shape
    grids = {b: window_grid(b, n_sink) for b in budgets}
    acc = {(name, b): np.zeros((len(grids[b]), L, H)) for b in budgets for name in ("mass", "output")}
    seen = {b: 0 for b in budgets}
    has_values = False
    for seq in layer_data:
        for layer, item in enumerate(seq):
            k, q = np.asarray(item[0], np.float64), np.asarray(item[1], np.float64)
            v = np.asarray(item[2], np.float64) if len(item) > 2 else None
            has_values = has_values or v is not None
            if v is None and rule == "output":
                raise ValueError("rule 'output' needs the values of every layer (keys, queries, values)")
            T = k.shape[1]
            qg = q.reshape(H, q.shape[0] // H, T, q.shape[2])
            s = np.einsum("htd,hd->ht", k, f[layer])
            for b in budgets:
                times = sample_times(T, b, n_times)
                if len(times):
                    for name, m in measure_windows(k, qg, s, b, n_sink, grids[b], times, values=v).items():
                        acc[name, b][:, layer] += m
                    seen[b] += layer == 0
    windows, summary = [], {}
    for b in budgets:
        if not seen[b]:
            raise ValueError(f"no calibration sequence is longer than budget + 1 = {b + 1} tokens")
        g = grids[b]
        w = choose_windows(acc[rule, b] / seen[b], g, lower_is_better=rule == "output")
        windows.append(w)
        idx = np.searchsorted(g, w)[None]
        half = g.index(min(g, key=lambda r: abs(r - b // 2)))
        summary[b] = {"rule": rule, "mean_window": float(w.mean()), "share_zero": float((w == 0).mean()),
                      "share_full": float((w == b - n_sink).mean())}
        for name in ("mass", "output") if has_values else ("mass",):
            m = acc[name, b] / seen[b]
            summary[b].update({f"{name}_chosen": float(np.take_along_axis(m, idx, 0).mean()),
                               f"{name}_half": float(m[half].mean()), f"{name}_streaming": float(m[-1].mean())})
    return np.stack(windows).astype(np.int32), summary


def window_tensors(windows: np.ndarray, budgets, n_sink: int, summary: dict | None = None,
                   rule: str = "output") -> tuple[dict, dict]:
    """The arrays and metadata :func:`qfilters_mlx.filters.calibration.save_filters` writes
    (``rule``: a key of :data:`RULES`)."""
    meta = {"recent_budgets": json.dumps([int(b) for b in budgets]), "recent_n_sink": str(int(n_sink)),
            "recent_rule": RULES[rule]}
    if summary is not None:
        meta["recent_summary"] = json.dumps({str(k): v for k, v in summary.items()})
    return {"recent_windows": np.asarray(windows, np.int32)}, meta
