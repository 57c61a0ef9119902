"""Exact rewinds after an eviction: the journal, ``trim``, speculative decoding."""

import contextlib

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from cache_model import CacheModel
from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache, observe_queries

METHODS = ["qfilters", "l2norm", "streaming_llm", "random"]


def cfg(method="qfilters", budget=12, recent=2, depth=6, backend="auto", **kw):
    return KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=2, qfilters_recent=recent,
                         qfilters_calib_tokens=8, qfilters_backend=backend, qfilters_max_rewind=depth,
                         **{'qfilters_filter_source': 'keys', **kw})


def rand_kv(seed, T=120, H=2, D=8):
    mx.random.seed(seed)
    return mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D))


def observable(c):
    """What a caller can see, read without changing the layout (``kept_positions()`` would):
    state (temporal rows, meta incl. the slot layout), offset, size."""
    if c.size() == 0:
        return [c.offset, c.size()]
    st_ = c.state
    return [np.array(a) for a in st_[:4]] + [st_[6], c.offset, c.size()]


def assert_same(a, b):
    for x, y in zip(observable(a), observable(b)):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        else:
            assert x == y


def replay(config, k, v, events):
    """A cache fed ``events`` (chunk lengths; "K" = kept_positions()) from scratch."""
    c, p = QFiltersKVCache(config), 0
    for e in events:
        if e == "K":
            c.kept_positions()
        else:
            c.update_and_fetch(k[:, :, p:p + e], v[:, :, p:p + e])
            p += e
    return c


def cut(events, n):
    """``events`` without the newest ``n`` tokens (and the "K" events after them)."""
    out = list(events)
    while n > 0:
        if out[-1] == "K":
            out.pop()
        elif out[-1] <= n:
            n -= out.pop()
        else:
            out[-1] -= n
            n = 0
    return out


# ------------------------------------------------------------ journal property
@settings(max_examples=25, deadline=None)
@given(method=st.sampled_from(METHODS), backend=st.sampled_from(["reference", "auto"]),
       recent=st.sampled_from([0, 2]), seed=st.integers(0, 10**6),
       ops=st.lists(st.tuples(st.sampled_from([1, 1, 1, 2, 3, 5, 9]), st.integers(0, 7),
                              st.booleans()), min_size=8, max_size=30))
def test_rewind_is_bit_identical_to_never_seeing_the_tokens(method, backend, recent, seed, ops):
    """Random chunks, kept_positions() calls and rewinds (within the journal's reach):
    after every rewind the cache equals one fed only the surviving tokens, and the next
    call returns the same keys/values bit for bit."""
    k, v = rand_kv(seed % 1000)
    config = cfg(method, recent=recent, backend=backend)
    c, events, pos = QFiltersKVCache(config), [], 0
    for L, n, look in ops:
        if pos + L > k.shape[2]:
            break
        c.update_and_fetch(k[:, :, pos:pos + L], v[:, :, pos:pos + L])
        events.append(L)
        pos += L
        if look:
            c.kept_positions()
            events.append("K")
        n = min(n, c.rewindable_tokens)
        if n == 0:
            continue
        assert c.trim(n) == n
        pos -= n
        events = cut(events, n)
        ref = replay(config, k, v, events)
        assert_same(c, ref)
        if c.evicted:  # (a plain trim before any eviction keeps the buffers' capacity)
            assert c.nbytes - c.journal_nbytes == ref.nbytes - ref.journal_nbytes
        for L2 in (1, 3):
            if pos + L2 <= k.shape[2]:
                a = c.update_and_fetch(k[:, :, pos:pos + L2], v[:, :, pos:pos + L2])
                b = ref.update_and_fetch(k[:, :, pos:pos + L2], v[:, :, pos:pos + L2])
                np.testing.assert_array_equal(np.array(a[0]), np.array(b[0]))
                np.testing.assert_array_equal(np.array(a[1]), np.array(b[1]))
                events.append(L2)
                pos += L2


def test_rewind_beyond_the_journal_raises_before_changing_anything():
    k, v = rand_kv(1)
    c = QFiltersKVCache(cfg(depth=4))
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    for t in range(30, 40):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert c.evicted and c.is_trimmable() and c.rewindable_tokens == 4
    before = observable(c)
    with pytest.raises(ValueError, match="cannot rewind 5 tokens.*qfilters_max_rewind=4"):
        c.trim(5)
    for x, y in zip(before, observable(c)):
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
    assert c.trim(4) == 4 and c.offset == 36
    with pytest.raises(ValueError, match="cannot rewind 1 tokens"):  # the journal is used up
        c.trim(1)
    assert c.trim(0) == 0 and c.trim(-3) == 0 and c.offset == 36


def test_depth_zero_keeps_nothing_and_refuses_rewinds_after_eviction():
    k, v = rand_kv(2)
    c = QFiltersKVCache(cfg(depth=0))
    # mlx-lm is told no (a later rewind could not be exact); trim itself is exact until the eviction
    assert not c.is_trimmable()
    c.update_and_fetch(k[:, :, :10], v[:, :, :10])
    assert c.trim(3) == 3 and c.offset == 7  # before any eviction: a plain trim
    c.update_and_fetch(k[:, :, 7:40], v[:, :, 7:40])
    assert c.evicted and c.journal_nbytes == 0 and not c.is_trimmable()
    with pytest.raises(ValueError, match="cannot rewind 1 tokens.*qfilters_max_rewind=0"):
        c.trim(1)
    assert c.offset == 40  # nothing changed
    with pytest.raises(ValueError, match="qfilters_max_rewind"):
        KVCacheConfig(qfilters_max_rewind=-1)
    with pytest.raises(TypeError, match="qfilters_max_rewind"):
        KVCacheConfig(qfilters_max_rewind=1.5)


def test_journal_bytes_are_counted():
    k, v = rand_kv(3, H=2, D=8)
    c = QFiltersKVCache(cfg(budget=12, depth=5))
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    for t in range(30, 45):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    # 5 decode steps recorded: slot [1,2] int32, K/V row [1,2,1,8] f32 each, score f32 and
    # position i64 [1,2,1]; plus the current free slot's rows
    rows = 2 * (2 * 8 * 4) + 2 * (4 + 8)
    assert c.journal_nbytes == 5 * (2 * 4 + rows) + rows
    assert c.nbytes == sum(a.nbytes for a in (c.keys, c.values, c.scores, c.positions, c.filter)) \
        + c.journal_nbytes


# --------------------------------------------------- speculative decoding
def tiny_llama(seed, layers=2, vocab=61):
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=layers,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=vocab, num_key_value_heads=2, rope_theta=10000.0,
                           tie_word_embeddings=False)  # (tied: a random model repeats its input)
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


MAIN, DRAFT = tiny_llama(0), tiny_llama(1, layers=1)


def prompt_tokens(seed, n):
    return mx.array(np.random.default_rng(seed).integers(0, 61, n), dtype=mx.uint32)


def speculative(config, prompt, k, max_tokens):
    caches = KVCacheBuilder.for_model(MAIN, config) + make_prompt_cache(DRAFT)
    out = [(int(t), bool(d)) for t, _, d in speculative_generate_step(
        prompt, MAIN, DRAFT, num_draft_tokens=k, max_tokens=max_tokens, prompt_cache=caches)]
    return out, caches[:len(MAIN.layers)]


def replay_accepted(config, prompt, spec):
    """The main model fed, from scratch, only what speculative decoding accepted, in the same
    calls minus the rejected drafts: ``prompt[:-1]``, then per round ``[y, accepted drafts]``."""
    caches = KVCacheBuilder.for_model(MAIN, config)
    with observe_queries(MAIN, caches) if config.needs_queries else contextlib.nullcontext():
        return _replay(prompt, spec, caches)


def _replay(prompt, spec, caches):
    MAIN(prompt[None, :-1], cache=caches)
    y, out, i = int(prompt[-1]), [], 0
    while i < len(spec):
        j = i
        while j < len(spec) and spec[j][1]:
            j += 1
        chunk = [y] + [t for t, _ in spec[i:j]]
        logits = MAIN(mx.array(chunk, mx.uint32)[None], cache=caches)
        predicted = [int(t) for t in mx.argmax(logits[0], axis=-1).tolist()]
        if j == len(spec):  # max_tokens reached among accepted drafts
            out += predicted[: j - i]
            break
        out += predicted
        y, i = spec[j][0], j + 1
    return out, caches


def _speculative_run(method, budget, num_draft, seed, n_prompt):
    config = KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=2, qfilters_recent=2,
                           qfilters_calib_tokens=8, qfilters_max_rewind=8, qfilters_filter_source="keys")
    prompt = prompt_tokens(seed, n_prompt)
    spec, caches = speculative(config, prompt, num_draft, 24)
    # Examples where the tiny main model repeats one token, or the draft never disagrees,
    # exercise no rewind after an eviction: draw others.
    assume(len({t for t, _ in spec}) > 1 and any(not d for _, d in spec[:-1]))
    tokens, ref = replay_accepted(config, prompt, spec)
    return spec, caches, tokens, ref


SPEC_STRATEGY = dict(method=st.sampled_from(METHODS), budget=st.sampled_from([12, 16, 24]),
                     num_draft=st.integers(1, 4), seed=st.integers(0, 1000), n_prompt=st.integers(20, 40))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(**SPEC_STRATEGY)
def test_speculative_decoding_rewinds_exactly(method, budget, num_draft, seed, n_prompt):
    """Greedy speculative decoding with our caches: every accepted and corrected token is what
    the main model gives when fed only the accepted tokens (the rejected drafts leave no trace),
    and the cache ends at the offset and size of one that never saw the drafts."""
    spec, caches, tokens, ref = _speculative_run(method, budget, num_draft, seed, n_prompt)
    assert tokens == [t for t, _ in spec]
    for a, b in zip(caches, ref):
        assert a.offset == b.offset
        assert a.evicted and a.size() == b.size() == budget


def recording(caches):
    """Wrap every cache's ``update_and_fetch`` and ``trim`` (instance attributes, so mlx-lm's
    own calls go through them) to log ``("u", keys, values)`` / ``("t", n, trimmed)`` calls."""
    logs = []
    for c in caches:
        log, update, trim = [], c.update_and_fetch, c.trim

        def u(keys, values, _log=log, _update=update):
            _log.append(("u", np.array(keys), np.array(values)))
            return _update(keys, values)

        def t(n, _log=log, _trim=trim):
            got = _trim(n)
            _log.append(("t", n, got))
            return got

        c.update_and_fetch, c.trim = u, t
        logs.append(log)
    return logs


@settings(max_examples=12, deadline=None, derandomize=True)
@given(**{**SPEC_STRATEGY, "method": st.sampled_from(["qfilters", "l2norm", "streaming_llm"])})
@example(method="l2norm", budget=16, num_draft=3, seed=798, n_prompt=20)  # a cascade against a replay
def test_speculative_kept_sets_equal_the_numpy_model_fed_the_same_calls(method, budget, num_draft, seed,
                                                                          n_prompt):
    """Cascade-free: the numpy model of the cache (tests/cache_model.py) is fed exactly the keys,
    values and rewinds the speculative run gave each main cache (so no ulp-level difference of
    a recomputed key can swap a near-tie and change everything after it, which comparing with a
    replay of the accepted tokens cannot rule out); after the run, kept positions equal the
    model's (up to float32 rounding of tied scores), the stored keys/values are bit for bit the
    history's at those positions, and every rewind trimmed what the model trims."""
    config = KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=2, qfilters_recent=2,
                           qfilters_calib_tokens=8, qfilters_max_rewind=8, qfilters_filter_source="keys")
    prompt = prompt_tokens(seed, n_prompt)
    caches = KVCacheBuilder.for_model(MAIN, config)
    logs = recording(caches)
    spec = [(int(t), bool(d)) for t, _, d in speculative_generate_step(
        prompt, MAIN, DRAFT, num_draft_tokens=num_draft, max_tokens=24,
        prompt_cache=caches + make_prompt_cache(DRAFT))]
    assume(any(not d for _, d in spec[:-1]) and any(e[0] == "t" and e[1] > 0 for e in logs[0]))
    for cache, log in zip(caches, logs):
        filt = np.array(cache.filter) if method == "qfilters" else None
        model = CacheModel(method, budget, 2, config.protected_recent, filters=filt, sign=config.score_sign)
        for entry in log:
            if entry[0] == "u":
                model.update(entry[1], entry[2])
            else:
                assert entry[2] == model.trim(entry[1])
        assert cache.evicted == model.evicted and cache.offset == model.offset
        got, want = np.array(cache.kept_positions()), model.kept()
        assert_equal_up_to_score_rounding(got, want, model, filt, config.score_sign)
        keys, values, _ = model.rows(got)  # what the history holds at the cache's kept positions
        np.testing.assert_array_equal(np.array(cache.state[0]), keys)
        np.testing.assert_array_equal(np.array(cache.state[1]), values)


def assert_equal_up_to_score_rounding(got, want, model, filt, sign, rtol=1e-6):
    """Kept positions equal, except where two positions' scores tie to float32 rounding: the
    package computes a score (a norm, a dot product) in another summation order than numpy, so
    scores equal in float64 may differ in the last bit (here a repeated token's keys: RoPE keeps
    their norms). Every swapped pair's float64 scores must agree to ``rtol``."""
    k = model.keys.astype(np.float64)
    if model.method == "qfilters":
        s64 = sign * np.einsum("bhtd,hd->bht", k, filt.astype(np.float64))
    elif model.method == "l2norm":
        s64 = -np.sqrt((k * k).sum(-1))
    else:
        s64 = np.zeros(k.shape[:3])
    for b, h in np.ndindex(got.shape[:2]):
        only_got = sorted(set(got[b, h]) - set(want[b, h]))
        only_want = sorted(set(want[b, h]) - set(got[b, h]))
        assert len(only_got) == len(only_want)
        np.testing.assert_allclose(sorted(s64[b, h, only_got]), sorted(s64[b, h, only_want]), rtol=rtol, atol=0)


def assert_same_kept_up_to_key_ulps(a, b, rtol=1e-5):
    """Kept positions equal, except near-ties: the replay computes the same tokens' keys in
    calls of another length, so a matmul may differ in the last bit (about 1e-7 measured) and
    tokens whose scores differ by less than that may swap (flashinfer's top-k tests check
    selections against the threshold for the same reason). Each swapped pair's scores must
    agree to ``rtol``."""
    pa, pb = np.array(a.kept_positions()), np.array(b.kept_positions())
    sa, sb = np.array(a.state[2]), np.array(b.state[2])
    for r, h in np.ndindex(pa.shape[:2]):
        only_a = sorted(set(pa[r, h]) - set(pb[r, h]))
        only_b = sorted(set(pb[r, h]) - set(pa[r, h]))
        assert len(only_a) == len(only_b)
        score_a = sorted(sa[r, h][list(pa[r, h]).index(p)] for p in only_a)
        score_b = sorted(sb[r, h][list(pb[r, h]).index(p)] for p in only_b)
        np.testing.assert_allclose(score_a, score_b, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("method", METHODS)
def test_speculative_equals_greedy_while_nothing_is_evicted(method):
    """With a budget above the sequence, speculative decoding gives plain greedy decoding's
    tokens (mlx-lm's own contract) and ends at the same offset as mlx-lm's KVCache."""
    config = KVCacheConfig(method=method, qfilters_budget=256, qfilters_n_sink=2, qfilters_recent=0,
                           qfilters_calib_tokens=8, qfilters_filter_source="keys", qfilters_max_rewind=3)
    prompt = prompt_tokens(5, 30)
    spec, caches = speculative(config, prompt, 3, 20)
    greedy = [int(t) for t, _ in generate_step(prompt, MAIN, max_tokens=20,
                                               prompt_cache=KVCacheBuilder.for_model(MAIN, config))]
    assert [t for t, _ in spec] == greedy
    plain = make_prompt_cache(MAIN) + make_prompt_cache(DRAFT)
    list(speculative_generate_step(prompt, MAIN, DRAFT, num_draft_tokens=3, max_tokens=20,
                                   prompt_cache=plain))
    assert caches[0].offset == plain[0].offset == 30 + 20 - 1


def test_offset_after_speculative_decoding_with_eviction():
    """A draft that disagrees, 3 draft tokens, budget 16, a 40-token prompt, 20 tokens:
    the main caches end at the offset a plain cache reaches (59), not 116."""
    config = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=0, qfilters_calib_tokens=8,
                           qfilters_filter_source="keys", qfilters_max_rewind=3)
    prompt = prompt_tokens(7, 40)
    spec, caches = speculative(config, prompt, 3, 20)
    plain = make_prompt_cache(MAIN) + make_prompt_cache(DRAFT)
    list(speculative_generate_step(prompt, MAIN, DRAFT, num_draft_tokens=3, max_tokens=20,
                                   prompt_cache=plain))
    assert all(c.evicted and c.size() == 16 for c in caches)
    assert [c.offset for c in caches] == [plain[0].offset] * 2 == [59, 59]


@pytest.mark.parametrize("seed", [3, 11])
def test_speculative_with_the_query_filter_and_eviction_caches_on_the_draft(seed):
    """The command line's --draft-model setup: the main model on the online query filter inside
    observe_queries, the draft on eviction caches too (the key-SVD filter, draft_config: one
    observed model). Both hold their budgets; every token is what the main model gives when fed
    only the accepted tokens, and the main caches keep what that replay keeps."""
    from qfilters_mlx.commands.generation import draft_config

    config = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_calib_tokens=8,
                           qfilters_max_rewind=8, qfilters_filter_source="queries")
    assert config.needs_queries and not draft_config(config).needs_queries
    assert draft_config(config).qfilters_sign == -1
    prompt = prompt_tokens(seed, 30)
    main = KVCacheBuilder.for_model(MAIN, config)
    draft = KVCacheBuilder.for_model(DRAFT, draft_config(config))
    with observe_queries(MAIN, main):
        spec = [(int(t), bool(d)) for t, _, d in speculative_generate_step(
            prompt, MAIN, DRAFT, num_draft_tokens=3, max_tokens=24, prompt_cache=main + draft)]
    assert any(not d for _, d in spec[:-1]), "the draft should disagree sometimes"
    assert all(c.evicted and c.size() == 16 and c.filter is not None for c in main + draft)
    tokens, ref = replay_accepted(config, prompt, spec)
    assert tokens == [t for t, _ in spec]
    for a, b in zip(main, ref):
        assert a.offset == b.offset
        assert_same_kept_up_to_key_ulps(a, b)
