"""Head groups stored at their own sizes (``HeadBudgets`` -> ``HeadGroupsKVCache``).

Oracle: mlx-lm's full ``KVCache`` with each layer's attention routed through a numpy-built
mask that lets KV head ``h`` see only the positions the independent cache model
(``helpers.cache_model.model_keep``) keeps at that head's own budget and window, from
Q-Filters scores computed in numpy; the new tokens of a call are always seen (causal).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from helpers.cache_model import model_keep, model_scores
from helpers.query_models import tiny_llama
from qfilters_mlx import HeadBudgets, HeadGroupsKVCache, KVCacheBuilder, KVCacheConfig
from qfilters_mlx.cache.head_groups import GroupedKV
from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache
from qfilters_mlx.config import CompressOnce
from qfilters_mlx.filters.attention_route import route_attention

ROOT = Path(__file__).resolve().parents[2]
LAYERS, KV, HEADS, D = 2, 3, 9, 16
N_SINK = 2
PROMPT, STEPS = 40, 24
# layer 0: three budgets (three groups, heads out of order for group 2 = {0, 2}? no: by budget)
BUDGETS = ((40, 12, 12), (12, 20, 12))
RECENTS = ((4, 4, 6), (4, 4, 3))


def _model():
    return tiny_llama(layers=LAYERS, kv=KV, heads=HEADS)


def _filters():
    mx.random.seed(3)
    return mx.random.normal((LAYERS, KV, D))


def _config(**kw):
    base = dict(qfilters_budget=16, qfilters_n_sink=N_SINK, qfilters_recent=4, qfilters_filters=_filters())
    base.update(kw)
    return KVCacheConfig(**base)


def _tokens(n=PROMPT + STEPS, seed=5):
    mx.random.seed(seed)
    return mx.random.randint(0, 101, (1, n))


def _run(model, caches, toks, prompt=PROMPT):
    """Last-position logits of a prefill of ``prompt`` tokens, then one per decode step."""
    out = [model(toks[:, :prompt], cache=caches)[:, -1]]
    for t in range(prompt, toks.shape[1]):
        out.append(model(toks[:, t:t + 1], cache=caches)[:, -1])
    return mx.stack(out)


def _oracle(model, toks, budgets, recents, filters, prompt=PROMPT):
    """The same run on full caches, head ``h`` of layer ``l`` attending only to what the
    numpy cache model keeps at ``budgets[l][h]`` / ``recents[l][h]`` before each call."""
    f = np.array(filters)

    class Full(KVCache):
        pass

    caches = [Full() for _ in range(LAYERS)]
    for i, c in enumerate(caches):
        c.layer = i

    def attend(q, k, v, cache, scale, mask, sinks):
        B, Hq, L, _ = q.shape
        T = k.shape[2]
        keys = np.array(k.astype(mx.float32))
        allowed = np.zeros((KV, L, T), bool)
        for h in range(KV):
            stored = T - L
            seen = model_keep(model_scores("qfilters", keys[:, h:h + 1, :stored], f[cache.layer][h:h + 1], 1)[0, 0],
                              budgets[cache.layer][h], N_SINK, recents[cache.layer][h]) if stored else []
            allowed[h][:, list(seen)] = True
            allowed[h][:, stored:] = np.tril(np.ones((L, L), bool))
        m = mx.array(np.repeat(allowed, Hq // KV, axis=0))[None]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)

    with route_attention(Full, attend):
        return _run(model, caches, toks, prompt)


def _grouped(model, **build):
    return KVCacheBuilder.for_model(model, _config(), heads=HeadBudgets(BUDGETS, RECENTS), **build)


def test_layout_of_groups():
    caches = _grouped(_model())
    assert all(isinstance(c, HeadGroupsKVCache) for c in caches)
    assert caches[0].heads == ((0,), (1, 2)) and caches[1].heads == ((0, 2), (1,))
    assert [g.config.qfilters_budget for g in caches[1].caches] == [12, 20]
    assert caches[1].caches[0].recent_window == (4, 3)


def test_equal_budgets_identical_to_one_budget_cache():
    model, toks = _model(), _tokens()
    one = _run(model, KVCacheBuilder.for_model(model, _config()), toks)
    uniform = HeadBudgets.uniform(LAYERS, KV, 16, 4)
    caches = KVCacheBuilder.for_model(model, _config(), heads=uniform)
    assert not any(isinstance(c, HeadGroupsKVCache) for c in caches)
    assert mx.array_equal(one, _run(model, caches, toks)).item()
    # the same budget forced into groups (heads 0 and 2 together, out of order): the same logits
    from qfilters_mlx.cache.head_group_build import layer_cache
    from qfilters_mlx.cache.kv_cache import build_cache
    from qfilters_mlx.config import HeadGroup

    groups = (HeadGroup((0, 2), 16, (4, 4)), HeadGroup((1,), 16, (4,)))
    cfg = _config().with_head_dim(D)
    forced = [layer_cache(cfg, groups, i, _filters()[i], lambda gc, gf, _i=i: build_cache(gc, _i, gf))
              for i in range(LAYERS)]
    assert all(isinstance(c, HeadGroupsKVCache) for c in forced)
    assert mx.array_equal(one, _run(model, forced, toks)).item()


def test_groups_match_the_per_head_oracle():
    model, toks = _model(), _tokens()
    got = _run(model, _grouped(model), toks)
    want = _oracle(model, toks, BUDGETS, RECENTS, _filters())
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_bytes_held_are_the_sum_of_the_group_budgets():
    model, toks = _model(), _tokens()
    caches = _grouped(model)
    _run(model, caches, toks)
    for layer, c in enumerate(caches):
        kept = sum(b * D * 2 * 4 for b in BUDGETS[layer])  # K and V, float32, batch 1
        assert c.kept_kv_bytes == kept
        assert [g.size() for g in c.caches] == [g.budget for g in HeadBudgets(BUDGETS, RECENTS).groups(layer)]
        # every array held: K/V slots (budget + 1 in slot mode), scores, positions, filter
        slots = sum(b + 1 for b in BUDGETS[layer])
        assert c.nbytes == slots * (D * 2 * 4 + 4 + 8) + KV * D * 4


def test_command_summary_counts_group_layers():
    """``generate``'s summary (kept tokens, bytes, eviction) sees head-group layers as eviction
    caches: their kept K/V is the sum of their budgets, their full-cache bytes every token's."""
    from qfilters_mlx.cache.build_report import eviction_caches
    from qfilters_mlx.commands.summary import cache_summary

    model, toks = _model(), _tokens()
    caches = _grouped(model)
    _run(model, caches, toks)
    assert eviction_caches(caches) == list(caches)
    s = cache_summary(caches)
    row = D * 2 * 4  # one token's K and V at one KV head, float32
    kv = sum(b for layer in BUDGETS for b in layer) * row
    assert s["layers"] == LAYERS and s["tokens_seen"] == PROMPT + STEPS and s["evicted"]
    assert s["kept_tokens"] == max(max(layer) for layer in BUDGETS)
    assert s["full_bytes"] == LAYERS * KV * (PROMPT + STEPS) * row
    assert s["kept_bytes"] == sum(c.qfilters_kept_bytes for c in caches) and s["kept_bytes"] >= kv
    assert s["kept_bytes"] - kv == sum(g.qfilters_kept_bytes - g.kept_kv_bytes for c in caches for g in c.caches)


def test_process_memory_follows_the_group_budgets():
    """``mx.get_active_memory()`` grows by what the caches report, and a layout holding half
    the tokens of a one-budget cache holds about half the bytes."""
    H, Dm, layers = 8, 64, 8
    big = HeadBudgets(((512,) * 2 + (64,) * 6,) * layers, ((32,) * H,) * layers)
    feed = mx.random.normal((1, H, 1024, Dm))
    f = mx.random.normal((H, Dm))
    mx.eval(feed, f)

    def held(heads):
        from qfilters_mlx.cache.head_group_build import layer_cache
        from qfilters_mlx.cache.kv_cache import build_cache

        cfg = KVCacheConfig(qfilters_budget=256, qfilters_n_sink=4, qfilters_recent=32,
                            qfilters_filters=mx.zeros((layers, H, Dm)), head_dim=Dm)
        before = mx.get_active_memory()
        caches = []
        for i in range(layers):
            if heads is None:
                c = build_cache(cfg, i, f)
            else:
                c = layer_cache(cfg, heads.groups(i), i, f, lambda gc, gf, _i=i: build_cache(gc, _i, gf))
            out = c.update_and_fetch(feed, feed)
            del out
            c.shrink_to_fit()
            caches.append(c)
        mx.eval([a for c in caches for a in (c.caches if isinstance(c, HeadGroupsKVCache) else [c])
                 for a in a.rows if a is not None])
        return mx.get_active_memory() - before, sum(c.nbytes for c in caches), caches

    grown, reported, _ = held(big)
    assert reported == layers * ((2 * 512 + 6 * 64) * (Dm * 2 * 4 + 12) + H * Dm * 4)
    assert reported <= grown <= reported * 1.1 + (1 << 20), (grown, reported)
    grown_one, reported_one, _ = held(None)
    # one budget of 256 for every head holds 8 * 256 tokens a layer; the groups 2 * 512 + 6 * 64
    assert reported / reported_one == pytest.approx((2 * 512 + 6 * 64) / (8 * 256), rel=0.02)
    assert grown / grown_one == pytest.approx(reported / reported_one, rel=0.1)


def _saved(tmp_path, fed):
    """``(model, tokens, caches, path)``: grouped caches fed ``fed`` tokens, saved by mlx-lm."""
    model, toks = _model(), _tokens()
    caches = _grouped(model)
    _run(model, caches, toks[:, :fed])
    path = tmp_path / "groups.safetensors"
    save_prompt_cache(str(path), caches)
    return model, toks, caches, path


def test_save_load_continues_exactly(tmp_path):
    model, toks, caches, path = _saved(tmp_path, PROMPT + 8)
    loaded = load_prompt_cache(str(path))
    assert [type(c).__name__ for c in loaded] == ["HeadGroupsKVCache"] * LAYERS
    rest = toks[:, PROMPT + 8:]
    a = [model(rest[:, i:i + 1], cache=caches) for i in range(rest.shape[1])]
    b = [model(rest[:, i:i + 1], cache=loaded) for i in range(rest.shape[1])]
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def test_load_in_a_fresh_process_with_mlx_lm_only(tmp_path):
    _, _, caches, path = _saved(tmp_path, PROMPT + 4)
    code = ("from mlx_lm.models.cache import load_prompt_cache; import sys; "
            "c = load_prompt_cache(sys.argv[1]); "
            "print([type(x).__name__ for x in c], [x.offset for x in c], "
            "[[g.size() for g in x.caches] for x in c])")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         check=True).stdout.strip()
    sizes = [[g.size() for g in c.caches] for c in caches]
    assert out == f"{['HeadGroupsKVCache'] * LAYERS} {[PROMPT + 4] * LAYERS} {sizes}"


def test_bad_saved_state_is_refused_before_anything_changes():
    model, toks = _model(), _tokens()
    caches = _grouped(model)
    _run(model, caches, toks[:, :PROMPT])
    c = caches[0]
    good = c.state
    twin = copy.deepcopy(c)
    for bad in ([good[0].replace('"format": 2', '"format": 3'), *good[1:]],
                [good[0].replace("QFiltersKVCache", "KVCache"), *good[1:]],
                [good[0], good[1]], "text", [good[0]]):
        with pytest.raises(ValueError):
            c.state = bad
        assert c.heads == twin.heads and c.offset == twin.offset
        assert all(mx.array_equal(a.rows.keys, b.rows.keys).item() for a, b in zip(c.caches, twin.caches))


def test_trim_rewinds_every_group_exactly():
    model, toks = _model(), _tokens()
    caches = _grouped(model, max_rewind=8)
    ref = _run(model, _grouped(model, max_rewind=8), toks)
    _run(model, caches, toks[:, :PROMPT + 10])
    assert all(c.is_trimmable() for c in caches)
    assert [c.trim(6) for c in caches] == [6] * LAYERS
    again = [model(toks[:, t:t + 1], cache=caches)[:, -1] for t in range(PROMPT + 4, toks.shape[1])]
    np.testing.assert_array_equal(np.array(mx.stack(again)), np.array(ref[5:]))
    with pytest.raises(ValueError):
        caches[0].trim(100)  # deeper than the journal: refused, nothing changes
    assert caches[0].offset == toks.shape[1]


def test_generate_step_runs_on_the_groups():
    """mlx-lm's ``generate_step`` (under ``generate`` / ``stream_generate``) gives the greedy
    tokens of the same calls made by hand."""
    from mlx_lm.generate import generate_step

    model, toks = _model(), _tokens()
    caches = _grouped(model)
    greedy = []
    for tok, _ in generate_step(toks[0, :PROMPT], model, max_tokens=10, prompt_cache=caches):
        greedy.append(int(tok))
    oracle_caches = _grouped(model)
    model(toks[:, :PROMPT - 1], cache=oracle_caches)  # (mlx-lm feeds the last prompt token apart)
    logits = model(toks[:, PROMPT - 1:PROMPT], cache=oracle_caches)[:, -1]
    want = []
    for _ in range(10):
        t = int(mx.argmax(logits, axis=-1).item())
        want.append(t)
        logits = model(mx.array([[t]]), cache=oracle_caches)[:, -1]
    assert greedy == want


def test_kv_bits_quantizes_every_group():
    model, toks = tiny_llama(layers=LAYERS, kv=KV, heads=HEADS, hidden=288), _tokens()  # (D 32)
    cfg = _config(qfilters_filters=mx.random.normal((LAYERS, KV, 32)))
    caches = KVCacheBuilder.for_model(model, cfg, heads=HeadBudgets(BUDGETS, RECENTS))
    _run(model, caches, toks[:, :PROMPT])
    q = [c.to_quantized(group_size=32, bits=8) for c in caches]
    assert all(isinstance(g, QuantizedQFiltersKVCache) for c in q for g in c.caches)
    assert [[g.size() for g in c.caches] for c in q] == [[g.size() for g in c.caches] for c in caches]
    dense = [model(toks[:, t:t + 1], cache=caches)[:, -1] for t in range(PROMPT, PROMPT + 6)]
    quant = [model(toks[:, t:t + 1], cache=q)[:, -1] for t in range(PROMPT, PROMPT + 6)]
    np.testing.assert_allclose(np.array(mx.stack(quant)), np.array(mx.stack(dense)), atol=0.05)


def test_heads_slice_is_numpy_slicing_of_every_layer():
    hb = HeadBudgets(BUDGETS, RECENTS)
    b, r = np.array(BUDGETS), np.array(RECENTS)
    for start in range(KV):
        for n in range(1, KV - start + 1):
            part = hb.heads_slice(start, n)
            assert np.array_equal(np.array(part.budgets), b[:, start:start + n])
            assert np.array_equal(np.array(part.recents), r[:, start:start + n])
    for start, n in ((0, 0), (-1, 2), (2, 2), (0, KV + 1)):
        with pytest.raises(ValueError, match="not inside"):
            hb.heads_slice(start, n)


def test_calibrated_heads_refused_by_the_configuration_measure_nothing(monkeypatch):
    """A configuration that cannot hold head groups is refused before the ranking is looked for
    or measured (no file written, no passes run)."""
    from qfilters_mlx.filters import head_store

    def never(*a, **k):
        raise AssertionError("the ranking was resolved before the configuration was checked")

    monkeypatch.setattr(head_store, "resolve_head_ranking", never)
    model = _model()
    with pytest.raises(ValueError, match="evicts nothing"):
        KVCacheBuilder.for_model(model, _config(method="full"), heads="calibrated")
    with pytest.raises(ValueError, match="compress-once"):
        KVCacheBuilder.for_model(model, _config(mode=CompressOnce(0.5), qfilters_recent=None), heads="calibrated")


def test_refusals():
    model = _model()
    hb = HeadBudgets(BUDGETS, RECENTS)
    with pytest.raises(ValueError, match="evicts nothing"):
        KVCacheBuilder.for_model(model, _config(method="full"), heads=hb)
    with pytest.raises(ValueError, match="compress-once"):
        KVCacheBuilder.for_model(model, _config(mode=CompressOnce(0.5), qfilters_recent=None), heads=hb)
    with pytest.raises(ValueError, match="layers"):
        KVCacheBuilder.for_model(model, _config(), heads=HeadBudgets(BUDGETS[:1], RECENTS[:1]))
    with pytest.raises(ValueError, match="recent"):
        KVCacheBuilder.for_model(model, _config(), heads=HeadBudgets(BUDGETS, ((40, 12, 12), (4, 4, 3))))
    with pytest.raises(TypeError):
        KVCacheBuilder.for_model(model, _config(), heads=BUDGETS)
    caches = _grouped(model)
    with pytest.raises(ValueError, match="batch"):
        caches[0].merge([caches[0], caches[0]])
    with pytest.raises(ValueError, match="mask"):
        caches[0].make_mask(4, return_array=True)
    with pytest.raises(ValueError, match="mask"):
        caches[0].make_mask(4, window_size=8)
    with pytest.raises(ValueError, match="K/V"):
        caches[0].keys_and_values()
    bad = mx.zeros((1, KV + 1, 2, D))
    with pytest.raises(ValueError, match="KV heads"):
        caches[0].update_and_fetch(bad, bad)
    assert caches[0].offset == 0
    k = mx.zeros((1, 2, 2, D))
    with pytest.raises(ValueError, match="causal"):
        caches[0].attend(mx.zeros((1, HEADS, 2, D)), GroupedKV([k, k]), GroupedKV([k, k]), 1.0,
                         mx.ones((2, 2), dtype=mx.bool_), None, None)
    with pytest.raises(ValueError, match="partition|split"):
        HeadGroupsKVCache([((0, 1), caches[0].caches[0]), ((1,), caches[0].caches[1])])


def test_speculative_decoding_with_groups_equals_one_budget():
    """mlx-lm's ``speculative_generate_step`` (rewinds of rejected drafts through ``trim``) on
    the main model's caches in groups at one budget gives the one-budget caches' tokens; at
    different budgets it runs with every group rewound to the same offset."""
    import importlib

    from mlx_lm.models.cache import make_prompt_cache

    from qfilters_mlx.cache.head_group_build import layer_cache
    from qfilters_mlx.cache.kv_cache import build_cache
    from qfilters_mlx.config import HeadGroup

    generate = importlib.import_module("mlx_lm.generate")
    model, draft, toks = _model(), tiny_llama(seed=1, layers=1, kv=KV, heads=HEADS), _tokens()
    cfg = _config().with_head_dim(D)

    def spec(main):
        out = [int(t) for t, _, _ in generate.speculative_generate_step(
            toks[0, :PROMPT], model, draft, num_draft_tokens=3, max_tokens=16,
            prompt_cache=main + make_prompt_cache(draft))]
        return out, main

    groups = (HeadGroup((0, 2), 16, (4, 4)), HeadGroup((1,), 16, (4,)))
    forced = [layer_cache(cfg, groups, i, _filters()[i],
                          lambda gc, gf, _i=i: build_cache(gc, _i, gf, max_rewind=4)) for i in range(LAYERS)]
    one = [build_cache(cfg, i, _filters()[i], max_rewind=4) for i in range(LAYERS)]
    assert spec(forced)[0] == spec(one)[0]
    out, main = spec(list(_grouped(model, max_rewind=4)))
    assert len(out) == 16
    for c in main:
        assert len({g.offset for g in c.caches}) == 1


def test_batch_generator_refuses_groups_by_name():
    """mlx-lm's ``BatchGenerator`` (``batch_generate``, mlx_lm.server) merges per-sequence
    caches: head groups refuse with an error naming them, never a wrong batch."""
    from helpers.batch_helpers import batched

    model = _model()
    KVCacheBuilder.install(model, _config(), heads=HeadBudgets(BUDGETS, RECENTS))
    try:
        with pytest.raises(ValueError, match="head-group caches do not batch"):
            batched(model, [[1, 2, 3, 4, 5] * 10, [7, 8, 9] * 9], 4)
    finally:
        del model.make_cache


def test_copies_are_independent_and_continue_alike():
    """``copy.deepcopy`` (mlx-lm's server copies stored caches) continues as the original."""
    model, toks = _model(), _tokens()
    caches = _grouped(model)
    _run(model, caches, toks[:, :PROMPT + 4])
    twin = copy.deepcopy(caches)
    a = [model(toks[:, t:t + 1], cache=caches)[:, -1] for t in range(PROMPT + 4, PROMPT + 12)]
    assert twin[0].offset == PROMPT + 4  # the copy did not move
    b = [model(toks[:, t:t + 1], cache=twin)[:, -1] for t in range(PROMPT + 4, PROMPT + 12)]
    assert mx.array_equal(mx.stack(a), mx.stack(b)).item()


def test_calibrated_heads_come_from_the_stored_ranking_by_the_rule(tmp_path, monkeypatch):
    """``heads="calibrated"``: the ranking stored for the model's identity, turned into budgets at
    the configuration's budget by the written rule (its 8 top heads at 4x, the rest the floor
    of what is left); another string is refused."""
    from qfilters_mlx.filters.head_budgets import head_budgets
    from qfilters_mlx.filters.head_store import heads_path, save_ranking
    from qfilters_mlx.identity import model_identity

    monkeypatch.setenv("QFILTERS_MLX_HOME", str(tmp_path))
    model = tiny_llama(layers=30, kv=KV, heads=HEADS)
    ranking = np.random.default_rng(0).random((30, KV)).astype(np.float32)
    path = heads_path(model_identity(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_ranking(str(path), ranking, model)
    mx.random.seed(3)
    cfg = _config(qfilters_filters=mx.random.normal((30, KV, D)))
    caches = KVCacheBuilder.for_model(model, cfg, heads="calibrated")
    want = head_budgets(ranking, 16, N_SINK)
    top = {divmod(int(i), KV) for i in np.argsort(-ranking, axis=None)[:8]}
    for layer, c in enumerate(caches):
        groups = c.caches if isinstance(c, HeadGroupsKVCache) else [c]
        heads = c.heads if isinstance(c, HeadGroupsKVCache) else [tuple(range(KV))]
        for hs, g in zip(heads, groups):
            for h in hs:
                assert g.config.qfilters_budget == want.budgets[layer][h]
                assert (g.config.qfilters_budget == 64) == ((layer, h) in top)
    assert sum(isinstance(c, HeadGroupsKVCache) for c in caches) == len({lh[0] for lh in top})
    with pytest.raises(ValueError, match="calibrated"):
        KVCacheBuilder.for_model(model, cfg, heads="retrieval")
