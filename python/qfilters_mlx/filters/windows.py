"""Per-head recent windows, calibrated offline (``qfilters-mlx calibrate``).

Rule (issue 17): for each budgeted layer, KV head and target budget ``b``, the window
``r`` is chosen from the grid ``round(f * (b - n_sink))`` for ``f`` in
:data:`WINDOW_FRACTIONS` (0 up to ``b - n_sink``, i.e. up to StreamingLLM) by
simulating the eviction on calibration text: at each sampled position ``t > b`` the
cache would hold the ``n_sink`` sinks, the last ``r`` tokens and the
``b - n_sink - r`` highest-scored other tokens (score ``<k, f>`` with the calibrated
filter, exactly :func:`qfilters_mlx.backends.reference.select_keep` up to ties), and
query ``t`` attends to that set plus itself. The measure is the **attention mass of
the actual query ``t`` that the kept set captures** under full attention
(``softmax(q_t K[:t+1]^T / sqrt(D))`` summed over kept positions and ``t``), averaged
over the query heads of the GQA group and over the sampled positions. The window with
the largest mean captured mass wins; equal masses go to the larger window (the
StreamingLLM side). Why this measure: the mass an eviction drops is what the next
queries lose from their softmax, it is computed from the model's own queries, and it
needs no forward pass per candidate window (all windows and budgets are scored from
one pass), so the search costs seconds on a CPU.

File format: the filters file (:mod:`qfilters_mlx.filters.calibration`) gains the
tensor ``"recent_windows"`` ``[n_budgets, n_layers, n_kv_heads]`` int32 and metadata
``recent_budgets`` (JSON list), ``recent_n_sink``, ``recent_rule``; files without it
still load (``load_windows`` then raises, naming the cause).
"""

from __future__ import annotations

import json
import os

import numpy as np

WINDOW_BUDGETS = (64, 128, 256, 512)
WINDOW_FRACTIONS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
RULE = ("argmax over r in round(f * (budget - n_sink)), f in {0, 1/8, ..., 1}, of the mean "
        "attention mass of the next query captured by sinks + last r + top-(budget - n_sink - r) "
        "filter scores; ties to the larger r")


def window_grid(budget: int, n_sink: int) -> list[int]:
    """Candidate windows ``round(f * (budget - n_sink))``, ascending, unique."""
    return sorted({int(round(f * (budget - n_sink))) for f in WINDOW_FRACTIONS})


def sample_times(T: int, budget: int, n: int) -> np.ndarray:
    """Up to ``n`` query positions, evenly spread over ``[budget + 1, T)`` (eviction has
    happened before each); empty when ``T <= budget + 1``."""
    if T <= budget + 1:
        return np.zeros(0, dtype=int)
    return np.unique(np.linspace(budget + 1, T - 1, n).round().astype(int))


def captured_mass(keys, queries, scores, budget: int, n_sink: int, grid, times) -> np.ndarray:
    """Mean attention mass captured per candidate window and head.

    Args:
        keys: ``[H, T, D]`` post-RoPE keys of one layer (one sequence).
        queries: ``[H, G, T, D]`` post-RoPE queries, grouped by KV head.
        scores: ``[H, T]`` eviction scores (higher kept).
        budget, n_sink: the cache's.
        grid: candidate windows (each ``<= budget - n_sink``).
        times: query positions ``t`` (each ``> budget``).

    Returns:
        ``[len(grid), H]`` float64, mean over ``times`` and the group's query heads.
    """
    k = np.asarray(keys, np.float64)
    q = np.asarray(queries, np.float64)
    s = np.asarray(scores, np.float64)
    H, G, T, D = q.shape
    out = np.zeros((len(grid), H))
    for t in times:
        logits = np.einsum("hgd,hsd->hgs", q[:, :, t], k[:, : t + 1]) / np.sqrt(D)
        logits -= logits.max(-1, keepdims=True)
        p = np.exp(logits)
        p = (p / p.sum(-1, keepdims=True)).mean(1)  # [H, t+1], mass is linear in p
        cum = np.concatenate([np.zeros((H, 1)), np.cumsum(p, -1)], -1)
        for i, r in enumerate(grid):
            m = budget - n_sink - r
            hi = t - r  # middle candidates [n_sink, hi)
            mass = cum[:, n_sink] + (cum[:, t + 1] - cum[:, hi])
            if m > 0 and hi > n_sink:
                mid = s[:, n_sink:hi]
                m = min(m, mid.shape[1])
                top = np.argpartition(-mid, m - 1, axis=-1)[:, :m]
                mass = mass + np.take_along_axis(p[:, n_sink:hi], top, -1).sum(-1)
            out[i] += mass
    return out / max(len(times), 1)


def choose_windows(mass: np.ndarray, grid) -> np.ndarray:
    """``mass [len(grid), ...]`` -> the window with the largest mass (ties: larger window)."""
    rev = mass[::-1]
    return np.asarray(grid)[::-1][np.argmax(rev, axis=0)]


def calibrate_windows(layer_data, filters, n_sink: int = 4, budgets=WINDOW_BUDGETS,
                      n_times: int = 32) -> tuple[np.ndarray, dict]:
    """Per-head windows from captured keys and queries.

    Args:
        layer_data: iterable of sequences; each item is a list over layers of
            ``(keys [H, T, D], queries [H_q, T, D])`` of one forward pass.
        filters: ``[n_layers, H, D]`` calibrated filters (scores ``+<k, f>``).
        n_sink, budgets, n_times: sinks, target budgets, query positions per sequence.

    Returns:
        ``(windows [n_budgets, n_layers, H] int32, summary)``; ``summary[budget]`` holds
        the mean captured mass of the chosen windows, of ``budget / 2`` and of
        ``budget - n_sink`` (StreamingLLM), and the mean window.

    Raises:
        ValueError: no sequence is longer than ``budget + 1`` for some budget.
    """
    f = np.asarray(filters, np.float64)
    L, H, _ = f.shape
    grids = {b: window_grid(b, n_sink) for b in budgets}
    mass = {b: np.zeros((len(grids[b]), L, H)) for b in budgets}
    seen = {b: 0 for b in budgets}
    for seq in layer_data:
        for layer, (k, q) in enumerate(seq):
            k = np.asarray(k, np.float64)
            q = np.asarray(q, np.float64)
            T = k.shape[1]
            qg = q.reshape(H, q.shape[0] // H, T, q.shape[2])
            s = np.einsum("htd,hd->ht", k, f[layer])
            for b in budgets:
                times = sample_times(T, b, n_times)
                if len(times):
                    mass[b][:, layer] += captured_mass(k, qg, s, b, n_sink, grids[b], times)
                    seen[b] += layer == 0
    windows, summary = [], {}
    for b in budgets:
        if not seen[b]:
            raise ValueError(f"no calibration sequence is longer than budget + 1 = {b + 1} tokens")
        m = mass[b] / seen[b]
        w = choose_windows(m, grids[b])
        windows.append(w)
        g = grids[b]
        at = lambda r: float(m[g.index(r)].mean())  # noqa: E731
        chosen = np.take_along_axis(m, np.searchsorted(g, w)[None], 0)[0]
        summary[b] = {"mass_chosen": float(chosen.mean()), "mass_half": at(min(g, key=lambda r: abs(r - b // 2))),
                      "mass_streaming": at(b - n_sink), "mean_window": float(w.mean()),
                      "share_zero": float((w == 0).mean()), "share_full": float((w == b - n_sink).mean())}
    return np.stack(windows).astype(np.int32), summary


def window_tensors(windows: np.ndarray, budgets, n_sink: int, summary: dict | None = None) -> tuple[dict, dict]:
    """The arrays and metadata :func:`qfilters_mlx.filters.calibration.save_filters` writes."""
    meta = {"recent_budgets": json.dumps([int(b) for b in budgets]), "recent_n_sink": str(int(n_sink)),
            "recent_rule": RULE}
    if summary is not None:
        meta["recent_summary"] = json.dumps({str(k): v for k, v in summary.items()})
    return {"recent_windows": np.asarray(windows, np.int32)}, meta


def load_windows(path: str, budget: int, n_sink: int) -> tuple:
    """The ``[n_layers, n_kv_heads]`` windows stored in ``path`` for ``budget`` and
    ``n_sink``, as nested tuples of ints.

    Raises:
        ValueError: no such file, not a filters file, a file without windows (written before
            they existed: rerun ``qfilters-mlx calibrate``), or none for this budget / n_sink
            (names what it has).
    """
    if not os.path.isfile(path):
        raise ValueError(f"qfilters_filters: no such file: {path!r}")
    import mlx.core as mx

    arrays, meta = mx.load(path, return_metadata=True)
    if "filters" not in arrays:
        raise ValueError(f"{path} is not a qfilters-mlx filters file")
    if "recent_windows" not in arrays or "recent_budgets" not in meta:
        raise ValueError(f"{path} holds no per-head recent windows (written before they existed): "
                         "rerun `qfilters-mlx calibrate`, or pass an int qfilters_recent")
    budgets = json.loads(meta["recent_budgets"])
    stored_sink = int(meta.get("recent_n_sink", -1))
    if budget not in budgets or stored_sink != n_sink:
        raise ValueError(f"{path} has per-head windows for budgets {budgets} with n_sink {stored_sink}, "
                         f"not budget {budget} with n_sink {n_sink}")
    w = np.array(arrays["recent_windows"].astype(mx.int32))[budgets.index(budget)]
    return tuple(tuple(int(v) for v in row) for row in w)
