"""Teacher-forced pass-key recall: the sequence's layout, the predictions of the full cache and
of simulated eviction against caches fed token by token, and the recall rule written out."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from helpers.ruler_helpers import ByteTokenizer, tiny_model
from qfilters_mlx.cache.kv_cache import build_cache
from qfilters_mlx.config import KVCacheConfig
from qfilters_mlx.evaluation.perplexity import full_cache_nll
from qfilters_mlx.evaluation.recall import ANSWER_PREFIX, full_predictions, key_recall, needle_prompt
from qfilters_mlx.evaluation.retrieval import NEEDLE
from qfilters_mlx.evaluation.simulate import MaskedArm, simulated_nll, simulated_predictions

TEXT = "\n\n".join(f"Paragraph {i} says something about topic {i % 7} in plain words." for i in range(40))


def test_the_sequence_is_prompt_answer_prefix_and_key():
    tok = ByteTokenizer()
    p = needle_prompt(tok, TEXT, 300, 0.25, "40917")
    text = tok.decode(p.tokens)
    assert text.endswith("<|assistant|>" + ANSWER_PREFIX + "40917")
    assert tok.decode(p.tokens[:p.prompt_tokens]).endswith("<|assistant|>")
    assert [tok.decode([p.tokens[i]]) for i in p.key_positions] == list("40917")
    assert p.key_positions == list(range(len(p.tokens) - 5, len(p.tokens)))
    needle = NEEDLE.format(key="40917")
    at = text.index(needle) + needle.index("40917")  # bytes: one token per character
    assert p.needle_position == at and p.distance == p.prompt_tokens - at
    assert 0 < p.needle_position < p.prompt_tokens // 2


def by_token(model, tokens, caches, prefix):
    """Argmax and NLL of tokens[prefix:] feeding ``caches``: the prefix in one call, then one token a call."""
    logits = [model(mx.array(tokens[:prefix])[None], cache=caches)[0, -1]]
    for t in tokens[prefix:-1]:
        logits.append(model(mx.array([[t]]), cache=caches)[0, -1])
    lp = mx.stack(logits).astype(mx.float32)
    target = mx.array(tokens[prefix:])[:, None]
    nll = mx.logsumexp(lp, axis=-1) - mx.take_along_axis(lp, target, axis=-1)[:, 0]
    return np.array(nll), np.array(mx.argmax(lp, axis=-1))


def test_predictions_equal_caches_fed_token_by_token():
    model = tiny_model(seed=3)
    tokens = np.random.default_rng(1).integers(0, 256, 90).tolist()
    nll, arg = full_predictions(model, tokens, 6)
    want_nll, want_arg = by_token(model, tokens, make_prompt_cache(model), 6)
    np.testing.assert_allclose(nll, want_nll, rtol=2e-5, atol=2e-4)
    np.testing.assert_allclose(nll, full_cache_nll(model, tokens, 6), rtol=2e-5, atol=2e-4)
    assert arg == want_arg.tolist()
    cfg = KVCacheConfig(method="streaming_llm", head_dim=model.layers[0].self_attn.head_dim, qfilters_budget=24)
    nll, arg = simulated_predictions(model, tokens, MaskedArm(cfg), 6)
    caches = [build_cache(cfg, i) for i in range(len(model.layers))]
    want_nll, want_arg = by_token(model, tokens, caches, 6)
    np.testing.assert_allclose(nll, want_nll, rtol=2e-5, atol=2e-4)
    assert nll == simulated_nll(model, tokens, MaskedArm(cfg), 6)
    assert arg == want_arg.tolist()
    assert np.abs(np.array(nll) - np.array(full_predictions(model, tokens, 6)[0])).max() > 1e-3  # it evicted
    with pytest.raises(ValueError, match=r"^prefix must be in \[1, 89\], got 90$"):
        full_predictions(model, tokens, 90)


def test_recall_needs_every_key_token_first():
    tok = ByteTokenizer()
    p = needle_prompt(tok, TEXT, 200, 0.5, "55123")
    prefix = 10
    n = len(p.tokens) - prefix
    argmax = [0] * n
    nll = [0.25] * n
    for pos in p.key_positions:
        argmax[pos - prefix] = p.tokens[pos]
        nll[pos - prefix] = 0.5
    assert key_recall(p, nll, argmax, prefix) == (True, pytest.approx(2.5))
    for pos in p.key_positions:
        wrong = list(argmax)
        wrong[pos - prefix] = p.tokens[pos] + 1
        assert key_recall(p, nll, wrong, prefix)[0] is False
    with pytest.raises(ValueError, match=f"^predictions of {n} tokens needed, got {n - 1} NLLs and {n} argmax$"):
        key_recall(p, nll[1:], argmax, prefix)
