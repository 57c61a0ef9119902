"""RULER's shared rows and teacher-forced scoring against independent references.

References: one plain model call over the whole prompt and gold answer (no cache) for the full
cache's log-likelihood; the library's own compress-once and streaming caches, fed by the model
chunk by chunk, for the compressed and forked rows; the fork rule written out as the sizes a
streaming cache holds call after call; a bigram model (attention and MLP outputs zeroed, so the
next token is a fixed function of the current one) on which the greedy answer is forced, for the
agreement of the two scorings.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from helpers.ruler_helpers import EOS, VOCAB, ByteTokenizer, tiny_model
from qfilters_mlx.assets.prompts import source_text
from qfilters_mlx.evaluation.ruler.arms import arm_by_name
from qfilters_mlx.evaluation.ruler.forced import forced_scores, gold_answer, split_model, summarize
from qfilters_mlx.evaluation.ruler.haystack import essay_sentences
from qfilters_mlx.evaluation.ruler.prompt import fit, sample_tokens
from qfilters_mlx.evaluation.ruler.rows import compressed_kv, fork_point, forked_row
from qfilters_mlx.evaluation.ruler.runner import RulerSettings, run_sample
from qfilters_mlx.evaluation.ruler.tasks import Sources, quick_tasks

SOURCES = Sources(tuple(essay_sentences(source_text())))
CHUNK = 64


def _sample(length=700, task="niah_single_2", seed="f-1"):
    tok = ByteTokenizer()
    s, _ = fit(lambda m: quick_tasks()[task](SOURCES, seed, m), tok, length)
    c, q = sample_tokens(tok, s)
    return tok, s, c, q


def _log_softmax_at(logits: mx.array, ids: list[int]) -> np.ndarray:
    lg = np.asarray(logits.astype(mx.float32))
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    return lg[np.arange(len(ids)), ids] - lse


def _filters():
    f = mx.random.normal((2, 2, 16), key=mx.random.key(3))
    return f / mx.linalg.norm(f, axis=-1, keepdims=True)


# ------------------------------------------------------------------------- gold answer
def test_gold_answer_spans_cover_each_expected_string():
    tok = ByteTokenizer()
    ids, spans = gold_answer(tok, ["123", "ab-c"])
    assert tok.decode(ids) == " 123, ab-c."
    assert [tok.decode(ids[a:b]) for a, b in spans] == ["123", "ab-c"]  # (a lone leading space not judged)

    class Merged(ByteTokenizer):  # a tokenizer that keeps the space in the string's first token
        def encode(self, text, add_special_tokens=False):
            return [1000] if text == " apple" else super().encode(text)

        def decode(self, ids):
            return "".join(" apple" if i == 1000 else super(Merged, self).decode([i]) for i in ids)

    ids, spans = gold_answer(Merged(), ["apple", "7"])
    assert ids[:1] == [1000] and spans == [(0, 1), (3, 4)]
    with pytest.raises(ValueError, match="at least one"):
        gold_answer(tok, [])


def test_summarize_is_the_rule_written_out():
    logp = mx.array([[-0.5, -1.0, -0.25, -2.0], [-0.1, -0.1, -0.1, -0.1]])
    hit = mx.array([[True, True, False, True], [True, True, True, True]])
    out = summarize(logp, hit, [(0, 2), (2, 3)])
    assert out[0] == {"loglik": -3.75, "tokens": 4, "match": 0.5, "hits": "1101"}
    assert out[1]["match"] == 1.0 and out[1]["loglik"] == pytest.approx(-0.4)


def test_split_model_reproduces_the_logits_and_refuses_a_transformed_head():
    model = tiny_model()
    split = split_model(model)
    x = mx.arange(7)[None]
    np.testing.assert_allclose(np.asarray(split.head(split.body(x))), np.asarray(model(x)), rtol=1e-5, atol=1e-5)

    class Capped(llama.Model):
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return 3.0 * mx.tanh(super().__call__(inputs, cache, input_embeddings) / 3.0)

    capped = Capped(model.args)
    capped.update(model.parameters())
    with pytest.raises(ValueError, match="transforms its logits"):
        split_model(capped)


# ------------------------------------------------------------------------ shared rows
@pytest.mark.parametrize("budget, context, expected", [(100, 700, 128), (127, 700, 128), (128, 700, 192),
                                                       (600, 700, 640), (650, 700, 640), (30, 50, 0)])
def test_fork_point_is_the_end_of_the_first_evicting_call(budget, context, expected):
    """Written out: a streaming cache fed calls of CHUNK tokens holds every token until a call
    ends with more than the budget; the fork is that call's end, at most the last whole chunk."""
    stored, fork = 0, None
    for end in range(CHUNK, context + 1, CHUNK):
        stored = end
        if stored > budget:
            fork = end
            break
    if fork is None:
        fork = CHUNK * (context // CHUNK)
    assert fork == expected == fork_point(budget, context, CHUNK)
    assert fork_point(budget, context, CHUNK, needs_queries=True) == 0


def _prefill_kv(model, context):
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in model.layers]
    for i in range(0, len(context), CHUNK):
        model(mx.array(context[i:i + CHUNK])[None], cache=caches)
    return [(c.keys[:, :, :c.offset], c.values[:, :, :c.offset]) for c in caches]


@pytest.mark.parametrize("arm", ["qfilters", "knorm", "streaming_llm", "random"])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.875])
def test_compressed_kv_equals_the_library_compressed_cache(arm, ratio):
    from qfilters_mlx.cache.compression import compress_caches
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import CompressOnce, KVCacheConfig

    model, filters = tiny_model(), _filters()
    _, _, c, _ = _sample()
    kv = _prefill_kv(model, c)
    a = arm_by_name(arm)
    got = compressed_kv(a, ratio, kv, calibrated=filters, seed=5)
    cfg = KVCacheConfig(method=a.method, mode=CompressOnce(ratio=ratio, at="manual"), qfilters_n_sink=a.n_sink,
                        qfilters_recent=0, qfilters_sign=1, qfilters_filter_source="keys", qfilters_seed=5)
    caches = [QFiltersKVCache(cfg, layer_idx=i, filters=filters[i] if arm == "qfilters" else None)
              for i in range(2)]
    for i in range(0, len(c), CHUNK):
        model(mx.array(c[i:i + CHUNK])[None], cache=caches)
    compress_caches(caches)
    for (k, v), cache in zip(got, caches):
        n = cache.size()
        assert k.shape == (1, 2, max(1, int(len(c) * (1 - ratio))), 16) and k.shape[2] == n
        assert mx.array_equal(k, cache.keys[:, :, :n]) and mx.array_equal(v, cache.values[:, :, :n])


# --------------------------------------------------------------- forced scores, exactly
def test_full_row_loglik_equals_one_plain_model_call():
    """The runner's teacher-forced log-likelihood of the full cache equals log softmax of one
    model call over context + question + gold answer (no cache, no chunks)."""
    model = tiny_model()
    tok, s, c, q = _sample()
    rec = {"index": 5}
    st = RulerSettings(chunk=CHUNK, calib_tokens=16, ratios=(0.5,), compress_arms=("knorm",), validation_samples=0)
    run_sample(model, tok, rec, c, q, s.outputs, s.max_new_tokens, st)
    ans, spans = gold_answer(tok, s.outputs)
    ids = c + q + ans
    ref = _log_softmax_at(model(mx.array(ids[:-1])[None])[0, len(c) + len(q) - 1:], ans)
    assert rec["forced"]["full"]["tokens"] == len(ans)
    assert rec["forced"]["full"]["loglik"] == pytest.approx(float(ref.sum()), rel=1e-3)
    # a sample outside the validation subset: greedy for the full cache only
    assert set(rec["answers"]) == {"full"} and set(rec["forced"]) == {"full", "compress_once/knorm@0.5"}
    assert rec["full_correct"] == (rec["scores"]["full"] == 1.0)


@pytest.mark.parametrize("arm, method, n_sink", [("knorm", "l2norm", 0), ("qfilters", "qfilters", 0),
                                                 ("streaming_llm", "streaming_llm", 4)])
def test_compressed_row_loglik_equals_the_library_cache(arm, method, n_sink):
    from qfilters_mlx.cache.compression import compress_caches
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import CompressOnce, KVCacheConfig

    model, filters = tiny_model(), _filters()
    tok, s, c, q = _sample()
    rec = {"index": 3}
    st = RulerSettings(chunk=CHUNK, calib_tokens=16, ratios=(0.5,), compress_arms=(arm,), validation_samples=0)
    run_sample(model, tok, rec, c, q, s.outputs, s.max_new_tokens, st, calibrated=filters)
    cfg = KVCacheConfig(method=method, mode=CompressOnce(ratio=0.5, at="manual"), qfilters_n_sink=n_sink,
                        qfilters_recent=0, qfilters_sign=1, qfilters_filter_source="keys")
    caches = [QFiltersKVCache(cfg, layer_idx=i, filters=filters[i] if method == "qfilters" else None)
              for i in range(2)]
    for i in range(0, len(c), CHUNK):
        model(mx.array(c[i:i + CHUNK])[None], cache=caches)
    compress_caches(caches)
    ans, _ = gold_answer(tok, s.outputs)
    ref = _log_softmax_at(model(mx.array(q + ans[:-1])[None], cache=caches)[0, len(q) - 1:], ans)
    got = rec["forced"][f"compress_once/{arm}@0.5"]
    assert got["loglik"] == pytest.approx(float(ref.sum()), rel=1e-3)
    assert rec["kept"][f"compress_once/{arm}@0.5"] == int(0.5 * len(c))


@pytest.mark.parametrize("arm, method", [("streaming_llm", "streaming_llm"), ("qfilters", "qfilters")])
def test_forked_streaming_row_equals_the_library_streaming_cache_fed_from_the_start(arm, method):
    """A forked row's teacher-forced log-likelihood and greedy answer equal those of the library's
    streaming caches fed the whole prompt in the run's chunks, then the answer in one call."""
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import KVCacheConfig

    model, filters = tiny_model(), _filters()
    tok, s, c, q = _sample()
    rec = {"index": 0}
    st = RulerSettings(chunk=CHUNK, calib_tokens=16, ratios=(0.75,), protocols=("streaming",), compress_arms=(),
                       streaming_arms=(arm,), streaming_samples="all")
    run_sample(model, tok, rec, c, q, s.outputs, s.max_new_tokens, st, calibrated=filters)
    budget = int(0.25 * len(c))
    assert fork_point(budget, len(c), CHUNK) > 0
    cfg = KVCacheConfig(method=method, qfilters_budget=budget, qfilters_sign=1, qfilters_filter_source="keys")
    f = filters if method == "qfilters" else [None, None]
    caches = [QFiltersKVCache(cfg, layer_idx=i, filters=f[i]) for i in range(2)]
    prompt = c + q
    for i in range(0, len(prompt), CHUNK):
        last = model(mx.array(prompt[i:i + CHUNK])[None], cache=caches)[0, -1:]
    ans, _ = gold_answer(tok, s.outputs)
    import copy

    snap = copy.deepcopy(caches)
    rest = model(mx.array(ans[:-1])[None], cache=caches)[0]
    ref = _log_softmax_at(mx.concatenate([last, rest], axis=0), ans)
    key = f"streaming/{arm}@0.75"
    assert rec["forced"][key]["loglik"] == pytest.approx(float(ref.sum()), rel=1e-3)
    ids, logits = [], last[0]
    for _ in range(s.max_new_tokens):
        t = int(mx.argmax(logits).item())
        if t == EOS:
            break
        ids.append(t)
        logits = model(mx.array([[t]]), cache=snap)[0, -1]
    assert rec["answers"][key] == tok.decode(ids)


def test_forked_row_takes_the_prefill_up_to_its_fork():
    model = tiny_model()
    _, _, c, _ = _sample()
    kv = _prefill_kv(model, c)
    row, fork = forked_row(arm_by_name("streaming_llm"), 0.75, kv, len(c), CHUNK, 16)
    budget = int(0.25 * len(c))
    assert fork == fork_point(budget, len(c), CHUNK) and row[0].offset == fork and row[0].size() == budget
    row, fork = forked_row(arm_by_name("qfilters_online"), 0.75, kv, len(c), CHUNK, 16, calib_tokens=16)
    assert fork == 0 and row[0].offset == 0


# ------------------------------------------------------- agreement where greedy is forced
def bigram_model(nxt: dict[int, int], seed: int = 0):
    """A 2-layer llama whose attention and MLP outputs are zero, so its hidden state is the
    normalised embedding of the current token, with an LM head that scores ``nxt[x]`` highest
    after token ``x``: greedy decoding follows ``nxt`` whatever the cache holds."""
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           head_dim=16, tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    e = np.asarray(model.model.embed_tokens.weight)
    e = e / np.sqrt((e**2).mean(-1, keepdims=True))
    w = np.zeros((VOCAB, 64), np.float32)
    for x, y in nxt.items():
        w[y] += e[x]
    model.lm_head.weight = mx.array(2.0 * w)
    mx.eval(model.parameters())
    return model


def test_forced_and_greedy_scoring_agree_where_the_answer_is_forced():
    """After the answer prefix (ending in "are"), the bigram model writes " 73." and ends: the
    expected "73" is found by both scorings in every row, "74" by neither; teacher forcing's
    log-likelihood is the sum of the greedy path's log-probabilities (one plain call)."""
    chain = {ord("e"): ord(" "), ord(" "): ord("7"), ord("7"): ord("3"), ord("3"): ord("."), ord("."): EOS}
    model = bigram_model(chain)
    tok, s, c, q = _sample()
    assert tok.decode(q).endswith("are")
    full = model(mx.array(c + q)[None])[0, -1]
    assert int(mx.argmax(full).item()) == ord(" ")  # the forced path starts where the prefix ends
    st = RulerSettings(chunk=CHUNK, calib_tokens=16, ratios=(0.5, 0.875), protocols=("compress_once", "streaming"),
                       compress_arms=("knorm", "streaming_llm"), streaming_arms=("streaming_llm",),
                       validation_samples=1)
    for outputs, expect in ((("73",), 1.0), (("74",), 0.0)):
        rec = {"index": 0}
        run_sample(model, tok, rec, c, q, outputs, 8, st)
        keys = set(rec["forced"])
        assert len(keys) == 1 + 2 * 2 + (2 if expect == 1.0 else 0)  # streaming only if the full cache is right
        assert keys == set(rec["answers"])
        for key in keys:
            assert rec["answers"][key] == (" 73" if expect else " 73.")  # decoding stops once "73" is written
            assert rec["scores"][key] == expect and rec["forced"][key]["match"] == expect, key
        ans, _ = gold_answer(tok, outputs)
        ref = _log_softmax_at(model(mx.array(c + q + ans[:-1])[None])[0, len(c) + len(q) - 1:], ans)
        assert rec["forced"]["full"]["loglik"] == pytest.approx(float(ref.sum()), rel=1e-4)
