"""Per-head recent windows: the calibration rule on constructed heads with a
known answer, the captured-mass measure against the numpy selection rule, the filters
file with and without windows, and ``qfilters_recent`` as a table / ``"calibrated"``."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.oracle import np_keep
from helpers.query_models import tiny_llama
from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache, stored_windows
from qfilters_mlx.config import with_stored_windows
from qfilters_mlx.filters import calibration as cal
from qfilters_mlx.filters.window_measures import captured_mass, output_error, sample_times
from qfilters_mlx.filters.windows import (MEASURED_RULES, RULES, calibrate_windows, load_windows, window_grid,
                                         window_tensors)


def _local_and_content_heads(T=300, D=8, seed=0):
    """Head 0 attends by recency (logit = position: weight of token t-j is e^-j), its
    filter scores are noise; head 1 attends to every 10th token (logit 8 along the filter
    axis), which the filter ranks first."""
    rng = np.random.default_rng(seed)
    pos = np.arange(T, dtype=np.float64)
    k = 0.1 * rng.standard_normal((2, T, D))
    q = 0.1 * rng.standard_normal((2, 1, T, D))
    k[0, :, 0] = pos / 8.0
    q[0, 0, :, 0] = 8.0
    important = (np.arange(T) % 10) == 5
    k[1, important, 2] = 2.0
    q[1, 0, :, 2] = 4.0
    f = np.zeros((1, 2, D))
    f[0, 0, 1] = 1.0  # noise direction for the local head
    f[0, 1, 2] = 1.0
    v = rng.standard_normal((2, T, D))  # every position carries its own value
    return k, q, f, v


@pytest.mark.parametrize("rule", MEASURED_RULES)
def test_local_head_picks_the_largest_window_content_head_the_smallest(rule):
    k, q, f, v = _local_and_content_heads()
    budget, n_sink = 32, 2
    seq = [(k, q.reshape(2, 300, 8), v)]
    windows, summary = calibrate_windows([seq], f, n_sink=n_sink, budgets=(budget,), rule=rule)
    assert windows.shape == (1, 1, 2)
    assert windows[0, 0].tolist() == [budget - n_sink, 0]
    assert max(window_grid(budget, n_sink)) == budget - n_sink and min(window_grid(budget, n_sink)) == 0
    s = summary[budget]
    assert s["rule"] == rule and s["mean_window"] == (budget - n_sink) / 2
    assert s["mass_chosen"] >= s["mass_half"] and s["output_chosen"] <= s["output_half"]


def test_output_rule_needs_values_and_rules_are_named():
    k, q, f, _ = _local_and_content_heads()
    with pytest.raises(ValueError, match="values"):
        calibrate_windows([[(k, q.reshape(2, 300, 8))]], f, n_sink=2, budgets=(32,))
    with pytest.raises(ValueError, match=r"^rule must be one of \['output', 'mass'\], got 'loss'$"):
        calibrate_windows([[(k, q.reshape(2, 300, 8))]], f, n_sink=2, budgets=(32,), rule="loss")
    with pytest.raises(ValueError, match=r"got 'decoded' \(the decoded rule is evaluation.decoded_windows.search_windows\)$"):
        calibrate_windows([[(k, q.reshape(2, 300, 8))]], f, n_sink=2, budgets=(32,), rule="decoded")
    assert set(RULES) == {*MEASURED_RULES, "decoded"}  # every rule a file may name
    windows, summary = calibrate_windows([[(k, q.reshape(2, 300, 8))]], f, n_sink=2, budgets=(32,), rule="mass")
    assert windows[0, 0].tolist() == [30, 0] and "output_chosen" not in summary[32]


def test_captured_mass_equals_the_selection_rule_written_out():
    rng = np.random.default_rng(1)
    H, G, T, D, budget, n_sink = 2, 3, 90, 8, 20, 3
    k = rng.standard_normal((H, T, D))
    q = rng.standard_normal((H, G, T, D))
    s = rng.standard_normal((H, T))
    grid = window_grid(budget, n_sink)
    times = sample_times(T, budget, 7)
    got = captured_mass(k, q, s, budget, n_sink, grid, times)
    want = np.zeros_like(got)
    for i, r in enumerate(grid):
        for h in range(H):
            for t in times:
                kept = np.append(np_keep(s[h, :t], budget, n_sink, r), t)  # cache + the new token
                logits = q[h, :, t] @ k[h, : t + 1].T / np.sqrt(D)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                want[i, h] += p[:, kept].sum(-1).mean() / len(times)
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_output_error_equals_the_selection_rule_written_out():
    rng = np.random.default_rng(2)
    H, G, T, D, Dv, budget, n_sink = 2, 3, 90, 8, 5, 20, 3
    k = rng.standard_normal((H, T, D))
    q = rng.standard_normal((H, G, T, D))
    v = rng.standard_normal((H, T, Dv))
    s = rng.standard_normal((H, T))
    grid = window_grid(budget, n_sink)
    times = sample_times(T, budget, 7)
    got = output_error(k, q, v, s, budget, n_sink, grid, times)
    want = np.zeros_like(got)
    for i, r in enumerate(grid):
        for h in range(H):
            for t in times:
                kept = np.append(np_keep(s[h, :t], budget, n_sink, r), t)
                for g in range(G):
                    logits = k[h, : t + 1] @ q[h, g, t] / np.sqrt(D)
                    p = np.exp(logits - logits.max())
                    full = (p / p.sum()) @ v[h, : t + 1]
                    pk = p[kept] / p[kept].sum()
                    want[i, h] += np.sum((pk @ v[h, kept] - full) ** 2) / (G * len(times))
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_files_with_and_without_windows_load(tmp_path, monkeypatch):
    model = tiny_llama()
    filters = cal.calibrate_filters(model, [list(range(60))], samples=50)
    old = str(tmp_path / "old.safetensors")
    cal.save_filters(old, filters, model)
    new = str(tmp_path / "new.safetensors")
    w = np.array([[[0, 5, 12], [3, 3, 12]], [[1, 2, 3], [4, 5, 6]]], np.int32)  # [budgets, layers, heads]
    cal.save_filters(new, filters, model, windows=window_tensors(w, (16, 32), 4))
    for path in (old, new):  # both load as filters, with the model check
        loaded, meta = cal.load_filters(path, model)
        np.testing.assert_array_equal(np.array(loaded), np.array(filters))
    assert load_windows(new, 16, 4) == ((0, 5, 12), (3, 3, 12))
    assert load_windows(new, 32, 4) == ((1, 2, 3), (4, 5, 6))
    with pytest.raises(ValueError, match="no per-head recent windows"):
        load_windows(old, 16, 4)
    with pytest.raises(ValueError, match=r"budgets \[16, 32\]"):
        load_windows(new, 64, 4)
    with pytest.raises(ValueError, match="n_sink"):
        load_windows(new, 16, 2)
    # the configuration reads no file: the windows are read where the caches are built, once
    cfg = KVCacheConfig(qfilters_filters=new, qfilters_budget=16, qfilters_recent="calibrated")
    assert cfg.qfilters_recent == "calibrated"
    with pytest.raises(ValueError, match="read when KVCacheBuilder"):
        QFiltersKVCache(cfg, filters=mx.zeros((3, 16)))
    assert with_stored_windows(cfg).qfilters_recent == ((0, 5, 12), (3, 3, 12))
    assert with_stored_windows(cfg).layer_recent(1) == (3, 3, 12)
    no_windows = KVCacheConfig(qfilters_filters=old, qfilters_budget=16, qfilters_recent="calibrated")
    with pytest.raises(ValueError, match="no per-head recent windows"):
        KVCacheBuilder.for_model(model, no_windows)
    with pytest.raises(ValueError, match="qfilters_filters"):
        KVCacheConfig(qfilters_budget=16, qfilters_recent="calibrated")
    reads = []
    monkeypatch.setattr(stored_windows, "load_windows",
                        lambda *a, real=stored_windows.load_windows: reads.append(a) or real(*a))
    KVCacheBuilder.install(model, cfg)
    caches = [model.make_cache(), model.make_cache()][1]
    assert reads == [(new, 16, 4)]  # once, for every later build
    assert [c.recent_window for c in caches] == [(0, 5, 12), (3, 3, 12)]


def test_config_tables_are_checked():
    c = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=4, qfilters_recent=np.array([[0, 12], [3, 4]]))
    assert c.qfilters_recent == ((0, 12), (3, 4)) and hash(c)
    assert KVCacheConfig(qfilters_budget=16, qfilters_recent=[1, 2, 3]).layer_recent(7) == (1, 2, 3)
    with pytest.raises(ValueError, match="layer 1, KV head 0"):
        KVCacheConfig(qfilters_budget=16, qfilters_n_sink=4, qfilters_recent=[[0, 12], [13, 0]])
    with pytest.raises(ValueError, match="same number"):
        KVCacheConfig(qfilters_budget=16, qfilters_recent=[[0, 1], [2]])
    with pytest.raises(TypeError):
        KVCacheConfig(qfilters_budget=16, qfilters_recent=[0.5, 1])
    with pytest.raises(ValueError, match="'calibrated'"):
        KVCacheConfig(qfilters_recent="auto")


def test_cache_with_per_head_windows_keeps_the_numpy_set():
    """Prefill then decode through one cache with per-head windows (cpp or reference
    backend): the kept positions equal the numpy rule per head over all tokens fed."""
    rng = np.random.default_rng(4)
    B, H, T, D, budget, n_sink = 1, 3, 60, 8, 16, 2
    recent = (0, 14, 5)
    f = mx.array(rng.standard_normal((H, D)).astype(np.float32))
    keys = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    for backend in ("reference", "auto"):
        cfg = KVCacheConfig(qfilters_budget=budget, qfilters_n_sink=n_sink, qfilters_recent=recent)
        cache = QFiltersKVCache(cfg, filters=f, backend=backend)
        cache.update_and_fetch(keys[:, :, :30], keys[:, :, :30])
        for t in range(30, T):
            cache.update_and_fetch(keys[:, :, t:t + 1], keys[:, :, t:t + 1])
        s = np.einsum("bhtd,hd->bht", np.array(keys), np.array(f))
        got = np.array(cache.kept_positions())
        for h in range(H):
            np.testing.assert_array_equal(got[0, h], np_keep(s[0, h], budget, n_sink, recent[h]))
        with pytest.raises(ValueError, match="per-head"):
            bad = QFiltersKVCache(cfg, filters=mx.zeros((2, D)), backend=backend)
            bad.update_and_fetch(keys[:, :2], keys[:, :2])
