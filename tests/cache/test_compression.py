"""Compress-once mode (qfilters_mlx.cache.compression) against kvpress's rule written out in
numpy, against our streaming selection, and through mlx-lm's generate_step.

kvpress 0.5.5 (``ScorerPress.compress``): ``n_kept = int(k_len * (1 - compression_ratio))``;
``indices = scores.topk(n_kept, dim=-1).indices`` per (batch row, KV head);
``QFilterPress.score = -(keys * q_filters).sum(-1)`` with kvpress's filters (ours negated:
``f_kvpress = -f_ours``), ``KnormPress.score = -keys.norm(dim=-1)``,
``StreamingLLMPress``: the first ``n_sink`` and the last ``n_kept - n_sink`` positions.
Ties (which torch's topk leaves unspecified) go to the earlier position here, as in our
selection; the random keys below have none (checked).
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from helpers.oracle import np_keep, np_keep_rows
from qfilters_mlx import KVCacheConfig, QFiltersKVCache, compress_caches
from qfilters_mlx.config import CompressOnce, Streaming

B, H, D = 2, 3, 16


def _kvpress_keep(keys: np.ndarray, scores_fn, ratio: float, n_sink: int | None = None) -> list:
    """kvpress's kept positions per (b, h) as sorted lists; ``n_sink`` set: StreamingLLMPress."""
    T = keys.shape[2]
    n_kept = int(T * (1 - ratio))
    out = []
    for b in range(keys.shape[0]):
        row = []
        for h in range(keys.shape[1]):
            if n_sink is not None:
                row.append(sorted(list(range(n_sink)) + list(range(T - (n_kept - n_sink), T))))
                continue
            s = scores_fn(keys[b, h].astype(np.float64), h)
            order = sorted(range(T), key=lambda i: (-s[i], i))  # ties: earlier position
            row.append(sorted(order[:n_kept]))
        out.append(row)
    return out


def _data(T, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    f = rng.standard_normal((H, D)).astype(np.float32)
    return k, v, f / np.linalg.norm(f, axis=-1, keepdims=True)


def _cache(method="qfilters", filters=None, ratio=None, growth=None, at="manual", **kw):
    cfg = dict(method=method, head_dim=D, mode=CompressOnce(ratio=ratio, growth=growth, at=at),
               qfilters_n_sink=0)
    cfg.update(kw)
    f = None if filters is None else mx.array(filters)
    return QFiltersKVCache(KVCacheConfig(**cfg), filters=f, backend="reference")


def _feed(cache, k, v, chunk):
    for s in range(0, k.shape[2], chunk):
        cache.update_and_fetch(mx.array(k[:, :, s:s + chunk]), mx.array(v[:, :, s:s + chunk]))


@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.875, 0.3])
@pytest.mark.parametrize("method", ["qfilters", "l2norm", "streaming_llm"])
def test_kept_set_equals_kvpress_rule(method, ratio):
    T = 203
    k, v, f = _data(T)
    kv_filters = -f  # kvpress's convention: score = -(k . f_kvpress)
    fns = {"qfilters": lambda x, h: -(x @ kv_filters[h].astype(np.float64)),
           "l2norm": lambda x, h: -np.linalg.norm(x, axis=-1)}
    sink = 4 if method == "streaming_llm" else 0
    cache = _cache(method, f if method == "qfilters" else None, qfilters_n_sink=sink)
    _feed(cache, k, v, 64)
    n_kept = compress_caches([cache], ratio=ratio)
    want = _kvpress_keep(k, fns.get(method), ratio, sink if method == "streaming_llm" else None)
    assert n_kept == [int(T * (1 - ratio))]
    assert cache.kept_positions().tolist() == want
    # the kept K/V rows are the inputs' rows, bit for bit
    idx = np.array(want)
    np.testing.assert_array_equal(np.array(cache.state[0]), np.take_along_axis(k, idx[..., None], axis=2))
    if method != "streaming_llm":  # no ties in these scores (the documented tie rule never decided)
        for b in range(B):
            for h in range(H):
                s = fns[method](k[b, h].astype(np.float64), h)
                assert len(np.unique(s)) == T


def test_ties_go_to_the_earlier_position():
    T = 40
    k, v, f = _data(T)
    k[:, :, 20:] = k[:, :, :20]  # every score appears twice
    cache = _cache("l2norm")
    _feed(cache, k, v, 40)
    compress_caches([cache], ratio=0.5)
    want = _kvpress_keep(k, lambda x, h: -np.linalg.norm(x, axis=-1), 0.5)
    assert cache.kept_positions().tolist() == want


@pytest.mark.parametrize("method", ["qfilters", "l2norm", "streaming_llm", "random"])
def test_equals_streaming_selection_with_recent_0_and_no_growth(method):
    """An absolute budget, recent 0: one compression keeps what streaming eviction keeps."""
    T, budget = 150, 37
    k, v, f = _data(T, seed=1)
    filt = f if method == "qfilters" else None
    once = _cache(method, filt, qfilters_budget=budget, qfilters_n_sink=4)
    _feed(once, k, v, T)
    once.compress()
    stream = QFiltersKVCache(KVCacheConfig(method=method, head_dim=D, qfilters_budget=budget,
                                           qfilters_n_sink=4, qfilters_recent=0),
                             filters=None if filt is None else mx.array(filt), backend="reference")
    _feed(stream, k, v, 16)  # streaming's kept set does not depend on the chunking
    assert once.kept_positions().tolist() == stream.kept_positions().tolist()
    for a, b in zip(once.state[:4], stream.state[:4]):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_question_tokens_never_evicted_and_growth_budget():
    T, Q = 120, 30
    k, v, f = _data(T + Q, seed=2)
    cache = _cache("qfilters", f)
    _feed(cache, k[:, :, :T], v[:, :, :T], 50)
    compress_caches([cache], ratio=0.75)
    K = int(T * (1 - 0.75))
    _feed(cache, k[:, :, T:T + 20], v[:, :, T:T + 20], 20)  # the question
    for i in range(T + 20, T + Q):  # the answer, one token at a time
        cache.update_and_fetch(mx.array(k[:, :, i:i + 1]), mx.array(v[:, :, i:i + 1]))
    pos = np.array(cache.kept_positions())
    assert pos.shape[2] == K + Q
    assert (pos[:, :, K:] == np.arange(T, T + Q)).all()
    # with a growth budget G the cache evicts again past K + G: the top K + G by score
    # among the compressed rows and the new ones (what select_keep gives)
    G = 12
    g = _cache("qfilters", f, growth=G)
    _feed(g, k[:, :, :T], v[:, :, :T], 50)
    g.compress(ratio=0.75)
    kept0 = np.array(g.kept_positions())
    _feed(g, k[:, :, T:T + 20], v[:, :, T:T + 20], 20)
    for i in range(T + 20, T + Q):
        g.update_and_fetch(mx.array(k[:, :, i:i + 1]), mx.array(v[:, :, i:i + 1]))
    got = np.array(g.kept_positions())
    assert got.shape[2] == K + G
    for b in range(B):
        for h in range(H):
            cand = list(kept0[b, h]) + list(range(T, T + Q))
            s = {i: float(k[b, h, i].astype(np.float64) @ f[h]) for i in cand}
            want = sorted(sorted(cand, key=lambda i: (-s[i], i))[:K + G])
            assert got[b, h].tolist() == want


def test_per_question_copies_do_not_leak():
    T = 100
    k, v, f = _data(T + 40, seed=3)
    ctx = _cache("qfilters", f)
    _feed(ctx, k[:, :, :T], v[:, :, :T], 64)
    compress_caches([ctx], ratio=0.5)
    before = [np.array(a) for a in ctx.state[:4]]
    q1, q2 = copy.deepcopy(ctx), copy.deepcopy(ctx)
    _feed(q1, k[:, :, T:T + 40], v[:, :, T:T + 40], 40)
    _feed(q2, k[:, :, T + 5:T + 15], v[:, :, T + 5:T + 15], 10)
    for a, b in zip(ctx.state[:4], before):  # the compressed context is untouched
        np.testing.assert_array_equal(np.array(a), b)
    assert (ctx.size(), ctx.offset) == (50, T)
    alone = _cache("qfilters", f)  # question 2 alone on a fresh compression
    _feed(alone, k[:, :, :T], v[:, :, :T], 64)
    alone.compress(ratio=0.5)
    _feed(alone, k[:, :, T + 5:T + 15], v[:, :, T + 5:T + 15], 10)
    for a, b in zip(q2.state[:4], alone.state[:4]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert q1.size() == 90 and q2.size() == 60


def test_state_save_load_trim_after_compression(tmp_path):
    T = 90
    k, v, f = _data(T + 20, seed=4)
    c = _cache("qfilters", f)
    _feed(c, k[:, :, :T], v[:, :, :T], 32)
    c.compress(ratio=0.5)
    _feed(c, k[:, :, T:T + 5], v[:, :, T:T + 5], 5)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [c])
    (r,) = load_prompt_cache(path)
    assert r.compressed and r._compressed == c._compressed
    dup = copy.deepcopy(c)
    for cache in (c, r, dup):  # all three continue identically (appending, no eviction)
        for i in range(T + 5, T + 10):
            cache.update_and_fetch(mx.array(k[:, :, i:i + 1]), mx.array(v[:, :, i:i + 1]))
    for a, b, d in zip(c.state[:4], r.state[:4], dup.state[:4]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
        np.testing.assert_array_equal(np.array(a), np.array(d))
    # trim: the tokens after the compression are rewound exactly, not the compression
    assert c.rewindable_tokens == 10  # (is_trimmable() is False: a deeper trim would raise)
    assert not c.is_trimmable()
    assert c.trim(7) == 7
    ref = _cache("qfilters", f)
    _feed(ref, k[:, :, :T], v[:, :, :T], 32)
    ref.compress(ratio=0.5)
    _feed(ref, k[:, :, T:T + 3], v[:, :, T:T + 3], 3)
    for a, b in zip(c.state[:4], ref.state[:4]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert c.offset == ref.offset
    with pytest.raises(ValueError, match="max_rewind"):
        c.trim(4)  # back into the compressed context


def test_query_calibrated_filter_then_compress():
    T, calib = 64, 16
    k, v, _ = _data(T, seed=5)
    q = np.random.default_rng(6).standard_normal((B, 2 * H, T, D)).astype(np.float32)
    c = _cache("qfilters", None, qfilters_filter_source="queries", qfilters_calib_tokens=calib)
    c.queries_observed = True  # what observe_queries sets
    c.update_and_fetch(mx.array(k[:, :, :8]), mx.array(v[:, :, :8]))
    c.observe_queries(mx.array(q[:, :, :8]))
    with pytest.raises(ValueError, match="qfilters_calib_tokens=16 and its queries observed \\(observe_queries\\)\\)"):
        c.compress(ratio=0.5)  # filter not estimated yet: nothing changed
    assert c.size() == 8
    for s in range(8, T, 8):
        c.update_and_fetch(mx.array(k[:, :, s:s + 8]), mx.array(v[:, :, s:s + 8]))
        c.observe_queries(mx.array(q[:, :, s:s + 8]))
    assert c.size() == T  # nothing evicted before the compression
    assert c.state[5].shape == (B, 2 * H, calib, D)  # the calibration queries, kept for rewinds
    c.compress(ratio=0.5)
    assert c.state[5] is None  # dropped with the first eviction, as streaming drops them
    f = np.array(c.filter)
    want = _kvpress_keep(k, lambda x, h: x @ f[h].astype(np.float64), 0.5)
    assert c.kept_positions().tolist() == want


def test_prompt_end_trigger_in_mlx_lm_generate_step():
    """The automatic trigger under mlx-lm's own loop: the prompt but its last token is
    compressed; the last prompt token and every generated token are kept."""
    from mlx_lm.generate import generate_step
    from helpers.observe_models import build

    from qfilters_mlx import KVCacheBuilder

    model, _ = build("llama")
    hd = 16
    filters = mx.random.normal((2, 2, hd))
    cfg = KVCacheConfig(method="qfilters", mode=CompressOnce(ratio=0.75), qfilters_n_sink=0,
                        qfilters_filters=filters)
    caches = KVCacheBuilder.for_model(model, cfg)
    T, steps = 101, 6
    prompt = mx.array(np.random.default_rng(0).integers(0, 64, T))
    for _ in zip(range(steps), generate_step(prompt, model, prompt_cache=caches, max_tokens=steps,
                                              prefill_step_size=32)):
        pass
    K = int((T - 1) * 0.25)
    for c in caches:
        pos = np.array(c.kept_positions())
        assert c.compressed and c._compressed == (K, T - 1)
        assert (pos[..., :K] < T - 1).all()
        assert (pos[..., K:] == np.arange(T - 1, pos.shape[2] - K + T - 1)).all()
        assert pos.shape[2] >= K + steps


def test_compress_before_a_key_filter_is_estimated_names_no_queries():
    k, v, _ = _data(8, seed=2)
    c = _cache("qfilters", None, qfilters_filter_source="keys", qfilters_sign=-1, qfilters_calib_tokens=16)
    _feed(c, k, v, 8)
    with pytest.raises(ValueError, match="qfilters_calib_tokens=16\\); pass calibrated filters"):
        c.compress(ratio=0.5)


def test_config_errors_name_the_field():
    """(The fields of CompressOnce: tests/cache/test_config.py.)"""
    with pytest.raises(TypeError, match="mode must be Streaming"):
        KVCacheConfig(mode="once")
    with pytest.raises(ValueError, match="method='full'"):
        KVCacheConfig(method="full", mode=CompressOnce())
    assert KVCacheConfig(mode=CompressOnce()).qfilters_recent == 0
    streaming = _cache("l2norm", mode=Streaming())
    streaming.update_and_fetch(mx.zeros((1, H, 4, D)), mx.zeros((1, H, 4, D)))
    with pytest.raises(ValueError, match="(?i)compress_?once"):
        compress_caches([streaming], ratio=0.5)
    with pytest.raises(ValueError, match=r"^compress_caches: no QFiltersKVCache in caches \(build them with "
                                         r"KVCacheBuilder.for_model and mode=CompressOnce\(...\)\)$"):
        compress_caches([object()])


@pytest.mark.parametrize("target, message", [
    (dict(ratio=1.5), r"^ratio \(the fraction of tokens removed\) must be in \[0, 1\), got 1.5$"),
    (dict(ratio=1.0), r"^ratio \(the fraction of tokens removed\) must be in \[0, 1\), got 1.0$"),
    (dict(ratio=-0.25), r"^ratio \(the fraction of tokens removed\) must be in \[0, 1\), got -0.25$"),
    (dict(ratio="0.5"), r"^ratio \(the fraction of tokens removed\) must be in \[0, 1\), got '0.5'$"),
    (dict(ratio=False), r"^ratio \(the fraction of tokens removed\) must be in \[0, 1\), got False$"),
    (dict(budget=0), r"^budget must be an int >= 1, got 0$"),
    (dict(budget=2.0), r"^budget must be an int >= 1, got 2.0$"),
    (dict(budget=True), r"^budget must be an int >= 1, got True$"),
    (dict(ratio=0.5, budget=3), r"^give a compression ratio or a budget, not both$"),
], ids=["ratio_above_1", "ratio_1", "ratio_below_0", "ratio_str", "ratio_bool", "budget_0", "budget_float",
        "budget_bool", "ratio_and_budget"])
def test_compress_refuses_a_bad_target_before_changing_anything(target, message):
    """``cache.compress`` itself (not only ``compress_caches``) checks its ratio/budget: a
    ratio outside ``[0, 1)`` would keep ``max(1, int(T * (1 - ratio)))`` rows, budget 0 none."""
    T = 30
    k, v, f = _data(T, seed=7)
    c = _cache("qfilters", f)
    _feed(c, k, v, 10)
    with pytest.raises(ValueError, match=message):
        c.compress(**target)
    assert not c.compressed and c.size() == T
    assert c.kept_positions().tolist() == [[list(range(T))] * H] * B


def test_prepare_call_runs_the_prompt_end_trigger_before_the_call():
    """A batch cache sizes its rows after ``prepare_call(tokens)``: after a multi-token call,
    ``prepare_call(1)`` compresses (the rule of kvpress, written out in ``_kvpress_keep``),
    ``prepare_call(L > 1)`` does not, and a second ``prepare_call(1)`` changes nothing."""
    T, ratio = 48, 0.75
    k, v, f = _data(T, seed=8)
    c = _cache("qfilters", f, at="prompt_end", ratio=ratio)
    _feed(c, k, v, 16)
    c.prepare_call(4)  # another chunk of the prompt: no compression yet
    assert not c.compressed and c.size() == T
    c.prepare_call(1)
    want = _kvpress_keep(k, lambda x, h: x @ f[h].astype(np.float64), ratio)
    assert c.compressed and c.size() == int(T * (1 - ratio))
    assert c.kept_positions().tolist() == want
    c.prepare_call(1)
    assert c._compressed == (int(T * (1 - ratio)), T)


def test_a_compression_that_keeps_every_row_evicts_nothing():
    """``keep == size()`` (budget >= tokens, or ratio 0): no row is dropped, so the cache is not
    ``evicted`` and a plain trim still removes stored tokens exactly (what a cache that never
    compressed does), and the next single token appends."""
    T = 20
    k, v, f = _data(T + 1, seed=9)
    for target in (dict(budget=T + 5), dict(ratio=0.0)):
        c = _cache("qfilters", f)
        _feed(c, k[:, :, :T], v[:, :, :T], 10)
        assert c.compress(**target) == T
        assert c.compressed and not c.evicted
        assert c.trim(3) == 3
        assert c.kept_positions().tolist() == [[list(range(T - 3))] * H] * B
        keys, values = c.update_and_fetch(mx.array(k[:, :, T - 3:T - 2]), mx.array(v[:, :, T - 3:T - 2]))
        np.testing.assert_array_equal(np.array(keys), k[:, :, :T - 2])
        np.testing.assert_array_equal(np.array(values), v[:, :, :T - 2])



def test_a_two_token_prompt_is_a_chunk_for_the_prompt_end_trigger():
    """Any call of more than one token is prompt (``prompt_end``): a 2-token prompt is
    compressed at the first single-token call, kvpress's rule on its 2 tokens."""
    k, v, f = _data(3, seed=10)
    c = _cache("qfilters", f, at="prompt_end", ratio=0.5)
    c.update_and_fetch(mx.array(k[:, :, :2]), mx.array(v[:, :, :2]))
    c.update_and_fetch(mx.array(k[:, :, 2:3]), mx.array(v[:, :, 2:3]))
    want = _kvpress_keep(k[:, :, :2], lambda x, h: x @ f[h].astype(np.float64), 0.5)
    assert c._compressed == (1, 2)
    assert c.kept_positions().tolist() == [[row + [2] for row in rows] for rows in want]


@pytest.mark.parametrize("n", [1, 4])
def test_trim_of_tokens_appended_after_the_compression_is_exact(n):
    """Without a journal, ``trim(n)`` removes ``n`` of the tokens appended since the
    compression (here 1 and all 4 of them): the cache equals one fed ``n`` tokens fewer, and
    ``keys_and_values`` then refuses (nothing returned since the trim); ``trim(0)`` changes
    nothing, not even what ``keys_and_values`` returns."""
    T, grown = 40, 4
    k, v, f = _data(T + grown, seed=11)

    def compressed_then_fed(m):
        c = _cache("qfilters", f)
        c.keep_last_kv = True
        _feed(c, k[:, :, :T], v[:, :, :T], 20)
        c.compress(ratio=0.5)
        for i in range(T, T + m):
            c.update_and_fetch(mx.array(k[:, :, i:i + 1]), mx.array(v[:, :, i:i + 1]))
        return c

    c, ref = compressed_then_fed(grown), compressed_then_fed(grown - n)
    last = c.keys_and_values()
    assert c.trim(0) == 0 and c.keys_and_values() is last
    assert c.trim(n) == n
    assert c.offset == ref.offset == T + grown - n and c.size() == ref.size()
    for a, b in zip(c.state[:4], ref.state[:4]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    with pytest.raises(ValueError, match="before any update_and_fetch since the cache was built, loaded or trimmed"):
        c.keys_and_values()


def test_compress_refuses_a_cache_trimmed_to_no_rows():
    """A cache that held rows and was trimmed back to none is empty as a new one is: ``compress``
    raises before changing anything (offset 0, no rows, not compressed)."""
    k, v, f = _data(12, seed=3)
    c = _cache("qfilters", f)
    _feed(c, k, v, 12)
    assert c.trim(12) == 12 and c.size() == 0 and c.keys is not None
    with pytest.raises(ValueError, match="the cache is empty"):
        c.compress(ratio=0.5)
    assert not c.compressed and c.size() == 0 and c.offset == 0


def _new_cache(f, mode, **kw):
    """A compress-once cache in today's spelling (mode object, build options as keywords)."""
    cfg = KVCacheConfig(method="qfilters", head_dim=D, mode=mode, qfilters_n_sink=kw.pop("n_sink", 0),
                        qfilters_filter_source="calibrated", **kw)
    return QFiltersKVCache(cfg, filters=mx.array(f), backend="reference")


def test_a_recent_window_wider_than_the_compressed_budget_is_cut_to_it():
    """``qfilters_recent`` larger than what a compression keeps after its sinks: the sinks and
    the last ``keep - n_sink`` positions are kept (the window cut to the budget, numpy rule)."""
    k, v, f = _data(30, seed=5)
    c = _new_cache(f, CompressOnce(at="manual"), n_sink=2, qfilters_recent=12, qfilters_budget=20)
    _feed(c, k, v, 30)
    assert c.compress(budget=6) == 6
    want = np_keep_rows(np.zeros((B, H, 30)), 6, 2, 4)  # 2 sinks + the last 4 (scores unused)
    np.testing.assert_array_equal(np.array(c.kept_positions()), want)


def test_a_compression_to_one_row_without_growth_keeps_one_row_while_decoding():
    k, v, f = _data(24, seed=6)
    c = _new_cache(f, CompressOnce(growth=0, at="manual"), qfilters_budget=8, qfilters_recent=0)
    _feed(c, k[:, :, :16], v[:, :, :16], 16)
    assert c.compress(budget=1) == 1
    scores = np.einsum("bhtd,hd->bht", k.astype(np.float64), f.astype(np.float64))
    for t in range(16, 24):
        c.update_and_fetch(mx.array(k[:, :, t:t + 1]), mx.array(v[:, :, t:t + 1]))
        assert c.size() == 1
        # the one row is the best-scored token seen so far (kept set of the streaming rule)
        want = np_keep_rows(scores[:, :, :t + 1], 1, 0, 0)
        np.testing.assert_array_equal(np.array(c.kept_positions()), want)


def test_a_trim_after_growth_was_evicted_again_is_refused_without_a_journal():
    """Tokens appended after the compression and then evicted (growth exceeded in one call):
    no trim can restore them without the journal, so ``trim`` raises before changing anything."""
    k, v, f = _data(30, seed=7)
    c = _new_cache(f, CompressOnce(growth=2, at="manual"), qfilters_budget=8, qfilters_recent=0)
    _feed(c, k[:, :, :20], v[:, :, :20], 20)
    c.compress(budget=8)
    c.update_and_fetch(mx.array(k[:, :, 20:25]), mx.array(v[:, :, 20:25]))  # 5 > growth 2: evicts
    assert c.size() == 10 and c.offset == 25
    before = [np.array(a) for a in c.state[:4]]
    with pytest.raises(ValueError, match="cannot rewind 1 tokens after an eviction"):
        c.trim(1)
    assert c.offset == 25 and all(np.array_equal(a, np.array(b)) for a, b in zip(before, c.state[:4]))


def test_growth_at_its_limit_decodes_in_slot_mode():
    """Compress-once growth up to ``K + growth`` appends; at the limit each token is one slot-mode
    step (``K + growth + 1`` rows, one of them the free slot: no buffer regrowth and
    re-eviction per token), keeping the streaming rule's set (numpy) over the compressed rows
    and the tokens since."""
    k, v, f = _data(40, seed=8)
    c = _new_cache(f, CompressOnce(growth=3, at="manual"), qfilters_budget=10, qfilters_recent=2)
    _feed(c, k[:, :, :20], v[:, :, :20], 20)
    assert c.compress(budget=10) == 10
    kept = np.array(c.kept_positions())
    scores = np.einsum("bhtd,hd->bht", k.astype(np.float64), f.astype(np.float64))
    for t in range(20, 30):
        c.update_and_fetch(mx.array(k[:, :, t:t + 1]), mx.array(v[:, :, t:t + 1]))
        if t - 19 <= 3:
            assert c._free is None and c.size() == 10 + t - 19
            kept = np.concatenate([kept, np.full((B, H, 1), t)], axis=2)
            continue
        assert c._free is not None and c.size() == 13 and c.keys.shape[2] == 14  # slot mode
        got = np.array(c.kept_positions())
        for b in range(B):
            for h in range(H):
                cand = np.append(kept[b, h], t)  # what the cache held, and the new token
                keep = np_keep(scores[b, h, cand], 13, 0, 2)
                np.testing.assert_array_equal(got[b, h], cand[keep])
        kept = got


def test_compress_caches_by_budget_reaches_every_arm_of_a_batch_and_checks_all_first():
    """``budget=K`` keeps the K best-scored positions (numpy top-k) in every cache, also in
    the arms of an evaluation batch (``MultiArmCache``; Knorm keeps the smallest norms); a cache that
    cannot be compressed stops the call before any cache changes."""
    from qfilters_mlx.evaluation.multi_arm import MultiArmCache

    T, K = 30, 7
    k, v, f = _data(T, seed=5)
    arms = [_cache("qfilters", f), _cache("l2norm")]
    for c in arms:
        _feed(c, k[:1], v[:1], 16)
    assert compress_caches([MultiArmCache(arms)], budget=K) == [K, K]
    scores = {0: lambda x, h: x @ f[h].astype(np.float64), 1: lambda x, h: -np.linalg.norm(x, axis=-1)}
    for i, c in enumerate(arms):
        want = [[sorted(np.argsort(-scores[i](k[0, h].astype(np.float64), h), kind="stable")[:K].tolist())
                 for h in range(H)]]
        assert c.kept_positions().tolist() == want
    ready, empty = _cache("l2norm"), _cache("l2norm")
    _feed(ready, k, v, 16)
    with pytest.raises(ValueError, match="empty"):
        compress_caches([ready, empty], budget=K)
    assert ready.size() == T and ready.kept_positions().shape[-1] == T


def test_after_a_compression_a_journaled_cache_rewinds_only_what_its_journal_holds():
    """With a rewind journal (max_rewind=2) the tokens appended since the compression are
    rewindable only as far as the journal reaches (2), not all 5 of them; a deeper trim is
    refused before anything changes, and a trim within the reach is exact."""
    T = 20
    k, v, f = _data(T + 5, seed=11)
    c = QFiltersKVCache(KVCacheConfig(method="qfilters", head_dim=D, qfilters_n_sink=0,
                                      mode=CompressOnce(ratio=0.5, at="manual")),
                        filters=mx.array(f), backend="reference", max_rewind=2)
    ref = _cache("qfilters", f, ratio=0.5)
    for x in (c, ref):
        _feed(x, k[:, :, :T], v[:, :, :T], 10)
        compress_caches([x])
    _feed(c, k[:, :, T:], v[:, :, T:], 1)
    _feed(ref, k[:, :, T:T + 3], v[:, :, T:T + 3], 1)
    assert c.rewindable_tokens == 2
    with pytest.raises(ValueError, match="cannot rewind 4 tokens"):
        c.trim(4)
    assert c.offset == T + 5 and c.trim(2) == 2
    np.testing.assert_array_equal(np.array(c.kept_positions()), np.array(ref.kept_positions()))
