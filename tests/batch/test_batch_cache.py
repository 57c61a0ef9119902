"""Batched generation with eviction caches (``BatchQFiltersCache``) against each prompt alone.

Reference: the same prompt generated alone with its own per-sequence caches
(:func:`batch_helpers.alone`), and mlx-lm's own ``BatchKVCache`` when the budget
holds everything. Tokens and kept positions must be equal; logprobs agree to
1e-4 + 2e-5 relative (a batched matmul may sum in another order than a one-row matmul, float32).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import batch_generate
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from helpers.batch_helpers import (
    LENGTHS,
    LOGPROB_ATOL,
    LOGPROB_RTOL,
    _check_against_alone,
    _same_row,
    alone,
    batched,
    config,
    prompts,
    tiny_llama,
)
from qfilters_mlx import CompressOnce
from qfilters_mlx.cache.batch import BatchQFiltersCache
from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.cache.kv_cache import QFiltersKVCache


@pytest.mark.parametrize("method", ["qfilters", "streaming_llm", "l2norm"])
def test_batch_generator_matches_each_prompt_alone(method):
    model, cfg = tiny_llama(), config(method=method)
    KVCacheBuilder.install(model, cfg)
    rows = prompts(LENGTHS)
    toks, caches, lps = batched(model, rows, 10)
    assert all(isinstance(c, QFiltersKVCache) for cs in caches.values() for c in cs)
    _check_against_alone(model, cfg, rows, toks, caches, lps, 10)


def test_rows_join_mid_generation_and_small_prefill_steps():
    model, cfg = tiny_llama(), config()
    KVCacheBuilder.install(model, cfg)
    rows = prompts([9, 70, 4, 33, 66])
    # 40-token prefill steps: long prompts are chunked while other rows decode.
    toks, caches, lps = batched(model, rows[:2], 12, joins=[(3, rows[2]), (5, rows[3]), (8, rows[4])],
                                prefill_step_size=40, prefill_batch_size=2)
    assert sorted(toks) == list(range(5))
    for i, p in enumerate(rows):  # alone, chunked the same way (40 tokens per call)
        ref_caches = KVCacheBuilder.for_model(model, cfg)
        for s in range(0, len(p) - 1, 40):
            model(mx.array([p[:-1][s:s + 40]]), cache=ref_caches)
        y, ref = p[-1], []
        for _ in range(12):
            y = int(mx.argmax(model(mx.array([[y]]), cache=ref_caches)[0, -1]).item())
            ref.append(y)
        model(mx.array([[y]]), cache=ref_caches)
        assert toks[i] == ref, i
        _same_row(caches[i], ref_caches)


def test_batch_generate_matches_alone():
    model, cfg = tiny_llama(), config(qfilters_budget=12, qfilters_recent=3)
    KVCacheBuilder.install(model, cfg)
    rows = prompts([48, 6, 20])

    class Tok:
        eos_token_ids = []

        def decode(self, ids):
            return " ".join(map(str, ids))

    res = batch_generate(model, Tok(), rows, max_tokens=8, return_token_ids=True,
                         return_prompt_caches=True)
    for i, p in enumerate(rows):
        ref_toks, ref_caches, _ = alone(model, p, cfg, 8)
        assert res.token_ids[i] == ref_toks
        _same_row(res.caches[i], ref_caches)


def test_logits_equal_mlx_batch_kv_cache_when_budget_holds_all():
    ours, theirs = tiny_llama(), tiny_llama()  # same weights; `theirs` keeps mlx-lm's KVCache
    KVCacheBuilder.install(ours, config(qfilters_budget=512))
    rows = prompts([5, 30, 17, 2])
    t1, c1, l1 = batched(ours, rows, 8)
    t2, c2, l2 = batched(theirs, rows, 8)
    assert isinstance(c2[0][0], KVCache)
    for i in range(len(rows)):
        assert t1[i] == t2[i]
        np.testing.assert_allclose(np.stack([np.array(x) for x in l1[i]]),
                                   np.stack([np.array(x) for x in l2[i]]), atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
        for a, b in zip(c1[i], c2[i]):  # same keys, no eviction
            np.testing.assert_allclose(np.array(a.state[0]), np.array(b.state[0][..., : b.offset, :]),
                                       atol=1e-5)


def _row_caches(model, cfg, rows, n=3):
    return [alone(model, p, cfg, n)[1] for p in rows]


def _step_alone(model, caches, token):
    return model(mx.array([[token]]), cache=caches)[0, -1]


def test_merge_extract_filter_extend_round_trips():
    model, cfg = tiny_llama(), config()
    rows = prompts([40, 7, 22, 3])
    per_seq = _row_caches(model, cfg, rows)
    before = [[np.array(c.state[0]) for c in cs] for cs in per_seq]
    batch = [BatchQFiltersCache.merge([cs[layer] for cs in per_seq[:3]]) for layer in range(2)]
    other = [QFiltersKVCache.merge([per_seq[3][layer]]) for layer in range(2)]
    for layer in range(2):  # merge copies: extract gives back each input exactly
        for i in range(3):
            np.testing.assert_array_equal(np.array(batch[layer].extract(i).state[0]), before[i][layer])
        batch[layer].filter([2, 0])
        batch[layer].extend(other[layer])
    order = [2, 0, 3]
    # One decode step of the filtered + extended batch equals each row stepping alone.
    tokens = [11, 22, 33]
    logits = model(mx.array([[t] for t in tokens]), cache=batch)[:, -1]
    for b, (i, t) in enumerate(zip(order, tokens)):
        ref = _step_alone(model, per_seq[i], t)
        np.testing.assert_allclose(np.array(logits[b]), np.array(ref), atol=1e-4)
        _same_row([c.extract(b) for c in batch], per_seq[i])


def test_merge_refuses_different_configurations():
    model = tiny_llama()
    a = KVCacheBuilder.for_model(model, config())[0]
    for other, what in [(KVCacheBuilder.for_model(model, config(qfilters_budget=32))[0], "qfilters_budget"),
                        (KVCacheBuilder.for_model(model, config(method="l2norm"))[0], "method"),
                        (KVCacheBuilder.for_model(model, config())[1], "layer index"),
                        (KVCache(), "KVCache")]:
        with pytest.raises(ValueError, match=what):
            QFiltersKVCache.merge([a, other])
    f1 = mx.random.normal((2, 16))
    fixed = [QFiltersKVCache(config().with_head_dim(16), filters=f) for f in (f1, f1 + 1)]
    with pytest.raises(ValueError, match="given Q-Filters"):
        BatchQFiltersCache.merge(fixed)
    batch = BatchQFiltersCache.merge([a])
    with pytest.raises(TypeError, match="never mixes"):
        batch.extend(KVCache())


def test_padding_is_never_seen_by_a_row():
    model, cfg = tiny_llama(), config()
    rows = prompts([30, 9, 17])
    n = max(map(len, rows))
    batch = [BatchQFiltersCache.merge([KVCacheBuilder.for_model(model, cfg)[layer] for _ in rows])
             for layer in range(2)]
    # Row 0 unpadded, row 1 left-padded, row 2 right-padded.
    left = [0, n - len(rows[1]), 0]
    lengths = [len(rows[0]), len(rows[1]), len(rows[2])]
    padded = [rows[0], [0] * left[1] + rows[1], rows[2] + [0] * (n - len(rows[2]))]
    for c in batch:
        c.prepare(left_padding=left, lengths=lengths, right_padding=[0, 0, n - len(rows[2])])
    logits = model(mx.array(padded), cache=batch)
    for c in batch:
        c.finalize()
    last = [n - 1, n - 1, len(rows[2]) - 1]
    for i, p in enumerate(rows):
        ref = KVCacheBuilder.for_model(model, cfg)
        ref_logits = model(mx.array([p]), cache=ref)[0, -1]
        np.testing.assert_allclose(np.array(logits[i, last[i]]), np.array(ref_logits), atol=1e-4)
        rows_i = [c.extract(i) for c in batch]
        _same_row(rows_i, ref)
        assert all(r.tokens_seen == len(p) for r in rows_i)
    assert batch[0].nbytes == sum(c.nbytes for c in batch[0].caches)


@pytest.mark.parametrize("kw", [dict(qfilters_filter_source="queries"),
                                dict(qfilters_filter_source="keys", qfilters_sign="auto")])
def test_query_configurations_per_row_under_observe_queries(kw):
    from qfilters_mlx.filters.observe import observe_queries

    model, cfg = tiny_llama(), config(**kw)
    rows = prompts([26, 11])
    n = max(map(len, rows))
    batch = [BatchQFiltersCache.merge([KVCacheBuilder.for_model(model, cfg)[layer] for _ in rows])
             for layer in range(2)]
    with observe_queries(model, batch):
        for c in batch:
            c.prepare(lengths=[len(r) for r in rows], right_padding=[n - len(r) for r in rows])
        model(mx.array([r + [0] * (n - len(r)) for r in rows]), cache=batch)
        for c in batch:
            c.finalize()
        for t in (5, 6, 7):
            model(mx.array([[t], [t]]), cache=batch)
    for i, p in enumerate(rows):
        ref = KVCacheBuilder.for_model(model, cfg)
        with observe_queries(model, ref):
            model(mx.array([p]), cache=ref)
            for t in (5, 6, 7):
                model(mx.array([[t]]), cache=ref)
        rows_i = [c.extract(i) for c in batch]
        assert all(r.filter is not None for r in rows_i)
        for a, b in zip(rows_i, ref):
            np.testing.assert_allclose(np.array(a.filter), np.array(b.filter), atol=1e-4)
        _same_row(rows_i, ref)


def test_query_configuration_unobserved_is_refused_in_batch_generator():
    model, cfg = tiny_llama(), config(qfilters_filter_source="queries")
    caches = [KVCacheBuilder.for_model(model, cfg) for _ in range(2)]
    from mlx_lm.generate import BatchGenerator
    gen = BatchGenerator(model, max_tokens=2)
    gen.insert(prompts([12, 5]), caches=caches)
    with pytest.raises(ValueError, match="observe"):
        gen.next_generated()
    gen.close()


def test_save_and_load_a_batch_cache(tmp_path):
    model, cfg = tiny_llama(), config()
    rows = prompts([40, 6])
    per_seq = _row_caches(model, cfg, rows)
    batch = [BatchQFiltersCache.merge([cs[layer] for cs in per_seq]) for layer in range(2)]
    path = str(tmp_path / "b.safetensors")
    save_prompt_cache(path, batch)
    loaded = load_prompt_cache(path)
    assert all(isinstance(c, BatchQFiltersCache) for c in loaded)
    a = model(mx.array([[3], [4]]), cache=batch)
    b = model(mx.array([[3], [4]]), cache=loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    for i in range(2):
        _same_row([c.extract(i) for c in loaded], [c.extract(i) for c in batch])


def test_compress_once_rows_batch_like_alone():
    """Compress-once caches in a batch: each row compresses at its own prompt end
    (the first single-token call after its prefill) and then grows, exactly as alone."""
    model = tiny_llama()
    cfg = config(mode=CompressOnce(ratio=0.5), qfilters_recent=None)
    KVCacheBuilder.install(model, cfg)
    rows = prompts([40, 9, 70])
    toks, caches, lps = batched(model, rows, 8)
    _check_against_alone(model, cfg, rows, toks, caches, lps, 8)
    for i, p in enumerate(rows):  # compressed to int((len - 1) * 0.5) kept, then grew by 9 tokens
        kept = max(1, int((len(p) - 1) * 0.5))
        assert caches[i][0].size() == kept + 9, i
