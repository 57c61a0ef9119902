"""The retrieval-head ranking: calibration needles built from the calibration text only, and the
needle attention of every KV head against numpy written from the captured queries and keys."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.head_models import H_KV, LAYERS, gqa_model, np_needle_mass
from helpers.ruler_helpers import ByteTokenizer
from qfilters_mlx.assets.prompts import calibration_text
from qfilters_mlx.filters.head_ranking import (BLOCK, CONTEXT_TOKENS, DEPTHS, FORMS, SPANS, attend_rows,
                                               calibration_needles, needle_pass, rank_heads)


@pytest.fixture(scope="module")
def needles():
    return calibration_needles(ByteTokenizer())


def test_needles_come_from_the_calibration_text_in_two_forms_at_several_depths(needles):
    text, _ = calibration_text()
    assert len(needles) == len(SPANS) * len(FORMS) * len(DEPTHS)
    assert {n.form for n in needles} == {"number", "word"} and {n.depth for n in needles} == set(DEPTHS)
    tok = ByteTokenizer()
    for n in needles:
        at = 0
        for line in n.lines:  # every haystack line is calibration text, in order
            found = text.find(line, at)
            assert found >= 0, line
            at = found + len(line)
        assert sum(len(line) + 1 for line in n.lines) >= CONTEXT_TOKENS  # bytes: one token each
        decoded = tok.decode(n.prompt.tokens)
        assert decoded.endswith(next(f for f in FORMS if f.name == n.form).answer_prefix + n.key)
        needle_at = n.prompt.needle_position
        assert tok.decode(n.prompt.tokens[needle_at:needle_at + len(n.key)]) == n.key
        assert tok.decode(n.prompt.tokens[:n.prompt.prompt_tokens]).count(n.key) == 1
    # deeper needles sit further from the question (each span and form)
    for s in range(len(SPANS)):
        for f in range(len(FORMS)):
            group = needles[(s * len(FORMS) + f) * len(DEPTHS):(s * len(FORMS) + f + 1) * len(DEPTHS)]
            distances = [n.prompt.distance for n in group]
            assert distances == sorted(distances, reverse=True) and len(set(distances)) == len(DEPTHS)


def test_needle_attention_against_numpy(needles):
    model = gqa_model()
    for n in (needles[0], needles[-1]):  # a number and a word
        got, recalled = needle_pass(model, n.prompt)
        np.testing.assert_allclose(got, np_needle_mass(model, n.prompt), rtol=1e-4, atol=1e-6)
        logits = model(mx.array(n.prompt.tokens[:-1])[None])[0]
        want = all(int(mx.argmax(logits[p - 1])) == n.prompt.tokens[p] for p in n.prompt.key_positions)
        assert recalled == want


def test_ranking_is_the_mean_over_the_calibration_needles(needles):
    model = gqa_model(1)
    r = rank_heads(model, ByteTokenizer())
    each = np.stack([np_needle_mass(model, n.prompt) for n in needles])
    np.testing.assert_allclose(r.per_needle, each, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(r.ranking, each.mean(axis=0), rtol=1e-4, atol=1e-6)
    assert r.forms == tuple(n.form for n in needles)
    assert r.ranking.shape == (LAYERS, H_KV) and r.prompts == len(needles) and 0 <= r.recalled <= r.prompts
    assert r.source == calibration_text()[1] and r.seconds > 0
    # the needles' shared starts were computed once: fewer tokens than the passes hold
    total = sum(len(n.prompt.tokens) - 1 for n in needles)
    assert 0 < r.computed < 0.9 * total


class _NoBackbone:
    """The tiny model without ``.model``: the pass runs the whole model over every token."""

    def __init__(self, model):
        self._inner = model
        self.layers = model.layers

    def __call__(self, inputs, cache=None):
        return self._inner(inputs, cache=cache)


def test_needle_pass_with_and_without_a_backbone_agree(needles):
    model = gqa_model(2)
    for n in (needles[1], needles[4]):
        got, recalled = needle_pass(_NoBackbone(model), n.prompt)
        with_body, recalled_body = needle_pass(model, n.prompt)
        np.testing.assert_allclose(got, np_needle_mass(model, n.prompt), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(with_body, got, rtol=1e-4, atol=1e-6)
        assert recalled == recalled_body


def _np_attention(q, k, v, scale, sinks=None):
    """Causal GQA attention of the last T of S positions, float64, and its weights [H_q, T, S]."""
    h_q, T, _ = q.shape
    h, S, _ = k.shape
    logits = np.einsum("itd,isd->its", q.astype(np.float64), np.repeat(k, h_q // h, axis=0)) * scale
    logits[:, np.arange(S)[None, :] > np.arange(S - T, S)[:, None]] = -np.inf
    if sinks is not None:
        logits = np.concatenate([logits, np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None],
                                                         (h_q, T, 1))], axis=-1)
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    w = (w / w.sum(axis=-1, keepdims=True))[..., :S]
    return w @ np.repeat(v, h_q // h, axis=0).astype(np.float64), w


@pytest.mark.parametrize("T, S, sinks", [(BLOCK + 37, BLOCK + 37, False), (BLOCK + 37, 2 * BLOCK + 5, False),
                                         (BLOCK, BLOCK, False), (BLOCK - 1, 2 * BLOCK, False), (1, 40, False),
                                         (3, 300, False), (BLOCK + 1, 200, True)])
def test_attend_rows_against_numpy_and_mlx_attention(T, S, sinks):
    rng = np.random.default_rng(T + S)
    q = rng.standard_normal((6, T, 16), dtype=np.float32) * 2
    k = rng.standard_normal((2, S, 16), dtype=np.float32) * 2
    v = rng.standard_normal((2, S, 8), dtype=np.float32)
    s = rng.standard_normal(6).astype(np.float32) * 3 if sinks else None
    rows, cols = sorted({S - T, S - 2, S - 1} & set(range(S - T, S))), [0, 1, 5, S - T - 1 if S > T else 2]
    out, mass = attend_rows(mx.array(q), mx.array(k), mx.array(v), 0.25, rows, cols,
                            None if s is None else mx.array(s))
    want, w = _np_attention(q, k, v, 0.25, s)
    np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=1e-5)
    per_q = w[:, [r - (S - T) for r in rows]][..., cols].sum(axis=(1, 2)) / len(rows)
    assert out.shape == (6, T, 8) and out.dtype == mx.float32 and mass.shape == (2,)
    np.testing.assert_allclose(mass, per_q.reshape(2, 3).mean(axis=1), rtol=1e-5, atol=1e-7)
    fast = mx.fast.scaled_dot_product_attention(mx.array(q)[None], mx.array(k)[None], mx.array(v)[None], scale=0.25,
                                                mask="causal", sinks=None if s is None else mx.array(s))
    np.testing.assert_allclose(np.array(out), np.array(fast[0]), rtol=1e-4, atol=1e-5)


def test_attend_rows_records_rows_only_when_all_are_queried():
    q, k = mx.ones((2, 4, 8)), mx.ones((1, 10, 8))
    assert attend_rows(q, k, k, 1.0, [2, 3], [0])[1] is None  # before the queried positions
    with pytest.raises(ValueError, match=r"partly in the queried positions 6\.\.9"):
        attend_rows(q, k, k, 1.0, [5, 6], [0])


def test_a_layer_with_its_own_mask_is_refused(needles):
    from qfilters_mlx.filters.attention_route import refuse_own_mask

    with pytest.raises(ValueError, match="layer 2 attends with its own mask"):
        refuse_own_mask(2, mx.zeros((3, 3), dtype=mx.bool_))
    refuse_own_mask(2, "causal")
    refuse_own_mask(2, None)
