"""The retrieval-head ranking: calibration needles built from the calibration text only, and the
needle attention of every KV head against numpy written from the captured queries and keys."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.head_models import H_KV, H_Q, HD, LAYERS, gqa_model
from helpers.ruler_helpers import ByteTokenizer
from qfilters_mlx.assets.prompts import calibration_text
from qfilters_mlx.filters.head_ranking import (CONTEXT_TOKENS, DEPTHS, FORMS, SPANS, calibration_needles,
                                               needle_pass, rank_heads)
from qfilters_mlx.filters.window_capture import keys_and_queries


@pytest.fixture(scope="module")
def needles():
    return calibration_needles(ByteTokenizer())


def np_needle_mass(model, prompt) -> np.ndarray:
    """The rule written out: per layer and KV head, the softmax weight (causal, scale 1/sqrt(D))
    each query predicting an answer key token gives the needle's key tokens, averaged over
    those queries and the KV head's query heads."""
    (layers,) = keys_and_queries(model, [prompt.tokens[:-1]])
    n = len(prompt.key_positions)
    out = np.zeros((len(layers), H_KV))
    for layer, (keys, queries, _) in enumerate(layers):
        for qh in range(H_Q):
            for p in prompt.key_positions:
                t = p - 1
                w = keys[qh // (H_Q // H_KV), :t + 1].astype(np.float64) @ queries[qh, t] / np.sqrt(HD)
                w = np.exp(w - w.max())
                w /= w.sum()
                out[layer, qh // (H_Q // H_KV)] += w[prompt.needle_position:prompt.needle_position + n].sum()
    return out / (H_Q // H_KV) / n


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


def test_a_layer_with_its_own_mask_is_refused(needles):
    from qfilters_mlx.filters.attention_route import refuse_own_mask

    with pytest.raises(ValueError, match="layer 2 attends with its own mask"):
        refuse_own_mask(2, mx.zeros((3, 3), dtype=mx.bool_))
    refuse_own_mask(2, "causal")
    refuse_own_mask(2, None)
