"""Long decodes keep memory flat; caches work from worker threads."""

import threading

import mlx.core as mx
import numpy as np
import pytest

from qfilters_mlx import KVCacheConfig, QFiltersKVCache


def decode(caches, steps, seed=0, H=2, D=16, probe=None):
    """Feed `steps` single tokens to every cache, evaluating only the returned K/V."""
    rng = np.random.default_rng(seed)
    kv = mx.array(rng.standard_normal((steps, 1, H, 1, D)).astype(np.float32))
    outs = []
    for t in range(steps):
        step_out = [c.update_and_fetch(kv[t], kv[t] * 0.5) for c in caches]
        mx.eval(step_out)
        outs = step_out
        if probe is not None:
            probe(t)
    return outs


@pytest.mark.parametrize("method", ["qfilters", "full"])
def test_20000_decode_steps_memory_flat(method):
    budget = 64
    cfg = KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=4,
                        qfilters_recent=16, qfilters_calib_tokens=32, qfilters_filter_source="keys")
    caches = [QFiltersKVCache(cfg, layer_idx=i) for i in range(4)]
    steps = 20_000 if method == "qfilters" else 3_000
    mem = {}

    def probe(t):
        if t + 1 in (1_000, steps):
            mx.synchronize()
            mem[t + 1] = mx.get_active_memory()

    decode(caches, steps, probe=probe)
    assert all(type(c.offset) is int and c.offset == steps for c in caches)
    if method == "qfilters":
        assert all(c.size() == budget for c in caches)
        assert mem[steps] <= 1.1 * mem[1_000], mem
    else:  # full grows by exactly what it stores (buffers in 256-token steps), nothing more
        kv_bytes = sum(c.nbytes for c in caches)
        assert caches[0].size() == steps
        assert mem[steps] - mem[1_000] <= kv_bytes, (mem, kv_bytes)


def test_worker_threads_match_single_thread():
    cfg = KVCacheConfig(qfilters_budget=24, qfilters_n_sink=2, qfilters_recent=4, qfilters_calib_tokens=16, qfilters_filter_source="keys")
    expected = {}
    for seed in (1, 2):
        c = QFiltersKVCache(cfg)
        k, _ = decode([c], 200, seed=seed)[0]
        expected[seed] = (np.array(k), np.array(c.kept_positions()))

    # a cache created here (main thread) and used from a worker thread
    results, errors = {}, []
    made_here = {seed: QFiltersKVCache(cfg) for seed in (1, 2)}

    def work(seed):
        try:
            c = made_here[seed]
            k, _ = decode([c], 200, seed=seed)[0]
            results[seed] = (np.array(k), np.array(c.kept_positions()))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed in (1, 2):
        np.testing.assert_array_equal(results[seed][0], expected[seed][0])
        np.testing.assert_array_equal(results[seed][1], expected[seed][1])


def test_nonfinite_keys_rank_lowest():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 1, 30, 8)).astype(np.float32)
    k[0, 0, 10] = np.nan
    k[0, 0, 12] = np.inf
    k[0, 0, 14, 3] = -np.inf
    for method in ("qfilters", "l2norm"):
        cfg = KVCacheConfig(method=method, qfilters_budget=20, qfilters_n_sink=1,
                            qfilters_calib_tokens=8, qfilters_recent=0, qfilters_filter_source="keys")
        c = QFiltersKVCache(cfg, backend="reference")
        c.update_and_fetch(mx.array(k), mx.array(k))
        kept = set(np.array(c.kept_positions())[0, 0].tolist())
        assert not kept & {10, 12, 14}, (method, kept)
        assert np.all(np.isfinite(np.array(c.scores[:, :, :20])) | (np.array(c.scores[:, :, :20]) == -np.inf))
