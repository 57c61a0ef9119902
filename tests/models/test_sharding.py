"""Tensor parallelism without processes: a rank's KV heads, filter slicing, errors, identity.

A model is sharded as mlx-lm shards it (``model.shard(group)``, i.e. mlx.nn's
``shard_linear``) with a stand-in group that only answers ``rank()``/``size()``;
where a forward pass is needed, ``mx.distributed.all_sum`` is replaced by a stub
(shapes are what matter there). The launched check with real ranks is
tests/integration/test_tensor_parallel.py.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from qfilters_mlx import KVCacheBuilder, KVCacheConfig
from qfilters_mlx.identity import identity_fields
from qfilters_mlx.sharding import (check_divisible, check_shards, gather_heads, head_range,
                                   local_filters, shard_info, tensor_group)


class FakeGroup:
    """What shard_linear / model.shard read from an ``mx.distributed.Group``."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def tiny(n_kv=6, heads=6, head_dim=8, layers=2):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=96,
        num_attention_heads=heads, rms_norm_eps=1e-5, vocab_size=61, num_key_value_heads=n_kv,
        head_dim=head_dim, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def sharded(model, rank, size):
    m = copy.deepcopy(model)
    m.shard(FakeGroup(rank, size))
    return m


@pytest.mark.parametrize("size", [1, 2, 3, 6])
def test_head_range_is_how_shard_linear_splits_k_proj(size):
    model = tiny()
    k = model.layers[0].self_attn.k_proj
    d = 8
    for rank in range(size):
        part = nn.layers.distributed.shard_linear(k, "all-to-sharded", group=FakeGroup(rank, size))
        start, stop = head_range(6, rank, size)
        want = np.array(k.weight).reshape(6, d, -1)[start:stop].reshape(-1, k.weight.shape[1])
        np.testing.assert_array_equal(np.array(part.weight), want)


def test_local_filters_follow_the_sharded_k_proj_weights():
    """Whole-model filters whose head h is layer l's k_proj rows of head h (column 0): on
    every rank, the sliced filters equal the rank's own sharded k_proj rows."""
    model, d = tiny(), 8
    whole = mx.stack([l.self_attn.k_proj.weight[:, 0].reshape(6, d) for l in model.layers])
    for size in (2, 3):
        for rank in range(size):
            m = sharded(model, rank, size)
            info = shard_info(m)
            assert (info.rank, info.size, info.local_heads, info.n_kv_heads) == (rank, size, 6 // size, 6)
            mine = local_filters(whole, info)
            own = mx.stack([l.self_attn.k_proj.weight[:, 0].reshape(-1, d) for l in m.layers])
            np.testing.assert_array_equal(np.array(mine), np.array(own))
    assert local_filters(whole, shard_info(model)) is whole  # not sharded: unchanged


def test_not_sharded_and_size_one_groups_are_not_tensor_parallel():
    model = tiny()
    assert tensor_group(model) is None and shard_info(model) is None
    assert tensor_group(sharded(model, 0, 1)) is None
    assert gather_heads(mx.ones((2, 6, 8)), model).shape == (2, 6, 8)


def test_kv_heads_not_divisible_by_the_group_size_raise():
    with pytest.raises(ValueError, match=r"3 KV heads, not divisible by the 2 ranks"):
        check_divisible(3, 2)
    with pytest.raises(ValueError, match=r"9 attention heads, not divisible by the 2 ranks"):
        check_divisible(3, 3, n_heads=9) or check_divisible(2, 2, n_heads=9)
    with pytest.raises(ValueError, match="not divisible"):
        head_range(3, 0, 2)
    with pytest.raises(ValueError, match="rank 3"):
        head_range(6, 3, 3)
    m = sharded(tiny(n_kv=3, heads=6), 0, 2)  # mlx-lm shards it anyway: 1.5 heads of rows
    with pytest.raises(ValueError, match=r"k_proj holds 12 rows .* 3 KV heads are not divisible by "
                                         r"the 2 ranks"):
        check_shards(m)
    with pytest.raises(ValueError, match="not divisible"):
        KVCacheBuilder.for_model(m, KVCacheConfig(qfilters_filter_source="keys"))


def test_filters_of_another_head_count_raise_naming_both():
    info = shard_info(sharded(tiny(), 1, 3))
    with pytest.raises(ValueError, match=r"do not hold the whole model's 6 KV heads .* this rank "
                                         r"holds 2 of them, rank 1 of 3"):
        local_filters(mx.ones((2, 2, 8)), info)


@pytest.fixture
def stub_all_sum(monkeypatch):
    """``mx.distributed.all_sum`` as ``result(x)``: identity unless a test sets ``sums``."""
    state = {"seen": [], "sums": None}

    def all_sum(x, *, group=None, stream=None):
        state["seen"].append(x)
        return x if state["sums"] is None else state["sums"]

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    return state


def test_for_model_on_a_rank_builds_its_heads_and_slices_filters(stub_all_sum):
    model = tiny()
    whole = mx.random.normal((2, 6, 8))
    m = sharded(model, 2, 3)
    caches = KVCacheBuilder.for_model(m, KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1,
                                                       qfilters_filters=whole))
    assert caches.report.summary().endswith("rank 2 of 3 (tensor parallel): KV heads 4..5 of 6 per "
                                            "layer; filter: filters array (given)")
    for i, c in enumerate(caches):
        np.testing.assert_array_equal(np.array(c.filter), np.array(whole[i, 4:6]))
    c = caches[0]
    k = mx.random.normal((1, 2, 10, 8))
    c.update_and_fetch(k, k)
    assert c.keys.shape[:2] == (1, 2) and c.size() == 8
    with pytest.raises(ValueError, match=r"\(2, 6, 8\)"):  # a rank's slice is not a whole-model array
        KVCacheBuilder.for_model(m, KVCacheConfig(qfilters_filters=whole[:, :2]))


def test_identity_of_a_rank_is_the_whole_models(stub_all_sum):
    """Every rank's identity fields, with the gathered samples summed over the ranks as
    all_sum does, equal the unsharded model's (so a whole-model filters file is accepted)."""
    model = tiny()
    want = identity_fields(model)
    ranks = [sharded(model, r, 3) for r in range(3)]
    for m in ranks:  # pass 1: what each rank contributes
        identity_fields(m)
    total = sum(stub_all_sum["seen"])
    stub_all_sum["sums"] = total
    for m in ranks:
        assert identity_fields(m) == want
    other = tiny(layers=3)
    assert identity_fields(sharded(other, 0, 3))["parameters"] != want["parameters"]


def test_commands_refuse_what_distributed_mode_cannot_do(monkeypatch, tmp_path, capsys):
    import argparse
    import json

    from qfilters_mlx.commands import distributed

    parser = argparse.ArgumentParser(prog="qfilters-mlx generate")
    args = argparse.Namespace(adapter_path=None, draft_model="d", compare=None, prompt_cache_file=None)
    with pytest.raises(SystemExit):
        distributed.check_args(parser, args, 3)
    assert "--draft-model: not available under mlx.launch (3 ranks)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9,
                                                      "num_key_value_heads": 3}))
    monkeypatch.setattr(distributed, "group", lambda: FakeGroup(0, 2))
    with pytest.raises(SystemExit):
        distributed.load_sharded(parser, argparse.Namespace(), tmp_path)
    assert "3 KV heads, not divisible by the 2 ranks" in capsys.readouterr().err


def test_only_rank_0_prints(capsys):
    from qfilters_mlx.commands.distributed import only_rank0_prints

    for rank in (0, 1, 2):
        with only_rank0_prints(rank):
            print(f"from rank {rank}")
    assert capsys.readouterr().out == "from rank 0\n"


def _kept_by_head(cache) -> dict:
    """``{KV head: kept positions}`` of one layer's cache (head groups or one budget)."""
    from qfilters_mlx.cache.head_groups import HeadGroupsKVCache

    if not isinstance(cache, HeadGroupsKVCache):
        pos = np.array(cache.kept_positions())[0]
        return {h: list(pos[h]) for h in range(pos.shape[0])}
    out = {}
    for heads, pos in zip(cache.heads, cache.kept_positions()):
        for j, h in enumerate(heads):
            out[h] = list(np.array(pos)[0, j])
    return out


def test_head_groups_on_a_rank_are_the_whole_models_heads(stub_all_sum):
    """Every rank of 3 holds its 2 KV heads of a whole-model ``HeadBudgets``: per head the same
    budget, window and kept positions as one process fed the same keys, and the ranks' bytes
    add up to the one process's."""
    from qfilters_mlx import HeadBudgets

    model = tiny()
    whole = mx.random.normal((2, 6, 8))
    budgets = ((24, 8, 8, 16, 8, 8), (8, 8, 20, 8, 8, 12))
    recents = ((6, 3, 3, 5, 3, 2), (3, 3, 4, 3, 3, 6))
    hb = HeadBudgets(budgets, recents)
    cfg = KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_filters=whole)
    one = KVCacheBuilder.for_model(model, cfg, heads=hb)
    ranks = [KVCacheBuilder.for_model(sharded(model, r, 3), cfg, heads=hb) for r in range(3)]
    for step in range(5):  # a 30-token prefill, then single tokens: several evictions
        t = 30 if step == 0 else 1
        for layer in range(2):
            k, v = mx.random.normal((1, 6, t, 8)), mx.random.normal((1, 6, t, 8))
            one[layer].update_and_fetch(k, v)
            for r, caches in enumerate(ranks):
                caches[layer].update_and_fetch(k[:, 2 * r:2 * r + 2], v[:, 2 * r:2 * r + 2])
    for layer in range(2):
        want = _kept_by_head(one[layer])
        assert [len(want[h]) for h in range(6)] == list(budgets[layer])
        for r, caches in enumerate(ranks):
            got = _kept_by_head(caches[layer])
            assert {2 * r + h: p for h, p in got.items()} == {h: want[h] for h in (2 * r, 2 * r + 1)}
    assert sum(c.nbytes for caches in ranks for c in caches) == sum(c.nbytes for c in one)


def test_head_groups_on_a_rank_need_the_whole_models_table(stub_all_sum):
    from qfilters_mlx import HeadBudgets

    m = sharded(tiny(), 1, 3)
    cfg = KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_filters=mx.random.normal((2, 6, 8)))
    local = HeadBudgets(((16, 8), (8, 8)), ((4, 3), (3, 3)))  # the rank's 2 heads alone
    with pytest.raises(ValueError, match=r"2 heads, the model's layer has 6.*rank 1 of 3.*whole model's table of 6"):
        KVCacheBuilder.for_model(m, cfg, heads=local)


def test_calibrated_heads_on_a_rank_are_the_rules_budgets_sliced(stub_all_sum, monkeypatch):
    """``heads="calibrated"`` on a rank: the whole model's ranking (as found for the model's
    identity; stubbed here) through the rule, then the rank's heads."""
    from qfilters_mlx.cache.head_groups import HeadGroupsKVCache
    from qfilters_mlx.filters import head_store
    from qfilters_mlx.filters.head_budgets import head_budgets

    ranking = np.random.default_rng(1).random((8, 6)).astype(np.float32)  # 8 big heads of 48
    monkeypatch.setattr(head_store, "resolve_head_ranking",
                        lambda *a, **k: head_store.ResolvedRanking(ranking, "stub"))
    cfg = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=1, qfilters_filters=mx.random.normal((8, 6, 8)))
    want = head_budgets(ranking, 16, 1)
    assert len({b for row in want.budgets for b in row}) > 1  # the rule made big heads
    for r in range(3):
        caches = KVCacheBuilder.for_model(sharded(tiny(layers=8), r, 3), cfg, heads="calibrated")
        for i, c in enumerate(caches):
            rows = want.budgets[i][2 * r:2 * r + 2]
            got = ([c.caches[j].config.qfilters_budget for j, hs in enumerate(c.heads) for _ in hs]
                   if isinstance(c, HeadGroupsKVCache) else [c.config.qfilters_budget] * 2)
            order = ([h for hs in c.heads for h in hs] if isinstance(c, HeadGroupsKVCache) else [0, 1])
            assert [b for _, b in sorted(zip(order, got))] == list(rows)
