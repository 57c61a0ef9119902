"""Stored conversations of ``qfilters-mlx server`` (``commands/server_cache.py``), without HTTP.

The rules written out here:

* prefill cuts: a prompt's pieces end at every segment end and at every multiple of the
  prefill step; a piece ending a segment keeps that segment's type, the others are
  ``"prefill"`` (never stored);
* at rest: a stored eviction cache holds its kept rows (``budget``, ``budget + 1`` slots in
  decode) and at most ``max_rewind`` rows of journal, in buffers of its own: the process's
  active memory grows by what ``nbytes`` counts;
* kept entries: per conversation at most the prompt checkpoint and the answer (the
  checkpoint only while the answer cannot rewind back to it), the system checkpoint shared;
* reuse: a regenerated answer and a follow-up turn reuse what mlx-lm's full caches reuse
  (``len(prompt) - 1`` and the whole stored answer), with the cache a fresh one fed the same
  calls would have;
* warm equals cold: a prompt that leaves a stored entry inside its last recorded call is
  served from the nearest point the cold run also passes (a call boundary of both), so its
  greedy tokens and cache are the cold run's; a second follow-up of the same turn continues
  from the turn (the chat loop's cache: the turn, then the follow-up's tokens);
* bounds: answers and checkpoints by count, all entries by bytes, at every insert, oldest first.
"""

import copy
import gc
import random
import sys

import mlx.core as mx
import mlx_lm.models.cache as cache_module
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.batch_helpers import config, tiny_llama
from helpers.trie_reference import radix_trie_bytes
from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.cache.journal import record_rows
from qfilters_mlx.commands.server_cache import prompt_cache_class
from qfilters_mlx.commands.server_calls import drops_prefix
from qfilters_mlx.commands.server_memory import stored_rows
from qfilters_mlx.commands.server_calls import PREFILL, prefill_segments

BUDGET, REWIND = 16, 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(0, 17))
def test_pieces_end_at_segment_ends_and_multiples_of_the_step(lengths, step):
    types = ["system", "user", "assistant", "user"][: len(lengths)]
    segments, start = [], 0
    for n in lengths:
        segments.append(list(range(start, start + n)))
        start += n
    pieces, kinds = prefill_segments(segments, types, step)
    assert sum(pieces, []) == list(range(start)) and all(pieces)
    ends = {sum(lengths[: i + 1]): types[i] for i in range(len(lengths))}
    cuts = set(range(step, start, step)) if step > 0 else set()
    expected = sorted(set(ends) | cuts)
    got, pos = [], 0
    for p in pieces:
        pos += len(p)
        got.append(pos)
    assert got == expected
    want = [ends.get(e, PREFILL) for e in expected]
    if len(pieces) > 1 and len(pieces[-1]) == 1 and want[-2] == PREFILL:
        want[-2] = want[-1]  # a one-token last piece: the checkpoint moves to where it starts
    assert kinds == want


@pytest.mark.parametrize("new_len,reach,old_type,old_len,own,dropped", [
    (50, 10, "user", 40, True, True),  # the answer rewinds back to its prompt
    (50, 9, "user", 40, True, False),  # one token short: the prompt checkpoint stays
    (50, 9, "assistant", 40, True, False),  # (a text completion's prompt checkpoint)
    (50, 0, "system", 10, False, False),  # never a system prompt's checkpoint
    (50, float("inf"), "system", 10, False, False),
    (90, 0, "assistant", 50, False, True),  # a follow-up turn drops the turn it extends
    (90, 0, "user", 40, False, True),
    (90, 60, "user", 40, False, True),
])
def test_which_prefixes_a_new_entry_drops(new_len, reach, old_type, old_len, own, dropped):
    assert drops_prefix(new_len, reach, old_type, old_len, own_prompt=own) is dropped


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 90) for _ in range(n)]


def _build(model, cfg, rewind=REWIND, bits=None):
    return KVCacheBuilder.for_model(model, cfg, max_rewind=rewind, kv_bits=bits,
                                    kv_group_size=None if bits is None else 32)


def _run(model, cfg, calls, decode=(), **build):
    """Caches fed ``calls`` (lists of token ids, one model call each), then ``decode`` one
    token per call."""
    caches = _build(model, cfg, **build)
    for c in [*calls, *([t] for t in decode)]:
        model(mx.array([c]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _same(a, b):
    """Same tokens seen, same kept positions; K/V and scores equal up to float32 rounding."""
    for x, y in zip(a, b):
        assert x.offset == y.offset and x.size() == y.size()
        assert mx.array_equal(x.kept_positions(), y.kept_positions()).item()
        sx, sy = x.state, y.state
        for u, v in zip(sx[:3], sy[:3]):
            assert mx.allclose(u, v, rtol=1e-5, atol=1e-4).item()


def _active():
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def _wide_llama():
    """A 2-layer float32 llama with head_dim 64 (2 KV heads): a K/V row is 1 KiB per layer,
    so the bytes of a cache dwarf the allocator's rounding of its small arrays."""
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=96, head_dim=64, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 3, model.parameters()))
    mx.eval(model.parameters())
    return model


WIDE = dict(qfilters_budget=64, qfilters_recent=16)


@pytest.mark.parametrize("case", ["slots", "chunk", "before-eviction", "quantized"])
def test_shrink_to_fit_keeps_outputs_and_holds_only_what_it_counts(case):
    """Every way a cache can be at rest: in slot mode after decode steps, right after a long
    multi-token call (its journal record holds the call's dropped rows), before any eviction
    (buffers in step blocks), quantized (no journal). After ``shrink_to_fit(REWIND)``: rows
    at most budget + 1 plus REWIND of journal; the process holds what ``nbytes`` counts (an
    unshrunk copy holds more: the control); the next calls give the outputs of the unshrunk
    cache; every rewind still in reach is exact."""
    model = _wide_llama()
    cfg = config(**WIDE)
    build = dict(rewind=0, bits=8) if case == "quantized" else {}
    toks = _tokens(900, 1)
    calls = {"slots": ([toks[:800]], toks[800:830]), "chunk": ([toks[:100], toks[100:900]], ()),
             "before-eviction": ([toks[:40]], toks[40:42]),
             "quantized": ([toks[:800]], toks[800:830])}[case]
    held = {}
    for shrink in (False, True):
        base = _active()
        copied = copy.deepcopy(_run(model, cfg, *calls, **build))  # (the original is dropped)
        if shrink:
            for c in copied:
                c.shrink_to_fit(REWIND)
        held[shrink] = _active() - base  # what the process holds for the copy
        if not shrink:
            del copied
    counted = sum(c.nbytes for c in copied)
    assert abs(held[True] - counted) <= 0.05 * counted + 16384, (held, counted)  # (other tests)
    if case in ("slots", "chunk"):
        assert held[False] > 1.5 * counted  # (the control: views of larger buffers, a journal)
    reference = _run(model, cfg, *calls, **build)  # the unshrunk cache, rebuilt
    rows = stored_rows(copied)
    assert rows <= 64 + 1 + REWIND, rows
    assert all(sum(record_rows(r) for r in c._journal.records) <= REWIND for c in copied)
    reach = min(c.rewindable_tokens for c in copied)
    assert reach <= min(c.rewindable_tokens for c in reference)
    for n in sorted({0, min(1, reach), reach}):
        a, b = copy.deepcopy(copied), copy.deepcopy(reference)
        assert all(c.trim(n) == n for c in a) and all(c.trim(n) == n for c in b)
        x = mx.array([_tokens(3, 7 + n)])
        assert mx.allclose(model(x, cache=a), model(x, cache=b), atol=1e-4).item()
        for t in _tokens(6, 9):
            assert mx.allclose(model(mx.array([[t]]), cache=a), model(mx.array([[t]]), cache=b),
                               atol=1e-4).item()
        _same(a, b)


def test_packed_decode_steps_rewind_as_the_journal_of_single_steps():
    """At rest a journal's run of decode steps is one record of stacked arrays (five per run,
    not five per step); a cache that decodes on after it, a second shrink that cuts the run
    from its oldest end, and every rewind in reach give the unshrunk cache's kept rows,
    K/V, scores and next outputs (the journal of single steps: the reference)."""
    from qfilters_mlx.cache.journal import StepRecord
    from qfilters_mlx.cache.journal_runs import StepRun

    model = _wide_llama()
    cfg = config(**WIDE)
    toks = _tokens(860, 3)
    build = dict(rewind=40)  # (a quantized cache has no journal)
    reference = _run(model, cfg, [toks[:800]], toks[800:830], **build)
    packed = copy.deepcopy(reference)
    for c in packed:
        c.shrink_to_fit(24)
        assert [type(r) for r in c._journal.records] == [StepRun] and c._journal.tokens == 24
        assert len(c._journal.arrays()) == 5
    steps = [r for r in reference[0]._journal.records if isinstance(r, StepRecord)]
    assert len(steps) >= 24
    for later in toks[830:833]:  # decode on: single steps after the run
        for caches in (packed, reference):
            model(mx.array([[later]]), cache=caches)
    assert [type(r) for r in packed[0]._journal.records] == [StepRun] + [StepRecord] * 3
    cut = copy.deepcopy(packed)
    for c in cut:
        c.shrink_to_fit(10)  # (the run loses its oldest steps)
        assert c._journal.tokens == 10 and c._journal.rows == 10
    for caches, reach in ((packed, 27), (cut, 10)):
        assert min(c.rewindable_tokens for c in caches) == reach
        for n in range(reach + 1):
            a, b = copy.deepcopy(caches), copy.deepcopy(reference)
            assert all(c.trim(n) == n for c in a) and all(c.trim(n) == n for c in b)
            _same(a, b)
            x = mx.array([[toks[840 + n % 10]]])
            assert mx.allclose(model(x, cache=a), model(x, cache=b), atol=1e-4).item()


def _store(max_size=10, max_bytes=None):
    return prompt_cache_class(cache_module)(max_size, max_bytes)


def _serve(store, model, cfg, prompt, answer_tokens, sys_end=0, fresh=None, turn=None):
    """What the server's batch loop does for one chat request: reuse the nearest stored
    entry, feed the rest (segments: system prompt, prompt but its last token, in one call
    each; that one cut where the last user turn's text starts, ``turn``), store the
    checkpoints, decode ``answer_tokens`` tokens and store the answer (``fresh``: builds the
    caches of a request with nothing reused; default: ours). Returns (tokens reused, the
    answer's tokens)."""
    turn = turn or sys_end
    if hasattr(store, "expect_calls"):
        store.expect_calls(prompt, [sys_end, turn, len(prompt) - 1])
    cache, rest = store.fetch_nearest_cache("m", prompt)
    reused = len(prompt) - len(rest)
    caches = cache if cache is not None else (fresh or (lambda: _build(model, cfg)))()
    segments = [(prompt[:sys_end], "system"), (prompt[sys_end:turn], PREFILL),
                (prompt[turn:-1], "user")]
    done = 0
    for seg, kind in segments:
        lo, hi = done, done + len(seg)
        done = hi
        if hi <= reused or not seg:
            continue
        model(mx.array([prompt[max(lo, reused):hi]]), cache=caches)
        if kind != PREFILL:  # (never stored: ours ignores them, mlx-lm's has no such type)
            store.insert_cache("m", prompt[:hi], copy.deepcopy(caches), cache_type=kind)
    y, out = prompt[-1], []
    for _ in range(answer_tokens):
        logits = model(mx.array([[y]]), cache=caches)[0, -1]
        y = int(mx.argmax(logits).item())
        out.append(y)
    # (mlx-lm's batch has fed the last sampled token too when it stores the answer)
    model(mx.array([[y]]), cache=caches)
    store.insert_cache("m", prompt + out, copy.deepcopy(caches), cache_type="assistant")
    return reused, out


@pytest.mark.parametrize("answer", [4, 12])
def test_a_conversation_holds_a_checkpoint_and_its_answer_at_most(answer):
    """Short answers (within the rewind depth): one entry per conversation besides the shared
    system prompt; long answers: the prompt checkpoint stays for a regenerated answer. A
    follow-up turn replaces the turn it extends. Every entry within budget + 1 + REWIND rows."""
    model = tiny_llama()
    cfg = config()
    store = _store()
    system = _tokens(6, 0)
    for i in range(3):
        _serve(store, model, cfg, system + _tokens(40, 10 + i), answer, sys_end=6)
    st_ = store.stored_stats()
    assert st_["conversations"] == 3
    assert st_["checkpoints"] == 1 + (3 if answer + 1 > REWIND else 0)
    for m, t in store._lru.keys():
        assert stored_rows(store._trie.get(m, t).prompt_cache) <= BUDGET + 1 + REWIND
    per_entry = max(sum(c.nbytes for c in store._trie.get(m, t).prompt_cache) for m, t in store._lru.keys())
    assert st_["bytes"] - st_["index_bytes"] <= 3 * (2 if answer + 1 > REWIND else 1) * per_entry + per_entry
    keys = [t for _, t in store._lru.keys()]
    trie = radix_trie_bytes(keys)  # (the radix trie of these keys, counted apart)
    index = trie + sum(sys.getsizeof(bytes(4 * len(t))) for t in keys)
    assert st_["index_bytes"] == index and st_["bytes"] == store._n_bytes + trie
    # a follow-up turn of the first conversation: its older entries go
    first = system + _tokens(40, 10)
    _, out = _serve(store, model, cfg, first, answer, sys_end=6)
    follow = first + out + _tokens(30, 99)
    reused, _ = _serve(store, model, cfg, follow, answer, sys_end=6)
    assert reused == len(first) + len(out)  # the whole stored answer (a prefix of the turn)
    assert store.stored_stats()["conversations"] == 3


@pytest.mark.parametrize("answer", [4, 12])
def test_regenerated_answers_follow_ups_and_shared_system_prompts_reuse_like_a_full_cache(answer):
    """The reuse mlx-lm's full caches get (``min(len(prompt) - 1, shared)``) for a regenerated
    answer, a follow-up turn and a new conversation under a system prompt (``sys_end`` tokens)
    that a second conversation computed before it (a system prompt's checkpoint is stored
    once a second request repeats it), with the cache of a fresh run fed the same calls."""
    model = tiny_llama()
    cfg = config()
    store = _store()
    system = _tokens(6, 0)
    prompt = system + _tokens(40, 1)
    _serve(store, model, cfg, prompt, answer, sys_end=6)
    cache, rest = store.fetch_nearest_cache("m", prompt)  # the same prompt again
    assert len(rest) == 1
    _same(cache, _run(model, cfg, [prompt[:6], prompt[6:-1]]))
    _, out = _serve(store, model, cfg, prompt, answer, sys_end=6)
    follow = prompt + out + _tokens(20, 2)
    cache, rest = store.fetch_nearest_cache("m", follow)
    assert len(follow) - len(rest) == len(prompt) + len(out)
    # the system prompt's checkpoint is stored once a second request computes it
    other = system + _tokens(30, 3)
    assert _serve(store, model, cfg, other, answer, sys_end=6)[0] == 0
    third = system + _tokens(30, 4)
    cache, rest = store.fetch_nearest_cache("m", third)
    assert len(third) - len(rest) == 6
    _same(cache, _run(model, cfg, [system]))


def test_stored_bytes_are_bounded_at_every_insert_oldest_first():
    model = tiny_llama()
    cfg = config()
    one = _store()
    _serve(one, model, cfg, _tokens(40, 0), 4)
    entry = one.nbytes
    store = _store(max_size=100, max_bytes=int(2.5 * entry))
    prompts = [_tokens(40, 20 + i) for i in range(5)]
    for p in prompts:
        _serve(store, model, cfg, p, 4)
        assert store.nbytes <= 2.5 * entry
    assert store.stored_stats()["conversations"] == 2
    for p, kept in zip(prompts, [False, False, False, True, True]):
        _, rest = store.fetch_nearest_cache("m", p + [0])
        assert (len(rest) < len(p)) == kept


def _entry(store, tokens):
    return store._trie.get("m", tokens).prompt_cache


def _differs(a, b) -> bool:
    """Kept positions, K/V or scores of some layer differ beyond float32 rounding."""
    for x, y in zip(a, b):
        if x.offset != y.offset or not mx.array_equal(x.kept_positions(), y.kept_positions()).item():
            return True
        if any(not mx.allclose(u, v, rtol=1e-5, atol=1e-4).item() for u, v in zip(x.state[:3], y.state[:3])):
            return True
    return False


@pytest.mark.parametrize("edit_at,answer", [(2, 4), (3, 5), (5, 2)])
def test_an_edited_prompt_gets_the_cold_runs_greedy_tokens_and_cache(edit_at, answer):
    """A prompt longer than the budget, answered; then the same prompt with its last
    ``edit_at`` tokens edited: it diverges within the stored answer's rewind reach, inside the
    recorded call that prefilled the prompt. Served warm it gets the cold run's greedy tokens
    and cache (from the system checkpoint: the nearest point both runs pass). The control:
    the rewind that ends inside the recorded call (what the store did before) re-applies the
    call's head as one evicting call and gives another cache than the cold run's."""
    model = tiny_llama()
    cfg = config()
    system = _tokens(6, 0)
    prompt = system + _tokens(40, 1)
    edited = prompt[:-edit_at] + [prompt[-edit_at] % 89 + 1] + _tokens(edit_at - 1, 77)
    split = len(prompt) - edit_at
    deep = dict(sys_end=6, fresh=lambda: _build(model, cfg, rewind=64))  # (the call is journaled)
    warm = _store()
    _, out = _serve(warm, model, cfg, prompt, answer, **deep)
    stored = copy.deepcopy(_entry(warm, prompt + out))
    need = len(prompt) + len(out) - split
    assert 0 < need <= min(c.rewindable_tokens for c in stored)  # (the store could rewind there)
    reused, out_warm = _serve(warm, model, cfg, edited, 8, **deep)
    cold = _store()
    _, out_cold = _serve(cold, model, cfg, edited, 8, **deep)
    assert reused == 6, reused
    assert out_warm == out_cold
    _same(_entry(warm, edited + out_warm), _entry(cold, edited + out_cold))
    assert all(c.trim(need) == need for c in stored)  # the control
    model(mx.array([edited[split:-1]]), cache=stored)
    assert _differs(stored, _run(model, cfg, [edited[:6], edited[6:-1]], rewind=64))


def test_a_second_follow_up_of_the_same_turn_reuses_what_mlx_lm_reuses():
    """Two follow-ups of one turn sent one after the other: each is the turn, two tokens of the
    template's header of the next user turn, then its own text (the first tokens differ; the
    first follow-up's own tokens are within the rewind depth). mlx-lm (its ``LRUPromptCache``
    with full caches, run here) reuses for the second its longest common prefix with a stored
    entry: the turn and the header. Ours reuses the same: the first follow-up's stored entry
    rewound to the call boundary where its text starts (a boundary of the second's cold run
    too), and the cache is the chat loop's with one cache over the turns (the turn, then the
    second follow-up's header and text)."""
    model = tiny_llama()
    cfg = config()
    system = _tokens(6, 0)
    prompt = system + _tokens(40, 1)
    follow = (_tokens(6, 5), _tokens(6, 6))
    assert follow[0][0] != follow[1][0]
    reused, answers, stores = {}, {}, {}
    for name, store, fresh in (("ours", _store(), lambda: _build(model, cfg, rewind=64)),
                               ("mlx_lm", cache_module.LRUPromptCache(10),
                                lambda: cache_module.make_prompt_cache(model))):
        _, out = _serve(store, model, cfg, prompt, 4, sys_end=6, fresh=fresh)
        turn = prompt + out
        first, _ = _serve(store, model, cfg, turn + [50, 51] + follow[0], 4, sys_end=6, fresh=fresh,
                          turn=len(turn) + 2)
        assert first == len(turn)
        reused[name], answers[name] = _serve(store, model, cfg, turn + [50, 51] + follow[1], 4,
                                             sys_end=6, fresh=fresh, turn=len(turn) + 2)
        stores[name] = (store, out)
    store, out = stores["ours"]
    turn = prompt + out
    assert reused["mlx_lm"] == len(prompt + stores["mlx_lm"][1]) + 2
    assert reused["ours"] == reused["mlx_lm"] == len(turn) + 2
    last = turn + [50, 51] + follow[1]
    chat = _run(model, cfg, [prompt[:6], prompt[6:-1]], decode=[prompt[-1], *out], rewind=64)
    model(mx.array([last[len(turn):len(turn) + 2]]), cache=chat)
    model(mx.array([last[len(turn) + 2:-1]]), cache=chat)
    for t in [last[-1], *answers["ours"]]:
        model(mx.array([[t]]), cache=chat)
    _same(_entry(store, last + answers["ours"]), chat)


def test_a_continued_conversation_is_the_chat_loop_with_one_cache_over_the_turns():
    """Three turns, each a follow-up of the stored answer before it (the template's two header
    tokens of a user turn, then its text): every answer and stored cache is the chat loop's
    (``docs/getting-started.md``: one cache; each turn feeds its new tokens but the last, here
    the header and the text in a call each, then decodes), and each turn reuses the whole turn
    before it."""
    model = tiny_llama()
    cfg = config()
    store = _store()
    chat = _build(model, cfg)
    tokens, fed = _tokens(30, 1), 0
    for turn in range(3):
        start = fed + 2 if fed else 0
        reused, out = _serve(store, model, cfg, tokens, 5, sys_end=0, turn=start)
        assert reused == fed
        for a, b in ((fed, start), (start, len(tokens) - 1)):
            if b > a:
                model(mx.array([tokens[a:b]]), cache=chat)
        y, loop = tokens[-1], []
        for _ in range(5):
            y = int(mx.argmax(model(mx.array([[y]]), cache=chat)[0, -1]).item())
            loop.append(y)
        model(mx.array([[y]]), cache=chat)
        assert out == loop
        _same(_entry(store, tokens + out), chat)
        tokens, fed = tokens + out + [50, 51] + _tokens(12, 10 + turn), len(tokens) + len(out)


@pytest.mark.parametrize("answer,checkpoint_stays", [(12, False), (30, True)])
def test_an_answer_keeps_its_decode_steps_instead_of_its_checkpoint_when_they_are_fewer_rows(
        answer, checkpoint_stays):
    """Caches journaling ``budget + 1`` tokens while they generate (the server's default), a
    stored checkpoint keeping REWIND rows: an answer whose decode steps (one row each) back to
    its prompt are fewer rows than the prompt checkpoint keeps them and the checkpoint goes;
    the regenerated answer is then served by rewinding the steps, to the cache of a fresh run
    fed the same calls. A longer answer (its steps are no longer journaled) leaves the
    checkpoint stored. The first system prompt is not stored (no second request repeated it)."""
    model = tiny_llama()
    cfg = config()
    store = prompt_cache_class(cache_module, REWIND)()
    deep = lambda: _build(model, cfg, rewind=BUDGET + 1)  # noqa: E731
    prompt = _tokens(6, 0) + _tokens(40, 1)
    _, out = _serve(store, model, cfg, prompt, answer, sys_end=6, fresh=deep)
    st_ = store.stored_stats()
    assert (st_["conversations"], st_["checkpoints"]) == (1, 1 if checkpoint_stays else 0)
    entry = _entry(store, prompt + out)
    journal = max(sum(record_rows(r) for r in c._journal.records) for c in entry)
    # (answer + 1 steps: one row each but the step that entered slot mode, which keeps the
    # score and position buffers before it; an answer replacing its checkpoint also keeps what
    # the checkpoint's journal would: here none, the prompt's call dropped more rows than REWIND)
    assert journal == (REWIND if checkpoint_stays else answer)
    cache, rest = store.fetch_nearest_cache("m", prompt)  # the same prompt again
    assert len(rest) == 1
    _same(cache, _run(model, cfg, [prompt[:6], prompt[6:-1]], rewind=BUDGET + 1))


def test_a_system_prompt_is_stored_once_a_second_request_repeats_it_whatever_follows_it():
    """mlx-lm ends a system prompt's segment where the rendering with an empty user message
    departs from the prompt, so two conversations under one system prompt may end it a token
    apart (the first user token merging with the template's newline): the second still counts
    as a repeat and is stored; an unrelated system prompt is not."""
    model = tiny_llama()
    cfg = config()
    store = _store()
    system = _tokens(12, 0)

    def insert(tokens):
        caches = _build(model, cfg)
        model(mx.array([tokens]), cache=caches)
        store.insert_cache("m", tokens, caches, cache_type="system")
        return store.stored_stats()["checkpoints"]

    assert insert(system + [7]) == 0  # the first: remembered, not stored
    assert insert(_tokens(13, 5)) == 0  # another system prompt, first time
    assert insert(system + [8, 9]) == 1  # the same system prompt, ended a token later


def test_a_finished_request_returns_mlxs_pool_of_freed_buffers():
    """The resident memory a conversation leaves is what is stored: once a finished request's
    answer is stored, MLX's cache of freed buffers (its temporaries) is empty."""
    model = _wide_llama()
    store = _store()
    caches = _run(model, config(**WIDE), [_tokens(300, 3)], decode=_tokens(3, 4))
    assert mx.get_cache_memory() > 0  # (the prefill's temporaries, pooled)
    store.finishing = True
    store.insert_cache("m", _tokens(303, 5), caches)
    assert mx.get_cache_memory() == 0


def test_a_second_follow_up_reaches_the_turn_when_the_first_ones_answer_replaced_its_checkpoint():
    """The first follow-up's answer (12 tokens: longer than the REWIND rows a checkpoint keeps,
    shorter than the budget + 1 the caches journal while generating) replaces its checkpoint;
    it keeps the checkpoint's journal too, so the second follow-up still reaches the turn and
    its header, as mlx-lm's full caches do."""
    model = tiny_llama()
    cfg = config()
    store = prompt_cache_class(cache_module, REWIND)()
    deep = lambda: _build(model, cfg, rewind=BUDGET + 1)  # noqa: E731
    prompt = _tokens(6, 0) + _tokens(40, 1)
    _, out = _serve(store, model, cfg, prompt, 4, sys_end=6, fresh=deep)
    turn = prompt + out
    first, _ = _serve(store, model, cfg, turn + [50, 51] + _tokens(4, 5), 12, sys_end=6, fresh=deep,
                      turn=len(turn) + 2)
    assert first == len(turn) and store.stored_stats()["checkpoints"] == 0  # (replaced)
    second, _ = _serve(store, model, cfg, turn + [50, 51] + _tokens(4, 6), 4, sys_end=6, fresh=deep,
                       turn=len(turn) + 2)
    assert second == len(turn) + 2


@pytest.mark.parametrize("answer", [4, 12])
def test_an_answer_the_conversation_moved_past_is_dropped_a_branch_stays(answer):
    """A client that re-sends the last answer with other tokens (re-tokenized text) continues
    the conversation past the stored answer, which no later prompt extends: once the new answer
    is stored (and rewinds back into its prompt) the old one goes, so a conversation keeps one
    answer. Two follow-ups of one turn are two branches: both answers stay."""
    model = tiny_llama()
    cfg = config()
    store = _store()
    prompt = _tokens(40, 1)
    _, out = _serve(store, model, cfg, prompt, answer)
    assert store.stored_stats()["conversations"] == 1
    resent = prompt + out[:-2] + [(out[-2] + 1) % 90, (out[-1] + 1) % 90] + _tokens(20, 2)
    reused, out2 = _serve(store, model, cfg, resent, answer, turn=len(prompt) + len(out))
    assert reused == len(prompt) - 1  # (the old answer rewound to a boundary the cold run has)
    keys = [t for _, t in store._lru.keys()]
    assert prompt + out not in keys and resent + out2 in keys
    assert store.stored_stats()["conversations"] == 1
    # two follow-ups of the new turn: two branches, both kept
    turn = resent + out2
    _serve(store, model, cfg, turn + _tokens(12, 3), answer, turn=len(turn))
    _serve(store, model, cfg, turn + _tokens(12, 4), answer, turn=len(turn))
    assert store.stored_stats()["conversations"] == 2


def test_a_second_branch_stands_in_for_the_first_and_serves_its_continuation_from_the_turn():
    """Two follow-ups of one turn: the second's answer keeps the journal rows back to the turn's
    end (fewer than the first's answer holds) and the first's answer goes (one answer per
    conversation); a continuation of the first branch is served from the turn's end, with the
    cold run's cache; a third follow-up reuses the turn and the header, as mlx-lm would."""
    model = tiny_llama()
    cfg = config()
    store = _store()
    fresh = lambda: _build(model, cfg, rewind=64)  # noqa: E731 (the server's journal depth)
    prompt = _tokens(6, 0) + _tokens(40, 1)
    _, out = _serve(store, model, cfg, prompt, 4, sys_end=6, fresh=fresh)
    turn = prompt + out
    a = turn + [50, 51] + _tokens(6, 5)
    _, out_a = _serve(store, model, cfg, a, 4, sys_end=6, fresh=fresh, turn=len(turn) + 2)
    b = turn + [50, 51] + _tokens(6, 6)
    reused, out_b = _serve(store, model, cfg, b, 4, sys_end=6, fresh=fresh, turn=len(turn) + 2)
    assert reused == len(turn) + 2
    keys = [t for _, t in store._lru.keys()]
    assert a + out_a not in keys and b + out_b in keys
    assert store.stored_stats()["conversations"] == 1
    more = a + out_a + [50, 51] + _tokens(5, 7)
    cache, rest = store.fetch_nearest_cache("m", more)
    assert len(more) - len(rest) == len(turn)
    _same(cache, _run(model, cfg, [prompt[:6], prompt[6:-1]], decode=[prompt[-1], *out], rewind=64))
    c = turn + [50, 51] + _tokens(6, 8)
    store.expect_calls(c, [6, len(turn) + 2, len(c) - 1])  # (the server announces the calls)
    cache, rest = store.fetch_nearest_cache("m", c)
    assert len(c) - len(rest) == len(turn) + 2
