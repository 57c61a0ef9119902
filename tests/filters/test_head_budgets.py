"""Budgets per KV head from a retrieval-head ranking (the rule of
:mod:`qfilters_mlx.filters.head_budgets` written out), and the ranking's file: stored beside the
filter, found by model identity, refused for another model."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.head_models import H_KV, LAYERS, gqa_model
from helpers.ruler_helpers import ByteTokenizer
from qfilters_mlx.config.heads import HeadBudgets
from qfilters_mlx.filters import head_store
from qfilters_mlx.filters.calibration import save_filters
from qfilters_mlx.filters.default_filters import stored_path
from qfilters_mlx.filters.head_budgets import DEFAULT_BIG_HEADS, DEFAULT_MULTIPLE, head_budgets
from qfilters_mlx.identity import model_identity


def rule(ranking, B, S, k, m):
    """The module's rule, written out with loops."""
    L, H = ranking.shape
    flat = sorted(((-ranking[l, h], l, h) for l in range(L) for h in range(H)))  # ties: layer, head
    big = {(l, h) for _, l, h in flat[:k]}
    small = (L * H * B - k * m * B) // (L * H - k) if k and m > 1 else B
    window = min(small // 2, small - S - 1)
    budgets = [[m * B if (l, h) in big and m > 1 else small for h in range(H)] for l in range(L)]
    return budgets, [[window] * H for _ in range(L)]


@pytest.mark.parametrize("L,H,B,S,k,m", [(30, 3, 128, 4, 8, 4), (30, 3, 256, 4, 8, 4), (30, 3, 64, 4, 16, 2),
                                         (24, 2, 100, 4, 5, 3), (30, 3, 128, 4, 0, 4), (30, 3, 128, 4, 8, 1)])
def test_the_rule_written_out(L, H, B, S, k, m):
    ranking = np.random.default_rng(L * k + m).random((L, H))
    got = head_budgets(ranking, B, S, k, m)
    want_b, want_r = rule(ranking, B, S, k, m)
    assert isinstance(got, HeadBudgets)
    assert [list(r) for r in got.budgets] == want_b and [list(r) for r in got.recents] == want_r
    b = np.array(got.budgets)
    assert got.total_tokens == b.sum() <= L * H * B  # never more than one budget everywhere
    assert L * H * B - b.sum() < max(1, L * H - k)  # the left-over tokens: fewer than the small heads
    assert all(len(set(row)) <= 2 for row in got.budgets)  # at most two groups per layer
    assert all(len(got.groups(i)) <= 2 for i in range(L))
    got.check(L, [H] * L, S)  # windows in range: 0 <= recent <= budget - n_sink
    top = np.argsort(-ranking, axis=None)[:k]
    if m > 1:
        assert all(b.flat[i] == m * B for i in top) and (b == m * B).sum() == k
        assert all(r < m * B - S - r for r in np.array(got.recents)[b == m * B])  # mostly chosen by score


def test_ties_go_to_the_lower_layer_then_head_and_defaults():
    got = head_budgets(np.zeros((4, 3)), 64, 4, 2, 2)  # the rest: floor((768 - 256) / 10) = 51
    assert got.budgets[0] == (128, 128, 51) and all(row == (51,) * 3 for row in got.budgets[1:])
    d = head_budgets(np.random.default_rng(0).random((30, 3)), 128, 4)
    assert sum(row.count(DEFAULT_MULTIPLE * 128) for row in d.budgets) == DEFAULT_BIG_HEADS


def test_the_rule_refuses_what_it_cannot_do():
    r = np.random.default_rng(0).random((4, 3))
    with pytest.raises(ValueError, match="leave the other heads 4 tokens, not more than the 4 sinks"):
        head_budgets(r, 16, 4, 1, 9)  # the rest: floor((192 - 144) / 11) = 4, all sinks
    with pytest.raises(ValueError, match="n_big must be < n_layers \\* n_kv_heads = 12"):
        head_budgets(r, 64, 4, 12, 2)
    with pytest.raises(ValueError, match="finite"):
        head_budgets(np.array([[1.0, np.nan]]), 64, 4, 1, 2)
    with pytest.raises(ValueError, match="multiple must be an int >= 1"):
        head_budgets(r, 64, 4, 1, 0)
    with pytest.raises(ValueError, match="n_big must be an int >= 0"):
        head_budgets(r, 64, 4, True, 2)


@pytest.fixture()
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("QFILTERS_MLX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_measured_once_stored_beside_the_filter_then_found(empty_home, capsys):
    model = gqa_model(2)
    first = head_store.resolve_head_ranking(model, ByteTokenizer())
    path = head_store.heads_path(model_identity(model))
    assert path.parent == stored_path(model_identity(model)).parent and path.is_file()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qfilters-mlx: measured retrieval heads (3 layers x 4 KV heads)")
    assert str(path) in err[0] and "measured now" in first.origin
    ranking, meta = head_store.load_ranking(path, model)
    np.testing.assert_array_equal(ranking, first.ranking)
    assert ranking.dtype == np.float32 and ranking.shape == (LAYERS, H_KV)
    assert meta["format"] == head_store.FORMAT and meta["model_id"] == model_identity(model)
    assert meta["prompts"] == "12" and meta["calibration_text"].startswith("pydoc_data.topics")
    again = head_store.resolve_head_ranking(model)  # found: no tokenizer needed, nothing printed
    np.testing.assert_array_equal(again.ranking, first.ranking)
    assert "found by model identity" in again.origin and capsys.readouterr().err == ""
    given = head_store.resolve_head_ranking(model, path=str(path))
    np.testing.assert_array_equal(given.ranking, first.ranking)


def test_another_model_s_file_is_refused_by_name(empty_home, tmp_path):
    a, b = gqa_model(3), gqa_model(4)
    file_a = tmp_path / "a.heads.safetensors"
    head_store.save_ranking(str(file_a), np.arange(LAYERS * H_KV, dtype=np.float32).reshape(LAYERS, H_KV), a)
    with pytest.raises(ValueError, match="measured on another model .*differing fields: weights"):
        head_store.load_ranking(str(file_a), b)
    with pytest.raises(ValueError, match="measured on another model"):
        head_store.resolve_head_ranking(b, path=str(file_a))
    planted = head_store.heads_path(model_identity(b))  # a's file under b's name: refused, kept
    planted.parent.mkdir(parents=True)
    planted.write_bytes(file_a.read_bytes())
    with pytest.raises(ValueError, match="differing fields: weights"):
        head_store.resolve_head_ranking(b, ByteTokenizer())
    assert planted.read_bytes() == file_a.read_bytes()
    with pytest.raises(ValueError, match="shape"):
        head_store.save_ranking(str(tmp_path / "x.safetensors"), np.zeros((2, 2)), a)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a qfilters-mlx head-ranking file"):
        head_store.load_ranking(str(junk), a)
    filters_file = tmp_path / "filters.safetensors"
    save_filters(str(filters_file), mx.zeros((LAYERS, H_KV, 16)), a)
    with pytest.raises(ValueError, match="is not a qfilters-mlx head-ranking file"):
        head_store.load_ranking(str(filters_file), a)


def test_measuring_needs_a_tokenizer(empty_home):
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        head_store.resolve_head_ranking(gqa_model(5))
    assert not head_store.heads_path(model_identity(gqa_model(5))).exists()


def test_a_failed_write_still_gives_the_ranking_says_so_and_leaves_no_file(empty_home, monkeypatch, capsys):
    def cannot_write(path, *_a, **_k):
        open(path, "wb").close()  # as a write that fails half-way leaves its file behind
        raise RuntimeError(f"[save_safetensors] Failed to open file {path}")

    monkeypatch.setattr(head_store, "save_ranking", cannot_write)
    got = head_store.resolve_head_ranking(gqa_model(6), ByteTokenizer())
    assert got.ranking.shape == (LAYERS, H_KV) and "not stored" in got.origin
    assert "not stored (RuntimeError" in capsys.readouterr().err
    assert not [p for p in empty_home.rglob("*") if p.is_file()]
