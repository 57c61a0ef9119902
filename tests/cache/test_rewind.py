"""Exact rewinds after an eviction: the journal, ``trim``, speculative decoding."""

import contextlib
import copy
import pickle

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from helpers.cache_model import CacheModel
from qfilters_mlx import CompressOnce, KVCacheBuilder, KVCacheConfig, QFiltersKVCache, observe_queries
from qfilters_mlx.backends import reference
from qfilters_mlx.backends import metal as metal_module
from qfilters_mlx.backends.base import Backend
from qfilters_mlx.cache.journal_rows import dropped_rows
from test_cache import D, H, assert_same_view, fixed_cache, int_data, observed_query_cache
from test_cache import assert_same as assert_same_cache
from test_cache import feed_cache as feed
from test_cache import observable as observable_cache

METHODS = ["qfilters", "l2norm", "streaming_llm", "random"]


def cfg(method="qfilters", budget=12, recent=2, **kw):
    return KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=2, qfilters_recent=recent,
                         qfilters_calib_tokens=8, **{'qfilters_filter_source': 'keys', **kw})


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


def assert_unchanged(before, c):
    """``c`` shows what the :func:`observable` snapshot ``before`` shows (arrays bit for bit,
    dtypes included)."""
    for x, y in zip(before, observable(c)):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        else:
            assert x == y


def assert_same(a, b):
    assert_unchanged(observable(a), b)


def replay(config, k, v, events, **build):
    """A cache fed ``events`` (chunk lengths; "K" = kept_positions()) from scratch (``build``:
    the constructor's build options)."""
    c, p = QFiltersKVCache(config, **build), 0
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
    config = cfg(method, recent=recent)
    c, events, pos = QFiltersKVCache(config, backend=backend, max_rewind=6), [], 0
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
        ref = replay(config, k, v, events, backend=backend, max_rewind=6)
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
    c = QFiltersKVCache(cfg(), max_rewind=4)
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    for t in range(30, 40):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert c.evicted and c.is_trimmable() and c.rewindable_tokens == 4
    before = observable(c)
    with pytest.raises(ValueError, match="cannot rewind 5 tokens.*max_rewind=4"):
        c.trim(5)
    assert_unchanged(before, c)
    assert c.trim(4) == 4 and c.offset == 36
    with pytest.raises(ValueError, match="cannot rewind 1 tokens"):  # the journal is used up
        c.trim(1)
    assert c.trim(0) == 0 and c.trim(-3) == 0 and c.offset == 36


def test_depth_zero_keeps_nothing_and_refuses_rewinds_after_eviction():
    k, v = rand_kv(2)
    c = QFiltersKVCache(cfg(), max_rewind=0)
    # mlx-lm is told no (a later rewind could not be exact); trim itself is exact until the eviction
    assert not c.is_trimmable()
    c.update_and_fetch(k[:, :, :10], v[:, :, :10])
    assert c.trim(3) == 3 and c.offset == 7  # before any eviction: a plain trim
    c.update_and_fetch(k[:, :, 7:40], v[:, :, 7:40])
    assert c.evicted and c.journal_nbytes == 0 and not c.is_trimmable()
    with pytest.raises(ValueError, match="cannot rewind 1 tokens.*max_rewind=0"):
        c.trim(1)
    assert c.offset == 40  # nothing changed
    with pytest.raises(ValueError, match="max_rewind"):
        QFiltersKVCache(cfg(), max_rewind=-1)
    with pytest.raises(TypeError, match="max_rewind"):
        QFiltersKVCache(cfg(), max_rewind=1.5)


def test_journal_bytes_are_counted():
    k, v = rand_kv(3, H=2, D=8)
    c = QFiltersKVCache(cfg(budget=12), max_rewind=5)
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


def speculative(config, prompt, k, max_tokens, max_rewind):
    caches = KVCacheBuilder.for_model(MAIN, config, max_rewind=max_rewind) + make_prompt_cache(DRAFT)
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
                           qfilters_calib_tokens=8, qfilters_filter_source="keys")
    prompt = prompt_tokens(seed, n_prompt)
    spec, caches = speculative(config, prompt, num_draft, 24, max_rewind=8)
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
    """Cascade-free: the numpy model of the cache (tests/helpers/cache_model.py) is fed exactly the keys,
    values and rewinds the speculative run gave each main cache (so no ulp-level difference of
    a recomputed key can swap a near-tie and change everything after it, which comparing with a
    replay of the accepted tokens cannot rule out); after the run, kept positions equal the
    model's (up to float32 rounding of tied scores), the stored keys/values are bit for bit the
    history's at those positions, and every rewind trimmed what the model trims."""
    config = KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=2, qfilters_recent=2,
                           qfilters_calib_tokens=8, qfilters_filter_source="keys")
    prompt = prompt_tokens(seed, n_prompt)
    caches = KVCacheBuilder.for_model(MAIN, config, max_rewind=8)
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
                           qfilters_calib_tokens=8, qfilters_filter_source="keys")
    prompt = prompt_tokens(5, 30)
    spec, caches = speculative(config, prompt, 3, 20, max_rewind=3)
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
                           qfilters_filter_source="keys")
    prompt = prompt_tokens(7, 40)
    spec, caches = speculative(config, prompt, 3, 20, max_rewind=3)
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
                           qfilters_filter_source="queries")
    assert config.needs_queries and not draft_config(config).needs_queries
    assert draft_config(config).qfilters_sign == -1
    prompt = prompt_tokens(seed, 30)
    main = KVCacheBuilder.for_model(MAIN, config, max_rewind=8)
    draft = KVCacheBuilder.for_model(DRAFT, draft_config(config), max_rewind=8)
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


# ------------------------------------------------------------------------------------------------
# The rewind journal (``cache/journal.py``) pinned exactly: its reach, its bytes, and rewinds
# across every kind of record (behaviour the mutation check of ``cache/journal.py`` and
# ``cache/kv_cache.py`` needs pinned: ``tools/mutation.py``, bench/results/mutation.md).
#
# * reach (journal.py / ``rewindable_tokens``): the journal keeps the records of the newest
#   calls covering at least ``max_rewind`` tokens (one record per call, a decode step
#   being a 1-token call); after an eviction ``trim`` can remove ``min(depth, tokens those
#   records cover)``; a plain trim before any eviction forgets the trimmed tokens (whole calls
#   and the tail of one); a compression clears it;
# * bytes (``journal_nbytes``, formula of journal.py and accounting.py): per decode step
#   ``B H (4 + (D_k + D_v) itemsize + 12)``, the step entering slot mode ``12 B H capacity``,
#   per call the rows its eviction dropped, plus the free slot's rows;
# * rewinds (docs/mlx-lm.md, "Speculative decoding"): whole calls, decode steps, the tail of a call,
#   across ``kept_positions()`` (which leaves slot mode), from a cache reloaded in slot mode:
#   bit-identical to a cache that never saw the removed tokens, and both continue alike;
# * ``dropped_rows``: the rows not kept, ascending, also past float32's exact integers.
#
# References: a cache fed only the surviving calls (``assert_same`` of
# ``tests/cache/test_cache.py``: state, meta, offset, size, nbytes, journal bytes), the
# byte formula and the reach rule written out, numpy (``np.setdiff1d``).
# ------------------------------------------------------------------------------------------------


BUDGET = 12
ROW = 2 * D * 4 + 4 + 8  # bytes of one row per (batch row, head): float32 K and V, score, position
STEP_BYTES = H * (4 + ROW)  # a decode step's record (B = 1): its slot (int32) and the rows it held
KP = "kept_positions"


def run(ops, k, v, f, depth=64):
    """A cache fed ``ops`` (an int: a call of that many tokens; ``KP``: ``kept_positions()``)."""
    c = fixed_cache(f, budget=BUDGET, depth=depth)
    start = 0
    for op in ops:
        if op == KP:
            c.kept_positions()
        else:
            start = feed(c, k, v, [op], start=start)
    return c


def tokens(ops):
    return sum(op for op in ops if op != KP)


# ------------------------------------------------------------------ rewinds
OPS = [14, 1, 1, 1, KP, 1, 1, 3, 1, KP, 2, 1, 4]


@pytest.mark.parametrize("cut", [i for i in range(1, len(OPS)) if OPS[i] != KP])
def test_rewinding_any_tail_of_calls_steps_and_layout_switches_is_exact(cut):
    """A cache fed ``OPS`` (an eviction, slot-mode steps, ``kept_positions()`` between them,
    calls from slot mode and from temporal order) and rewound by the tokens of ``OPS[cut:]``
    is the cache fed ``OPS[:cut]``, down to its journal bytes (the depth covers every token:
    the same records remain); rewound to one token into the first removed call (when it has
    more), it is the cache fed that token too; all continue alike."""
    k, v, f = int_data(64, seed=21)
    n = tokens(OPS[cut:])
    first = OPS[cut]
    for back, kept in [(n, OPS[:cut])] + ([(n - 1, OPS[:cut] + [1])] if first > 1 else []):
        a, b = run(OPS, k, v, f), run(kept, k, v, f)
        assert a.evicted and a.rewindable_tokens == tokens(OPS)  # every token (depth 64)
        assert a.trim(back) == back
        assert_same_cache(a, b)
        start = tokens(kept)
        for L in (1, 2, 1, 1):
            for c in (a, b):
                feed(c, k, v, [L], start=start)
            start += L
            assert_same_cache(a, b)


def test_a_cache_reloaded_in_slot_mode_rewinds_its_first_call_exactly(tmp_path):
    """A reloaded cache holds no journal nor the free slot's rows; a call fed after the reload
    (which leaves slot mode) is rewound exactly: the reloaded cache again, which continues
    like the cache that was saved."""
    k, v, f = int_data(40, seed=22)
    c = run([14, 1, 1], k, v, f)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [c])
    a, b = load_prompt_cache(path)[0], load_prompt_cache(path)[0]
    feed(a, k, v, [3], start=16)
    assert a.rewindable_tokens == 3
    assert a.trim(3) == 3
    assert_same_cache(a, b)
    for x in (a, b, c):
        feed(x, k, v, [1, 1], start=16)
    assert_same_cache(a, b)
    assert [np.array(x).tolist() for x in a.state[:4]] == [np.array(x).tolist() for x in c.state[:4]]


# -------------------------------------------------------------------- reach
def covered(calls, depth):
    """The rule written out: the tokens of the newest calls covering at least ``depth``
    tokens (all, when fewer were fed); ``trim`` can remove ``min(depth, covered)``."""
    total = 0
    for L in reversed(calls):
        total += L
        if total >= depth:
            break
    return total


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 7])
def test_rewindable_tokens_after_an_eviction_follow_the_reach_rule(depth):
    k, v, f = int_data(64, seed=23)
    calls = [14, 2, 1, 1, 3, 1, 1, 1, 5, 1]
    c = fixed_cache(f, budget=BUDGET, depth=depth)
    start = 0
    for i, L in enumerate(calls):
        start = feed(c, k, v, [L], start=start)
        assert c.rewindable_tokens == min(depth, covered(calls[: i + 1], depth))
    # a rewind uses up the records it replays
    assert c.trim(1) == 1 and c.rewindable_tokens == min(depth, covered(calls, depth) - 1)


def cut_journal(calls, back):
    """The calls left after removing the newest ``back`` tokens (a call cut inside keeps its head)."""
    calls = list(calls)
    while back > 0:
        last = calls.pop()
        if last > back:
            calls.append(last - back)
        back -= min(last, back)
    return calls


@pytest.mark.parametrize("trims", [[1, 1, 4], [1, 4]], ids=["tail_of_a_call", "whole_calls"])
def test_plain_trims_before_an_eviction_shorten_the_journal_exactly(trims):
    """Before any eviction ``trim`` drops the newest tokens, also from the journal: a single
    token, a whole call, several calls and the tail of one; the evicting calls after it then
    rewind across the trimmed calls exactly (the cache fed only the surviving tokens), and
    ``rewindable_tokens`` counts exactly the tokens fed since the build (depth 64)."""
    k, v, f = int_data(64, seed=24)
    fed = [3, 3, 3, 2]  # 11 tokens: nothing evicted (budget 12)
    later = [5, 3, 1, 1]  # the 3-token call evicts
    left = cut_journal(fed, sum(trims))

    def trimmed():
        x = run(fed, k, v, f)
        for n in trims:
            assert not x.evicted and x.rewindable_tokens == x.size()
            assert x.trim(n) == n
        return x

    a, b = trimmed(), run(left, k, v, f)
    assert_same_cache(a, b)
    for c in (a, b):
        feed(c, k, v, later, start=sum(left))
    assert_same_cache(a, b)
    total = sum(left) + sum(later)
    assert a.evicted and a.rewindable_tokens == total
    for back in (2, 4, 5, 10, 11, 12, total - 1):
        x = trimmed()
        feed(x, k, v, later, start=sum(left))
        assert x.trim(back) == back
        assert_same_cache(x, run(cut_journal(left + later, back), k, v, f))
        assert x.rewindable_tokens == (total - back if x.evicted else x.size())


def test_a_compression_clears_the_journal():
    """compress(): rewinds cannot cross the compression (nothing rewindable right after it,
    ``trim`` raises naming ``max_rewind``); tokens fed after it refill the journal."""
    k, v, f = int_data(40, seed=25)
    c = QFiltersKVCache(KVCacheConfig(
        method="qfilters", mode=CompressOnce(at="manual", growth=2), qfilters_budget=8, qfilters_n_sink=2,
        qfilters_recent=2), filters=mx.array(f), max_rewind=8, backend="reference")
    feed(c, k, v, [20])
    assert c.compress() == 8 and c.evicted
    assert c.rewindable_tokens == 0 and c.journal_nbytes == 0
    with pytest.raises(ValueError, match=r"cannot rewind 1 tokens.*max_rewind=8"):
        c.trim(1)
    feed(c, k, v, [3, 1], start=20)  # 12 rows > 8 + 2: evicted again
    assert c.rewindable_tokens == 4
    with pytest.raises(ValueError, match=r"cannot rewind 5 tokens.*max_rewind=8"):
        c.trim(5)
    assert c.trim(4) == 4 and c.rewindable_tokens == 0


def test_queries_that_do_not_fit_a_reloaded_or_trimmed_cache_raise_naming_the_shapes(tmp_path):
    """observe_queries on a query-calibrating cache with an empty journal (reloaded, or trimmed
    back past every journaled call) raises the documented ValueError naming the shapes, before
    anything changes (journal bytes, state); then queries that fit are taken."""
    c, k, q = observed_query_cache(26, 6, 7, qfilters_budget=12, qfilters_calib_tokens=16,
                                   max_rewind=2)
    for L in (3, 3):
        c.update_and_fetch(k[:, :, :L], k[:, :, :L])
        c.observe_queries(q[:, :, :L])
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    r = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
    assert c.trim(3) == 3  # the journal (depth 2) held only the last call
    r.queries_observed = True
    for x, offset in ((c, 3), (r, 6)):
        before = observable_cache(x)
        with pytest.raises(ValueError, match=rf"queries \(1, 4, 7, 8\) do not fit the cache "
                                             rf"\(B=1, H_kv=2, D=8, offset={offset}\)"):
            x.observe_queries(q)
        assert_same_view(before, observable_cache(x))
        x.observe_queries(q[:, :, :offset])  # fits; the empty journal has no record to note it in
        assert_same_view(before, observable_cache(x))  # (the first queries are all kept already)


# -------------------------------------------------------------------- bytes
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_journal_bytes_follow_the_formula(depth):
    """``journal_nbytes`` = the records of the reach rule, each at the documented size, plus
    the free slot's rows (``ROW`` bytes per head) once in slot mode."""
    k, v, f = int_data(64, seed=27)
    c = fixed_cache(f, budget=BUDGET, depth=depth)
    feed(c, k, v, [14])  # evicts 2 rows
    assert c.journal_nbytes == H * 2 * ROW
    feed(c, k, v, [1], start=14)  # enters slot mode: the 12-row scores/positions buffers
    entering = H * 12 * (4 + 8)
    assert c.journal_nbytes == (H * 2 * ROW if depth > 1 else 0) + entering + H * ROW
    feed(c, k, v, [1, 1, 1, 1], start=15)
    assert c.journal_nbytes == depth * STEP_BYTES + H * ROW
    feed(c, k, v, [3], start=19)  # from slot mode: 3 rows dropped, the slot layout left
    layout = H * 12 * 4 + H * 4 + H * ROW  # order [B, H, 12] int32, free slot, its rows
    steps = max(0, depth - 3) * STEP_BYTES
    assert c.journal_nbytes == H * 3 * ROW + layout + steps
    c.kept_positions()  # already temporal: nothing journaled
    assert c.journal_nbytes == H * 3 * ROW + layout + steps


# ------------------------------------------------------------- dropped rows
def test_dropped_rows_are_the_rows_not_kept_ascending_past_float32_integers():
    """``dropped_rows(kept, arrays)``: the rows of ``arrays`` not in ``kept``, ascending, for any
    row count (here ``2**24 + 1`` rows, past the integers float32 holds exactly)."""
    n = 2**24 + 1
    kept = np.array([0, 5, 7], np.int64)  # (row 0 kept, row 2**24 dropped)
    pos = mx.arange(n, dtype=mx.int64).reshape(1, 1, n)
    keys = mx.zeros((1, 1, n, 1), mx.float16)
    out = dropped_rows(mx.array(kept.reshape(1, 1, 3)), (keys, keys, mx.zeros((1, 1, n)), pos))
    assert out[0].shape == (1, 1, n - 3, 1) and out[2].shape == (1, 1, n - 3)
    assert np.array_equal(np.array(out[3])[0, 0], np.delete(np.arange(n), kept))


def test_queries_that_do_not_fit_change_nothing_not_even_the_journal():
    """No state change before an error: queries that do not fit leave the journal (its bytes),
    the kept queries and the pending flag as they were; the fitting ones are then noted in the
    call's record (``journal_nbytes`` grows by exactly their bytes)."""
    c, k, q = observed_query_cache(31, 3, 5, qfilters_budget=12, qfilters_calib_tokens=16,
                                   max_rewind=2)
    c.update_and_fetch(k, k)
    before = observable_cache(c)
    for bad in (q, q[:, :3], q[..., :4]):  # too many tokens, H_q not a multiple of H_kv, wrong D
        with pytest.raises(ValueError, match=r"do not fit the cache \(B=1, H_kv=2, D=8, offset=3\)"):
            c.observe_queries(bad)
        assert_same_view(before, observable_cache(c))
        assert c._queries_pending  # (still owed: the next update refuses)
    c.observe_queries(q[:, :, :3])
    assert c.journal_nbytes == before[-1] + q[:, :, :3].nbytes
    np.testing.assert_array_equal(np.array(c.state[5]), np.array(q[:, :, :3]))


# ------------------------------------------------------------------------------------------------
# Copies and rewinds pinned against an uninterrupted run (behaviour the mutation check of
# ``cache/persistence.py`` and ``cache/kv_cache.py`` needs pinned: ``tools/mutation.py``,
# bench/results/mutation.md).
#
# * pickling / ``copy.deepcopy`` restore the kernel backend by name (also ``"metal"``,
#   here a stand-in for a Mac's Metal backend) and leave the copy unobserved, exactly
#   like a fresh cache (``QFiltersKVCache.__setstate__``);
# * ``trim`` (docs/mlx-lm.md, "Speculative decoding"): trimmable after an eviction for any
#   ``max_rewind > 0`` (also 1); a plain trim back to exactly
#   ``calib_tokens`` keeps the filter (it was estimated from exactly those keys) and one
#   below drops it; undoing the call that calibrated unscores the rows it leaves; a
#   compress-once cache rewound after growing is the uninterrupted cache down to its
#   buffers (``nbytes``).
#
# References: a cache that never saw the rewound tokens (``tests/cache/test_cache.py``'s
# ``assert_same``: state, meta, offset, size, nbytes, journal bytes), a fresh cache, and
# the rules of the docs and docstrings written out.
# ------------------------------------------------------------------------------------------------


def _has_cpp() -> bool:
    try:
        from qfilters_mlx import _ext  # noqa: F401
    except ImportError:
        return False
    return True


def _copy(c, how):
    return copy.deepcopy(c) if how == "deepcopy" else pickle.loads(pickle.dumps(c))


# ------------------------------------------------------------------ copies
@pytest.fixture
def metal_stand_in(monkeypatch):
    """A Mac's ``metal`` backend stood in for by the reference ops (this machine may have no
    Metal GPU); returns the list of backends it built."""
    built = []

    def select_compact(scores, keys, values, budget, n_sink, recent):
        kept = reference.select_keep(scores, budget, n_sink, recent)
        return (kept, *reference.compact(keys, values, kept))

    def metal_backend(path="auto"):
        built.append(Backend("metal", reference.projection_scores, select_compact))
        return built[-1]

    monkeypatch.setattr(metal_module, "metal_backend", metal_backend)
    return built


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("backend", ["reference", "cpp", "metal"])
def test_a_copy_resolves_the_same_backend_and_continues_like_the_original(backend, how, metal_stand_in):
    """The backend (compiled functions, not picklable) is stored by name and resolved again:
    a copy of a cache on backend X runs on X (``metal`` included) and continues bit for bit."""
    if backend == "cpp" and not _has_cpp():
        pytest.skip("qfilters_mlx._ext is not built")
    k, v, f = int_data(40, seed=11)
    c = fixed_cache(f, backend=backend)
    feed(c, k, v, [14, 1, 1])  # evicted, in slot mode
    twin = _copy(c, how)
    assert twin.backend.name == c.backend.name == backend
    if backend == "metal":
        assert len(metal_stand_in) == 2 and twin.backend is metal_stand_in[1]  # resolved anew
    assert_same_cache(twin, c)
    start = 16
    for L in (1, 3, 1):
        for x in (c, twin):
            feed(x, k, v, [L], start=start)
        start += L
        assert_same_cache(twin, c)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_is_unobserved_like_a_fresh_cache(how):
    """A copy is not the cache an observe_queries block registered: its ``queries_observed`` is
    the fresh cache's ``False``, its first update outside a block raises naming
    observe_queries (nothing stored), and inside a new block it grows like the original."""
    c, k, q = observed_query_cache(3, 4, 4, qfilters_budget=12, qfilters_n_sink=2, qfilters_recent=2,
                                   qfilters_calib_tokens=8)
    c.update_and_fetch(k, k)
    c.observe_queries(q)
    twin = _copy(c, how)
    fresh = QFiltersKVCache(c.config).queries_observed
    assert fresh is False and twin.queries_observed is fresh and c.queries_observed is True
    with pytest.raises(ValueError, match=r"observe_queries\(model, caches\)"):
        twin.update_and_fetch(k, k)
    assert twin.offset == 4 and twin.size() == 4
    twin.queries_observed = True  # a new observe_queries block
    for x in (c, twin):
        x.update_and_fetch(k, k)
        x.observe_queries(q)
    assert_same_cache(twin, c)


# ------------------------------------------------------------------ rewinds
def assert_same_but_journal(a, b):
    """``assert_same`` less the journal, which a rewind uses up (docs/mlx-lm.md: fewer rewindable
    tokens right after a rewind): state, meta, offset, size and the buffers' bytes."""
    (xa, ma, oa, sa, na, ja), (xb, mb, ob, sb, nb, jb) = observable_cache(a), observable_cache(b)
    for x, y in zip(xa, xb):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y)
    assert (ma, oa, sa, na - ja) == (mb, ob, sb, nb - jb)


def test_depth_one_is_trimmable_after_an_eviction_and_rewinds_exactly():
    """docs/mlx-lm.md: with ``max_rewind=N > 0`` an evicted cache is trimmable and ``trim(n)``
    is exact for ``n <= N``: N = 1 rewinds a decode step and the last token of a call."""
    k, v, f = int_data(40, seed=12)
    for chunks in ([16, 1, 1], [16, 3]):
        a, b = fixed_cache(f, depth=1), fixed_cache(f, depth=1)
        feed(a, k, v, chunks)
        assert a.evicted and a.is_trimmable() and a.rewindable_tokens == 1
        assert a.trim(1) == 1
        feed(b, k, v, chunks[:-1] + [chunks[-1] - 1] if chunks[-1] > 1 else chunks[:-1])
        assert_same_but_journal(a, b)
        feed(a, k, v, [1, 2], start=sum(chunks) - 1)
        feed(b, k, v, [1, 2], start=sum(chunks) - 1)
        assert_same_cache(a, b)


def calibrating_cache(calib, budget, depth=0):
    """A Q-Filters cache estimating its filter from its first ``calib`` keys."""
    return QFiltersKVCache(KVCacheConfig(
        method="qfilters", qfilters_budget=budget, qfilters_n_sink=2, qfilters_recent=2,
        qfilters_calib_tokens=calib, qfilters_filter_source="keys"),
        max_rewind=depth, backend="reference")


def test_plain_trim_keeps_the_filter_down_to_exactly_calib_tokens():
    """Before any eviction the filter is estimated once ``calib_tokens`` keys are present
    (``offset >= calib_tokens``): trimming back to exactly ``calib_tokens`` keeps it (and the
    scores), one token further drops it (rows unscored, as before calibration)."""
    k, v, _ = int_data(20, seed=13)
    a = calibrating_cache(8, 64)
    feed(a, k, v, [12])
    assert a.filter is not None and a.trim(0) == 0
    for keep in (8, 7):
        a.trim(a.offset - keep)
        b = calibrating_cache(8, 64)
        feed(b, k, v, [keep])
        assert (b.filter is not None) == (keep >= 8)
        assert_same_cache(a, b)


def test_rewinding_the_calibrating_call_unscores_the_rows_it_leaves():
    """After an eviction, rewinding (all or part of) the call that estimated the filter leaves
    the cache as one fed only what remains: before calibration its rows are unscored (zeros)."""
    k, v, _ = int_data(30, seed=14)
    for back, left in ((10, [6]), (4, [6, 6]), (12, [4])):
        a = calibrating_cache(10, 8, depth=12)
        feed(a, k, v, [4, 2, 10] if back == 12 else [6, 10])
        assert a.evicted and a.filter is not None
        assert a.trim(back) == back
        b = calibrating_cache(10, 8, depth=12)
        feed(b, k, v, left)
        assert (a.filter is None) == (sum(left) < 10)
        assert_same_cache(a, b)


@pytest.mark.parametrize("chunks", [[3, 5], [1] * 7], ids=["call", "decode_step"])
def test_compress_once_growth_rewound_is_the_uninterrupted_cache_down_to_its_buffers(chunks):
    """Compress-once with ``CompressOnce.growth``: after the compression new tokens are appended into
    buffers grown in 256-row blocks; the call (or decode step) that passes ``K + growth`` evicts.
    Rewinding it restores the rows and the buffers' size (``nbytes``) of a cache that never saw
    it, and both continue identically."""
    k, v, f = int_data(40, seed=15)

    def cache():
        c = QFiltersKVCache(KVCacheConfig(
            method="qfilters", mode=CompressOnce(at="manual", growth=6), qfilters_budget=8, qfilters_n_sink=2,
            qfilters_recent=2), filters=mx.array(f), max_rewind=8, backend="reference")
        feed(c, k, v, [20])
        assert c.compress() == 8
        return c

    a, b = cache(), cache()
    feed(a, k, v, chunks, start=20)
    assert a.size() == 14 and a.offset == 20 + sum(chunks)  # 8 + 6: the growth limit held
    a.trim(chunks[-1])
    feed(b, k, v, chunks[:-1], start=20)
    assert_same_cache(a, b)
    for x in (a, b):
        feed(x, k, v, [2, 1], start=20 + sum(chunks[:-1]))
    assert_same_cache(a, b)
