"""No silent rewind, atomic batch operations, combined features.

mlx-lm trims a cache only through ``trim_prompt_cache``, which asks ``is_trimmable()``
first and silently skips a cache that says False; its speculative decoding asks once,
before the prompt. So a cache must say True only when every rewind it may be asked
is exact: then speculative decoding with a cache that cannot rewind is refused before
the prompt (nothing fed), and mlx-lm's server never trims a stored cache that cannot
be trimmed. References: mlx-lm's own ``KVCache`` run (offsets), the state before a
refused call (nothing changed), the model's own caches (logits).
"""

import copy
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import (
    LRUPromptCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from helpers import arch_matrix
from helpers.batch_helpers import alone, batched, prompts
from qfilters_mlx import CompressOnce, KVCacheBuilder, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.cache.batch import BatchQFiltersCache
from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache
from qfilters_mlx.model_info import default_caches, walk
from test_rewind import DRAFT, MAIN, assert_unchanged, observable, prompt_tokens, rand_kv

BASE = dict(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=0, qfilters_calib_tokens=8,
            qfilters_filter_source="keys")
# Every evicting kind (the refusal tests build them with max_rewind=0).
KINDS = {
    "streaming": {},
    "streaming_llm": {"method": "streaming_llm"},
    "compress_once": {"mode": CompressOnce(ratio=0.5)},
}
QUANTIZED = dict(kv_bits=8, kv_group_size=32)  # build options of the quantized caches
QUANTIZED_CACHE = dict(bits=8, group_size=32)  # the same, as QuantizedQFiltersKVCache's keywords


def spec(caches, n_draft=3, prompt=None, max_tokens=20):
    prompt = prompt_tokens(7, 40) if prompt is None else prompt
    return list(speculative_generate_step(prompt, MAIN, DRAFT, num_draft_tokens=n_draft,
                                          max_tokens=max_tokens, prompt_cache=caches))


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_decoding_with_a_cache_that_cannot_rewind_is_refused_before_the_prompt(kind):
    """Rejected drafts after an eviction with ``max_rewind=0``: mlx-lm's start check refuses (it
    used to go on with rejected drafts in the cache, offset 116 against a plain cache's 59)."""
    config = KVCacheConfig(**{**BASE, **KINDS[kind]})
    caches = KVCacheBuilder.for_model(MAIN, config, max_rewind=0) + make_prompt_cache(DRAFT)
    assert not any(c.is_trimmable() for c in caches[:2])
    # (MAIN's head_dim 8 < group 32)
    assert not QuantizedQFiltersKVCache(KVCacheConfig(**BASE), **QUANTIZED_CACHE).is_trimmable()
    with pytest.raises(ValueError, match="trimmable prompt cache.*QFiltersKVCache"):
        spec(caches)
    assert [c.offset for c in caches] == [0, 0, 0]  # nothing fed
    # also when the caches already hold a prefix that evicted nothing yet, and for copies
    MAIN(prompt_tokens(7, 40)[None, :5], cache=caches[:2])
    for cs in (caches, copy.deepcopy(caches)):
        with pytest.raises(ValueError, match="trimmable prompt cache"):
            spec(cs)
        assert [c.offset for c in cs[:2]] == [5, 5]


def test_speculative_through_make_cache_is_refused_before_the_prompt():
    """``mlx_lm.generate(..., draft_model=...)`` builds the caches with ``model.make_cache``."""
    KVCacheBuilder.install(MAIN, KVCacheConfig(**BASE), max_rewind=0)
    try:
        with pytest.raises(ValueError, match="trimmable prompt cache.*QFiltersKVCache"):
            spec(None)
    finally:
        del MAIN.make_cache


def test_speculative_with_a_journal_shallower_than_the_drafts_raises_naming_the_field():
    """max_rewind=1 with 3 draft tokens: the first rewind deeper than the journal after
    an eviction raises naming max_rewind (never a skipped trim)."""
    caches = KVCacheBuilder.for_model(MAIN, KVCacheConfig(**BASE), max_rewind=1)
    with pytest.raises(ValueError, match="max_rewind=1"):
        spec(caches + make_prompt_cache(DRAFT))


def test_trim_prompt_cache_never_skips_a_cache_that_says_trimmable():
    """Through mlx-lm's trim_prompt_cache: a cache that cannot rewind reports 0 trimmed and is
    unchanged; one that can (method full, or within the journal) trims exactly n."""
    k, v = rand_kv(4)
    for config, depth, want in [(KVCacheConfig(**BASE), None, 0),
                                (KVCacheConfig(method="full", **BASE), None, 3), (KVCacheConfig(**BASE), 4, 3)]:
        c = QFiltersKVCache(config, max_rewind=depth)
        c.update_and_fetch(k[:, :, :30], v[:, :, :30])
        for t in range(30, 36):
            c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        before = observable(c)
        assert trim_prompt_cache([c], 3) == want
        assert c.offset == 36 - want
        if want == 0:
            assert_unchanged(before, c)


def test_server_prompt_cache_never_trims_what_it_cannot_and_never_raises():
    """mlx-lm's LRUPromptCache with compress-once caches that grew after their compression
    (main: is_trimmable() was True, the server dropped the shorter prefixes and a request
    diverging before the growth raised ValueError). The result continues exactly like a fresh
    cache fed the same tokens in the same calls."""
    config = KVCacheConfig(**{**BASE, **KINDS["compress_once"]})
    toks = prompt_tokens(3, 30).tolist()
    caches = KVCacheBuilder.for_model(MAIN, config)
    MAIN(mx.array([toks[:20]]), cache=caches)
    for t in toks[20:24]:  # compressed at the first one, then 3 grown tokens
        MAIN(mx.array([[t]]), cache=caches)
    lru = LRUPromptCache()
    short = KVCacheBuilder.for_model(MAIN, config)
    MAIN(mx.array([toks[:10]]), cache=short)
    lru.insert_cache("main", toks[:10], short)  # a shorter prefix (the server keys by model name)
    lru.insert_cache("main", toks[:24], caches)
    request = toks[:14] + [1, 2, 3]  # diverges 10 tokens before the stored end
    cache, rest = lru.fetch_nearest_cache("main", request)
    assert cache is not None and cache[0].offset == len(request) - len(rest) == 10
    fresh = KVCacheBuilder.for_model(MAIN, config)  # the same tokens in the same calls
    MAIN(mx.array([request[:10]]), cache=fresh)
    want = MAIN(mx.array([rest[:-1]]), cache=fresh)[:, -1]
    got = MAIN(mx.array([rest[:-1]]), cache=cache)[:, -1]
    np.testing.assert_array_equal(np.array(got), np.array(want))


# ------------------------------------------------------------------ batch caches
def _row(config, n, seed, max_rewind=None):
    k, v = rand_kv(seed, T=n)
    c = QFiltersKVCache(config, max_rewind=max_rewind)
    c.update_and_fetch(k[:, :, : n - 4], v[:, :, : n - 4])
    for t in range(n - 4, n):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    return c


@pytest.mark.parametrize("case", ["short_row", "journal_used_up"])
def test_batch_trim_changes_no_row_unless_every_row_can(case):
    config = KVCacheConfig(**BASE)
    rows = [_row(config, 40, 1, 4), _row(config, 40, 2, 4)]
    if case == "short_row":  # not evicted, 2 tokens: a trim of 3 would remove only 2
        rows[1] = QFiltersKVCache(config, max_rewind=4)
        k, v = rand_kv(3, T=2)
        rows[1].update_and_fetch(k, v)
    else:  # a rewind used the journal up
        rows[1].trim(4)
    batch = BatchQFiltersCache(rows)
    before = [observable(c) for c in rows]
    with pytest.raises(ValueError, match="trim\\(3\\)"):
        batch.trim(3)
    for b, c in zip(before, rows):
        assert_unchanged(b, c)
    ok = BatchQFiltersCache([_row(config, 40, 1, 4), _row(config, 40, 2, 4)])
    assert ok.trim(3) == 3 and [c.offset for c in ok.caches] == [37, 37]


def test_batch_is_trimmable_follows_the_rows():
    assert not BatchQFiltersCache([_row(KVCacheConfig(**BASE), 20, 1)]).is_trimmable()
    assert BatchQFiltersCache([_row(KVCacheConfig(**BASE), 20, 1, 2)]).is_trimmable()


def test_zero_token_batch_update_is_refused_like_the_single_cache():
    config = KVCacheConfig(**BASE)
    rows = [_row(config, 20, 1), _row(config, 20, 2)]
    batch = BatchQFiltersCache(rows)
    before = [observable(c) for c in rows]
    empty = mx.zeros((2, 2, 0, 8))
    with pytest.raises(ValueError, match="at least one token") as single:
        QFiltersKVCache(config).update_and_fetch(empty[:1], empty[:1])
    with pytest.raises(ValueError, match=re.escape(str(single.value))):
        batch.update_and_fetch(empty, empty)
    for b, c in zip(before, rows):
        assert_unchanged(b, c)


def _head_dim_32_llama():
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                           vocab_size=96, head_dim=32, tie_word_embeddings=True)
    mx.random.seed(3)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 3, model.parameters()))  # varied greedy tokens
    mx.eval(model.parameters())
    return model


def test_kv_bits_with_batch_generator_rows_equal_each_alone():
    """install(kv_bits=8) + BatchGenerator (main: AttributeError: 'tuple' object has no
    attribute 'shape' in the first forward): every row's tokens, logprobs and kept positions
    equal the same prompt generated alone with its own quantized caches."""
    model = _head_dim_32_llama()
    KVCacheBuilder.install(model, KVCacheConfig(**BASE), **QUANTIZED)
    rows = prompts([5, 12, 40, 3])
    toks, caches, lps = batched(model, rows, 8)
    for i, p in enumerate(rows):
        ref_toks, ref_caches, ref_lps = alone(model, p, KVCacheConfig(**BASE), 8, **QUANTIZED)
        assert toks[i] == ref_toks, i
        np.testing.assert_allclose(np.stack([np.array(x) for x in lps[i]]),
                                   np.stack([np.array(x) for x in ref_lps]), atol=1e-4, rtol=2e-5)
        for c, r in zip(caches[i], ref_caches):
            assert type(c) is QuantizedQFiltersKVCache and c.offset == r.offset
            # (packed words may differ in a last quantization level: the batched K/V projections
            # sum in another order than one row's, as in the unquantized batch tests)
            np.testing.assert_array_equal(np.array(c.kept_positions()), np.array(r.kept_positions()))


def test_batch_to_quantized_and_reload_keep_quantized_rows(tmp_path):
    rows = [_row(KVCacheConfig(**BASE), 40, 1), _row(KVCacheConfig(**BASE), 30, 2)]
    with pytest.raises(ValueError, match="kv_group_size|group"):  # head_dim 8 < group 32: refused
        BatchQFiltersCache(rows).to_quantized(group_size=32, bits=8)
    model = _head_dim_32_llama()
    caches = [KVCacheBuilder.for_model(model, KVCacheConfig(**BASE)) for _ in range(2)]
    model(mx.array([[1, 2, 3, 4, 5]]), cache=caches[0])
    model(mx.array([[6, 7]]), cache=caches[1])
    batch = [BatchQFiltersCache.merge([a, b]).to_quantized(group_size=32, bits=8)
             for a, b in zip(*caches)]
    assert batch[0].bits == 8 and batch[0].group_size == 32
    assert not hasattr(BatchQFiltersCache.merge([caches[0][0]]), "bits")
    save_prompt_cache(str(tmp_path / "b.safetensors"), batch)
    loaded = load_prompt_cache(str(tmp_path / "b.safetensors"))
    assert all(type(r) is QuantizedQFiltersKVCache for b in loaded for r in b.caches)
    x = mx.array([[9], [9]])
    want = model(x, cache=batch)
    got = model(x, cache=loaded)
    np.testing.assert_array_equal(np.array(got), np.array(want))


# ------------------------------------------------------------------ keys_and_values (shared KV)
def test_keys_and_values_are_what_the_last_update_returned():
    """mlx-lm's keys_and_values(): the keys/values the layer's last attention call got (stored ++
    new, before this call's eviction), also for quantized storage (packed tuples) and batches."""
    k, v = rand_kv(5, T=40, D=32)
    caches = [QFiltersKVCache(KVCacheConfig(**BASE)) for _ in range(3)] + [
        QuantizedQFiltersKVCache(KVCacheConfig(**BASE), **QUANTIZED_CACHE)]
    for c in caches:
        c.keep_last_kv = True
    batch = BatchQFiltersCache(caches[1:3])
    for c in (caches[0], caches[3], batch):
        kk, vv = (k, v) if c is not batch else (mx.concatenate([k, -k]), mx.concatenate([v, -v]))
        for a, b in [(0, 30), (30, 31), (31, 35)]:
            out = c.update_and_fetch(kk[:, :, a:b], vv[:, :, a:b])
            got = c.keys_and_values()
            assert len(tree_flatten(out)) == len(tree_flatten(got)) >= 2
            for (_, x), (_, y) in zip(tree_flatten(out), tree_flatten(got)):
                np.testing.assert_array_equal(np.array(x), np.array(y))


@pytest.mark.parametrize("name", ["gemma3n", "afm7"])
def test_shared_kv_architectures_run_and_equal_their_own_caches(name):
    """Layers that read another layer's cache with keys_and_values(): with a budget covering
    the sequence, the logits equal the model's own caches bit for bit; with eviction every
    budgeted cache holds the budget."""
    model = arch_matrix.tiny_model(name)
    tokens = [(5 * i + 3) % 64 for i in range(40)]
    cfg = KVCacheConfig(qfilters_budget=64, qfilters_recent=0, qfilters_calib_tokens=4,
                        qfilters_filter_source="keys")
    own, ours = default_caches(model), KVCacheBuilder.for_model(model, cfg)
    start = 0
    for L in [6, 1, 3, 1]:
        want = model(mx.array([tokens[start:start + L]]), cache=own)
        got = model(mx.array([tokens[start:start + L]]), cache=ours)
        np.testing.assert_array_equal(np.array(got), np.array(want))
        start += L
    caches = KVCacheBuilder.for_model(model, arch_matrix.BUILD_CONFIG)
    budget = arch_matrix.BUILD_CONFIG.qfilters_budget
    model(mx.array([tokens[:30]]), cache=caches)
    model(mx.array([tokens[30:31]]), cache=caches)
    sized = [c for _, c in walk(caches) if isinstance(c, QFiltersKVCache)]
    assert sized and all(c.size() == budget and c.offset == 31 for c in sized)


# ------------------------------------------------- rewinds on demand (the default)
AUTO_KINDS = {"streaming": {}, "streaming_llm": {"method": "streaming_llm"}, "l2norm": {"method": "l2norm"}}
# (compress-once's prompt_end trigger fires on the first single-token call, which the replay of
# accepted tokens places elsewhere than speculative decoding: not a reference for that mode)


@pytest.mark.parametrize("kind", AUTO_KINDS)
@pytest.mark.parametrize("n_draft", [1, 3])
def test_speculative_decoding_with_the_default_caches_rewinds_exactly(kind, n_draft):
    """``max_rewind="auto"`` (the default): mlx-lm's start check turns the journal on, and every
    accepted and corrected token is what the main model gives when fed only the accepted tokens
    in the same calls (rejected drafts leave no trace); the caches end like that replay's."""
    from test_rewind import replay_accepted

    config = KVCacheConfig(**{**BASE, **AUTO_KINDS[kind]})
    for seed in range(6):
        prompt = prompt_tokens(seed, 40)
        caches = KVCacheBuilder.for_model(MAIN, config)
        assert all(c.journal_nbytes == 0 and not c._journal.active for c in caches)
        out = [(int(t), bool(d)) for t, _, d in speculative_generate_step(
            prompt, MAIN, DRAFT, num_draft_tokens=n_draft, max_tokens=24,
            prompt_cache=caches + make_prompt_cache(DRAFT))]
        if not any(not d for _, d in out[:-1]):
            continue  # no rejected draft: no rewind to check
        tokens, ref = replay_accepted(config, prompt, out)
        assert tokens == [t for t, _ in out]
        for a, b in zip(caches, ref):
            assert a.offset == b.offset and a.evicted and a.size() == b.size()
            np.testing.assert_array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))
        return
    pytest.fail("no seed rejected a draft")


def test_auto_journal_turns_on_only_when_asked_before_the_first_eviction():
    """The rule written out: asked before any eviction -> True and journaling AUTO_REWIND tokens;
    never asked -> no journal bytes however long it runs; asked first after an eviction -> False
    (and mlx-lm's trim_prompt_cache changes nothing); quantized storage -> False; max_rewind=0 ->
    False; a rewind deeper than AUTO_REWIND raises naming max_rewind before changing anything."""
    from qfilters_mlx.config import AUTO_REWIND

    k, v = rand_kv(5)
    never = QFiltersKVCache(KVCacheConfig(**BASE))
    asked = QFiltersKVCache(KVCacheConfig(**BASE))
    late = QFiltersKVCache(KVCacheConfig(**BASE))
    assert asked.is_trimmable() and asked._journal.depth == AUTO_REWIND
    for c in (never, asked, late):
        c.update_and_fetch(k[:, :, :30], v[:, :, :30])
        for t in range(30, 60):
            c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert never.journal_nbytes == 0 and asked.journal_nbytes > 0
    before = observable(late)
    assert not late.is_trimmable() and trim_prompt_cache([late], 3) == 0
    assert_unchanged(before, late)
    # within the journal: exactly the cache that never saw the tokens
    ref = QFiltersKVCache(KVCacheConfig(**BASE))
    ref.update_and_fetch(k[:, :, :30], v[:, :, :30])
    for t in range(30, 60 - AUTO_REWIND):
        ref.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    deeper = copy.deepcopy(asked)
    assert trim_prompt_cache([asked], AUTO_REWIND) == AUTO_REWIND
    assert_unchanged(observable(ref), asked)
    before = observable(deeper)
    with pytest.raises(ValueError, match="max_rewind='auto'"):
        deeper.trim(AUTO_REWIND + 1)
    assert_unchanged(before, deeper)
    assert not QuantizedQFiltersKVCache(KVCacheConfig(**BASE), **QUANTIZED_CACHE).is_trimmable()
    assert not QFiltersKVCache(KVCacheConfig(**BASE), max_rewind=0).is_trimmable()


def test_auto_depth_round_trips_through_a_prompt_cache_file(tmp_path):
    """Saved with ``max_rewind="auto"``, loaded the same; a reloaded evicted cache has no journal
    (files do not carry it) and says False; one that has not evicted says True again."""
    k, v = rand_kv(6)
    evicted, fresh = QFiltersKVCache(KVCacheConfig(**BASE)), QFiltersKVCache(KVCacheConfig(**BASE))
    evicted.update_and_fetch(k[:, :, :30], v[:, :, :30])
    fresh.update_and_fetch(k[:, :, :10], v[:, :, :10])
    save_prompt_cache(str(tmp_path / "c.safetensors"), [evicted, fresh])
    a, b = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert a.max_rewind == b.max_rewind == "auto"
    assert not a.is_trimmable() and b.is_trimmable()


def test_speculative_through_make_cache_runs_with_the_default_config():
    """``mlx_lm.generate(..., draft_model=...)`` builds the caches with ``model.make_cache``: with
    the default config it runs (no refusal) and gives what the same caches built by hand give."""
    config = KVCacheConfig(**BASE)
    prompt = prompt_tokens(2, 40)
    want = [int(t) for t, _, _ in speculative_generate_step(
        prompt, MAIN, DRAFT, num_draft_tokens=3, max_tokens=20,
        prompt_cache=KVCacheBuilder.for_model(MAIN, config) + make_prompt_cache(DRAFT))]
    KVCacheBuilder.install(MAIN, config)
    try:
        got = [int(t) for t, _, _ in speculative_generate_step(prompt, MAIN, DRAFT, num_draft_tokens=3,
                                                               max_tokens=20)]
    finally:
        del MAIN.make_cache
    assert got == want and len(got) == 20


@pytest.mark.parametrize("max_rewind", [0, 16, "auto"])
def test_a_full_cache_is_trimmable_at_every_depth_and_keeps_no_journal(max_rewind):
    """``method="full"`` never evicts: every rewind is a plain trim, so it says True at any
    ``max_rewind`` and keeps no journal (nothing to replay), and trims exactly."""
    k, v = rand_kv(6)
    c = QFiltersKVCache(KVCacheConfig(**{**BASE, "method": "full"}), max_rewind=max_rewind)
    assert c.is_trimmable()
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    for t in range(30, 34):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert c.journal_nbytes == 0 and not c._journal.active and c.is_trimmable()
    assert c.trim(5) == 5 and c.offset == 29
    np.testing.assert_array_equal(np.array(c.state[0]), np.array(k[:, :, :29]))


@pytest.mark.parametrize("join", ["add", "iadd"])
def test_default_caches_on_the_draft_model_too_end_at_the_emitted_tokens(join):
    """``for_model(main) + for_model(draft)`` (or ``+=``) as speculative decoding's prompt cache,
    prompt longer than the budget: mlx-lm asks only the main caches before the prompt and trims
    the draft's without asking. The draft's caches journal too (asked when joined): at the end
    each draft cache is as far behind the main caches as mlx-lm's own full draft cache is in
    its run (the draft model has seen exactly the emitted tokens; before: 100 against 79, the
    rejected drafts kept), and holds no position at or past its offset."""
    config = KVCacheConfig(**BASE)
    prompt = prompt_tokens(3, 60)

    def run(draft_caches):
        main = KVCacheBuilder.for_model(MAIN, config)
        if join == "add":
            caches = main + draft_caches
        else:
            caches = main
            caches += draft_caches
        out = [(int(t), bool(d)) for t, _, d in speculative_generate_step(
            prompt, MAIN, DRAFT, num_draft_tokens=3, max_tokens=20, prompt_cache=caches)]
        return out, caches[: len(MAIN.layers)], caches[len(MAIN.layers):]

    ref_out, ref_main, ref_draft = run(make_prompt_cache(DRAFT))
    out, main, draft = run(KVCacheBuilder.for_model(DRAFT, config))
    assert any(not d for _, d in out[:-1])  # (a draft was rejected: rewinds happened)
    assert all(isinstance(c, QFiltersKVCache) and c.evicted for c in draft)
    lag = ref_main[0].offset - ref_draft[0].offset
    assert all(main[0].offset - c.offset == lag for c in draft), (
        main[0].offset, [c.offset for c in draft], lag)
    assert main[0].offset == len(prompt) + len(out) - 1 + (ref_main[0].offset - len(prompt) - len(ref_out) + 1)
    for c in draft:
        pos = np.array(c.kept_positions())
        assert pos.max() < c.offset and len(np.unique(pos[0, 0])) == pos.shape[-1]
