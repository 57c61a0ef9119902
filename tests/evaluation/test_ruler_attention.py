"""The C softmax and the attention built on it give MLX's own bits.

References: ``mx.softmax(precise=True)`` and ``mx.fast.scaled_dot_product_attention`` on the CPU
stream (compared bit for bit, not within a tolerance), and one RULER sample's records run with and
without :func:`fast_attention` (every number equal).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from helpers.ruler_helpers import ByteTokenizer, tiny_model
from qfilters_mlx.assets.prompts import source_text
from qfilters_mlx.evaluation.ruler import attention
from qfilters_mlx.evaluation.ruler.haystack import essay_sentences
from qfilters_mlx.evaluation.ruler.prompt import fit, sample_tokens
from qfilters_mlx.evaluation.ruler.runner import RulerSettings, run_sample
from qfilters_mlx.evaluation.ruler.tasks import Sources, quick_tasks

pytestmark = pytest.mark.skipif(not attention.available(), reason="no C compiler for the C softmax")


def _same_bits(a: mx.array, b: mx.array) -> bool:
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("shape, spread", [((3, 2048), 3.0), ((13, 7), 10.0), ((9, 333), 40.0), ((1, 1), 1.0),
                                           ((17, 16), 100.0), ((2, 3, 50, 129), 5.0)])
def test_softmax_has_mlx_bits(shape, spread):
    s = mx.random.normal(shape, key=mx.random.key(1)) * spread
    lower = mx.random.uniform(shape=shape, key=mx.random.key(2)) < 0.3  # masked as the attention masks
    s = mx.where(lower, mx.array(mx.finfo(mx.float32).min, mx.float32), s)
    s = mx.where(mx.arange(shape[-1]) == 0, 0.5, s)  # a row is never masked whole
    assert _same_bits(attention.softmax(s), mx.softmax(s, axis=-1, precise=True))


@pytest.mark.parametrize("B, Hq, Hk, L, T, mask", [(1, 9, 3, 512, 2048, "causal"), (1, 9, 3, 64, 64, "causal"),
                                                   (3, 9, 3, 50, 1500, "bool"), (13, 9, 3, 1, 2011, "bool"),
                                                   (2, 4, 4, 33, 200, None), (1, 4, 2, 41, 300, "causal")])
def test_sdpa_has_mlx_bits(B, Hq, Hk, L, T, mask):
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) for i, s in
               enumerate([(B, Hq, L, 16), (B, Hk, T, 16), (B, Hk, T, 16)]))
    if mask == "bool":
        mask = mx.random.uniform(shape=(B, 1, L, T), key=mx.random.key(7)) > 0.3
        mask = mask | (mx.arange(T) == T - 1)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert _same_bits(attention.sdpa(q, k, v, 0.25, mask), ref)
    with attention.fast_attention():
        assert _same_bits(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask), ref)


def test_fast_attention_restores_the_name_also_after_an_error():
    original = mx.fast.scaled_dot_product_attention
    with pytest.raises(KeyError):
        with attention.fast_attention():
            assert mx.fast.scaled_dot_product_attention is not original
            raise KeyError
    assert mx.fast.scaled_dot_product_attention is original


def test_a_ruler_sample_is_the_same_with_the_c_softmax(monkeypatch):
    monkeypatch.setattr(attention, "MIN_ELEMENTS", 1)  # every attention call through the C softmax
    model = tiny_model(seed=5)
    tok = ByteTokenizer()
    sources = Sources(tuple(essay_sentences(source_text())))
    s, _ = fit(lambda m: quick_tasks()["niah_single_2"](sources, "a-1", m), tok, 600)
    c, q = sample_tokens(tok, s)
    f = mx.random.normal((2, 2, 16), key=mx.random.key(3))
    filters = f / mx.linalg.norm(f, axis=-1, keepdims=True)
    st = RulerSettings(chunk=64, calib_tokens=16, ratios=(0.5, 0.875), protocols=("compress_once", "streaming"),
                       compress_arms=("qfilters", "knorm", "streaming_llm", "qfilters_online"),
                       streaming_samples="all", validation_samples=1)
    recs = []
    for fast in (False, True):
        monkeypatch.setattr(attention, "available", lambda fast=fast: fast)
        rec = {"index": 0}
        run_sample(model, tok, rec, c, q, s.outputs, s.max_new_tokens, st, calibrated=filters)
        recs.append({k: rec[k] for k in ("forced", "answers", "scores", "kept")})
    assert len(recs[0]["forced"]) == len(recs[0]["answers"]) == 1 + 4 * 2 + 2 * 2  # full, compress-once, streaming
    assert recs[0] == recs[1]
