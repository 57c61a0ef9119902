"""Quantized storage: the build option ``kv_bits`` (``QuantizedQFiltersKVCache``) / ``to_quantized``.

References: the unquantized cache (same kept set, rows quantized with ``mx.quantize``),
mlx-lm's ``QuantizedKVCache`` (logits bit for bit when nothing is evicted) and mlx-lm's own
``generate_step(kv_bits=...)`` path (``maybe_quantize_kv_cache`` -> ``to_quantized``).
"""

import copy
import pickle

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache, observe_queries
from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache
from qfilters_mlx.config import METHODS

D = 64
CHUNKS = [10, 30, 1, 1, 1, 7, 1, 1, 1, 1, 25] + [1] * 12  # prefill, decode, a chunk, decode


def config(method="qfilters", **kw):
    base = dict(method=method, qfilters_budget=24, qfilters_n_sink=2, qfilters_recent=6,
                qfilters_calib_tokens=16, qfilters_filter_source="keys", qfilters_sign=-1)
    return KVCacheConfig(**{**base, **kw})


def rand_kv(seed, T, H=2, dtype=mx.float16):
    mx.random.seed(seed)
    return (mx.random.normal((1, H, T, D)).astype(dtype), mx.random.normal((1, H, T, D)).astype(dtype))


def qdq(x, bits, g=64):
    """The quantize/dequantize round trip mlx-lm's QuantizedKVCache applies to a row."""
    return mx.dequantize(*mx.quantize(x, group_size=g, bits=bits), group_size=g, bits=bits)


def feed(caches, k, v, chunks=CHUNKS):
    """Feed the same chunks to every cache; yield each call's outputs."""
    t = 0
    for L in chunks:
        yield [c.update_and_fetch(k[:, :, t:t + L], v[:, :, t:t + L]) for c in caches]
        t += L


# ------------------------------------------------------------ kept set and rows
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("method", METHODS)
def test_kept_set_and_rows_equal_the_unquantized_cache(method, bits):
    """Every call: the quantized cache returns mlx-lm's quantized triples whose dequantized
    rows equal quantize/dequantize of what the unquantized cache returns (same rows, same
    order, slot mode included); after prefill and decode past several evictions the kept
    positions are the same."""
    k, v = rand_kv(1, sum(CHUNKS))
    plain, quant = QFiltersKVCache(config(method)), QuantizedQFiltersKVCache(config(method), bits=bits)
    assert type(quant) is QuantizedQFiltersKVCache and not hasattr(plain, "bits")
    for (kp, vp), (kq, vq) in feed([plain, quant], k, v):
        assert len(kq) == 3 and kq[0].dtype == mx.uint32 and kq[1].dtype == mx.float16
        for full, packed in ((kp, kq), (vp, vq)):
            got = mx.dequantize(*packed, group_size=64, bits=bits)
            assert mx.array_equal(got, qdq(full, bits)).item()
    if method != "full":
        assert plain.evicted and quant.evicted and quant.size() == 24
    np.testing.assert_array_equal(np.array(plain.kept_positions()), np.array(quant.kept_positions()))
    kept_k = plain.state[0]
    stored = quant.storage.unpack(quant.state[0], 0)
    assert mx.array_equal(mx.dequantize(*stored, group_size=64, bits=bits), qdq(kept_k, bits)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128])
def test_other_dtypes_and_group_sizes(dtype, group_size):
    k, v = rand_kv(2, sum(CHUNKS), dtype=dtype)
    k = mx.concatenate([k, k], axis=-1)  # D = 128
    v = mx.concatenate([v, v], axis=-1)
    plain = QFiltersKVCache(config())
    quant = QuantizedQFiltersKVCache(config(), bits=4, group_size=group_size)
    for (kp, _), (kq, _) in feed([plain, quant], k, v):
        ref = mx.dequantize(*mx.quantize(kp, group_size=group_size, bits=4), group_size=group_size, bits=4)
        assert mx.array_equal(mx.dequantize(*kq, group_size=group_size, bits=4), ref).item()
    np.testing.assert_array_equal(np.array(plain.kept_positions()), np.array(quant.kept_positions()))


def test_trim_back_into_calibration_recalibrates_from_full_precision_keys():
    """Before the first eviction a trim below calib_tokens drops the filter; the quantized
    cache re-estimates it from its full-precision keys exactly as the unquantized one."""
    k, v = rand_kv(3, 80)
    plain, quant = QFiltersKVCache(config(qfilters_budget=40)), QuantizedQFiltersKVCache(config(qfilters_budget=40), bits=8)
    list(feed([plain, quant], k, v, [20]))
    assert quant.filter is not None and plain.trim(8) == quant.trim(8) == 8 and quant.filter is None
    list(feed([plain, quant], k[:, :, 12:], v[:, :, 12:], [10, 30] + [1] * 10))
    assert quant.evicted and quant.storage.fp_keys is None
    np.testing.assert_array_equal(np.array(plain.kept_positions()), np.array(quant.kept_positions()))
    assert mx.array_equal(plain.filter, quant.filter).item()



def test_full_precision_keys_are_held_only_until_calibration_and_dropped_at_eviction():
    """The quantized cache holds the full-precision keys of the first ``calib_tokens`` tokens
    (bit for bit the inputs) from calibration until the first eviction, and no others: not
    those of calls after calibration, not any once rows were evicted (``storage.nbytes``)."""
    k, v = rand_kv(5, 80)
    quant = QuantizedQFiltersKVCache(config(qfilters_budget=40), bits=8)
    list(feed([quant], k, v, [10, 10]))  # crosses calib_tokens=16 at the second call
    held = quant.storage.fp_keys
    assert quant.filter is not None and held.shape[2] == 16 and mx.array_equal(held, k[:, :, :16]).item()
    list(feed([quant], k[:, :, 20:], v[:, :, 20:], [5]))  # scored at insertion: nothing more held
    assert quant.size() == 25 and not quant.evicted
    assert mx.array_equal(quant.storage.fp_keys, k[:, :, :16]).item()
    assert quant.storage.nbytes == k[:, :, :16].nbytes
    list(feed([quant], k[:, :, 25:], v[:, :, 25:], [20, 1, 3]))  # evicts; a step; a chunk
    assert quant.evicted and quant.storage.fp_keys is None and quant.storage.nbytes == 0

# ------------------------------------------------------------------- bytes
def test_nbytes_counts_packed_scales_and_biases():
    """method='full' stores what QuantizedKVCache stores (same 256-row blocks): its K/V bytes
    equal QuantizedKVCache.nbytes; the eviction cache holds about bits/16 of the float16 bytes."""
    k, v = rand_kv(4, 300)
    ours, theirs = QuantizedQFiltersKVCache(config("full"), bits=4), QuantizedKVCache(group_size=64, bits=4)
    for t, L in ((0, 256), (256, 44)):
        ours.update_and_fetch(k[:, :, t:t + L], v[:, :, t:t + L])
        theirs.update_and_fetch(k[:, :, t:t + L], v[:, :, t:t + L])
    assert ours.keys.shape[2] == theirs.keys[0].shape[2] == 512
    assert ours.nbytes - ours.scores.nbytes - ours.positions.nbytes == theirs.nbytes
    per_row = 2 * 2 * (D * 4 // 8 + 2 * 2)  # K and V, H=2: packed bytes + fp16 scale + bias
    assert ours.full_seq_bytes == per_row * 300 and ours.qfilters_kept_bytes == per_row * 300


# ---------------------------------------------------- model: logits bit for bit
def tiny_llama(seed=0):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=D, rms_norm_eps=1e-5,
                           vocab_size=61, rope_theta=10000.0, tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


MODEL = tiny_llama()
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 61, 40)]


def logits_run(caches, chunks=(25, 15), steps=12):
    """Prefill PROMPT in ``chunks``, then greedy decode: every call's last logits (numpy)."""
    out, t = [], 0
    for L in chunks:
        logits = MODEL(mx.array(PROMPT[t:t + L], mx.uint32)[None], cache=caches)
        out.append(np.array(logits[0, -1].astype(mx.float32)))
        t += L
    for _ in range(steps):
        y = int(np.argmax(out[-1]))
        out.append(np.array(MODEL(mx.array([[y]], mx.uint32), cache=caches)[0, -1].astype(mx.float32)))
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("method", ["qfilters", "full"])
def test_logits_equal_mlx_lm_quantized_kv_cache(method, bits):
    """Budget >= length: the logits of every call equal those with mlx-lm's QuantizedKVCache."""
    ours = KVCacheBuilder.for_model(MODEL, config(method, qfilters_budget=64), kv_bits=bits)
    theirs = [QuantizedKVCache(group_size=64, bits=bits) for _ in ours]
    a, b = logits_run(ours), logits_run(theirs)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("start", [0, 30])
def test_mlx_lm_generate_step_kv_bits_uses_to_quantized(start):
    """mlx-lm's own path: generate_step(kv_bits=8) converts our caches with to_quantized
    (maybe_quantize_kv_cache) and yields the log-probabilities of its own caches."""
    ours = KVCacheBuilder.for_model(MODEL, config(qfilters_budget=64))
    theirs = make_prompt_cache(MODEL)
    prompt = mx.array(PROMPT, mx.uint32)
    kw = dict(max_tokens=10, kv_bits=8, kv_group_size=64, quantized_kv_start=start, prefill_step_size=16)
    a = [np.array(lp) for _, lp in generate_step(prompt, MODEL, prompt_cache=ours, **kw)]
    b = [np.array(lp) for _, lp in generate_step(prompt, MODEL, prompt_cache=theirs, **kw)]
    assert all(type(c) is QuantizedQFiltersKVCache for c in ours)
    assert all(type(c) is QuantizedKVCache for c in theirs)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_query_filter_kept_set_equals_unquantized_on_a_model():
    """The paper's query filter (observe_queries) with kv_bits: same filter and kept set
    after the prefill as without quantization (attention differs afterwards)."""
    cfg = dict(qfilters_filter_source="queries", qfilters_sign=None, qfilters_budget=16)
    kept = []
    for bits in (None, 4):
        caches = KVCacheBuilder.for_model(MODEL, config(**cfg), kv_bits=bits)
        with observe_queries(MODEL, caches):
            MODEL(mx.array(PROMPT[:20], mx.uint32)[None], cache=caches)
            MODEL(mx.array(PROMPT[20:], mx.uint32)[None], cache=caches)
        assert all(c.evicted for c in caches)
        kept.append([np.array(c.kept_positions()) for c in caches])
    for x, y in zip(*kept):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------ save/load, copies
@pytest.mark.parametrize("when", [8, 30, 44])  # before calibration, after eviction, in slot mode
def test_save_load_continues_bit_for_bit(tmp_path, when):
    k, v = rand_kv(5, 90)
    a = QuantizedQFiltersKVCache(config(), bits=4)
    list(feed([a], k, v, [when]))
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [a])
    (b,) = load_prompt_cache(path)
    assert type(b) is QuantizedQFiltersKVCache and b.offset == a.offset
    for (ka, va), (kb, vb) in feed([a, b], k[:, :, when:], v[:, :, when:], [1] * 6 + [9] + [1] * 5):
        for x, y in zip((*ka, *va), (*kb, *vb)):
            assert mx.array_equal(x, y).item()
    np.testing.assert_array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_are_independent_and_continue_bit_for_bit(how):
    k, v = rand_kv(6, 90)
    a = QuantizedQFiltersKVCache(config(), bits=8)
    list(feed([a], k, v, [30, 1, 1, 1]))
    b = copy.deepcopy(a) if how == "deepcopy" else pickle.loads(pickle.dumps(a))
    before = [np.array(x) for x in a.state[:4]]
    runs = [list(feed([c], k[:, :, 33:], v[:, :, 33:], [1] * 8)) for c in (b,)]
    assert all(np.array_equal(x, np.array(y)) for x, y in zip(before, a.state[:4]))  # a untouched
    for (out_b,), (out_a,) in zip(runs[0], feed([a], k[:, :, 33:], v[:, :, 33:], [1] * 8)):
        for x, y in zip((*out_a[0], *out_a[1]), (*out_b[0], *out_b[1])):
            assert mx.array_equal(x, y).item()


def test_to_quantized_continues_like_a_cache_built_quantized():
    """to_quantized mid-decode (slot mode) equals a cache built with kv_bits, fed the same."""
    k, v = rand_kv(7, 80)
    plain, built = QFiltersKVCache(config()), QuantizedQFiltersKVCache(config(), bits=4)
    list(feed([plain, built], k, v, [30, 1, 1]))
    conv = plain.to_quantized(group_size=64, bits=4)
    assert type(conv) is QuantizedQFiltersKVCache and conv.to_quantized(64, 4) is conv
    for (kb, vb), (kc, vc) in feed([built, conv], k[:, :, 32:], v[:, :, 32:], [1] * 6 + [5] + [1] * 4):
        for x, y in zip((*kb, *vb), (*kc, *vc)):
            assert mx.array_equal(x, y).item()
    assert conv.nbytes == built.nbytes


@pytest.mark.parametrize("fed, source", [(10, "keys"), (20, "keys"), (20, "calibrated")])
def test_to_quantized_before_the_first_eviction_continues_like_a_cache_built_quantized(fed, source):
    """Converted before calibration (10 of 16 tokens), after it (20) or with a fixed filter: the
    converted cache holds the same full-precision keys as one built with kv_bits (all before
    calibration, the first 16 after, none with a fixed filter), estimates the same filter, and
    continues bit for bit, also through a trim back into calibration."""
    k, v = rand_kv(9, 80)
    f = mx.array(np.random.default_rng(9).standard_normal((2, D)).astype(np.float32))
    kw = dict(qfilters_filter_source=source, qfilters_sign=None if source == "calibrated" else -1)
    filters = f if source == "calibrated" else None
    plain = QFiltersKVCache(config(**kw), filters=filters)
    built = QuantizedQFiltersKVCache(config(**kw), filters=filters, bits=8)
    list(feed([plain, built], k, v, [fed]))
    conv = plain.to_quantized(group_size=64, bits=8)
    held = built.storage.fp_keys
    assert (conv.storage.fp_keys is None) == (held is None) and conv.storage.nbytes == built.storage.nbytes
    if held is not None:
        assert mx.array_equal(conv.storage.fp_keys, held).item()
    if source == "keys" and fed > 16:
        assert conv.trim(8) == built.trim(8) == 8 and conv.filter is None  # back into calibration
        start = fed - 8
    else:
        start = fed
    for (kb, vb), (kc, vc) in feed([built, conv], k[:, :, start:], v[:, :, start:], [12, 30, 1, 1, 5]):
        for x, y in zip((*kb, *vb), (*kc, *vc)):
            assert mx.array_equal(x, y).item()
    assert mx.array_equal(conv.filter, built.filter).item() and conv.nbytes == built.nbytes


def test_from_cache_defaults_are_mlx_lm_s_to_quantized_defaults():
    import inspect

    from mlx_lm.models.cache import KVCache

    want = {n: p.default for n, p in inspect.signature(KVCache.to_quantized).parameters.items() if n != "self"}
    k, v = rand_kv(10, 20)
    plain = QFiltersKVCache(config())
    plain.update_and_fetch(k, v)
    conv = QuantizedQFiltersKVCache.from_cache(plain)
    assert {"group_size": conv.group_size, "bits": conv.bits} == want


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw, match", [
    (dict(bits=3), "kv_bits must be None or one of"),
    (dict(bits=16), "kv_bits must be None or one of"),
    (dict(bits=4, group_size=48), "kv_group_size must be one of"),
    (dict(bits=4, head_dim=96), r"head_dim \(96\) must be a multiple of kv_group_size \(64\)"),
    (dict(bits=8, max_rewind=4), "kv_bits=8 needs .*max_rewind=0"),
])
def test_build_option_errors_name_the_option(kw, match):
    head_dim = kw.pop("head_dim", None)
    with pytest.raises(ValueError, match=match):
        QuantizedQFiltersKVCache(config(head_dim=head_dim), **kw)
    if head_dim is None:  # (the model's head_dim is 64)
        with pytest.raises(ValueError, match=match):
            KVCacheBuilder.for_model(MODEL, config(), kv_bits=kw["bits"],
                                     kv_group_size=kw.get("group_size"), max_rewind=kw.get("max_rewind"))
    with pytest.raises(TypeError, match="kv_bits must be an int"):
        QuantizedQFiltersKVCache(config(), bits="4")


def test_runtime_errors_are_clear_and_change_nothing():
    with pytest.raises(ValueError, match="QuantizedQFiltersKVCache needs .*bits"):
        QuantizedQFiltersKVCache(config())
    for make in (lambda: QuantizedQFiltersKVCache(config(head_dim=96), bits=4),
                 lambda: QuantizedQFiltersKVCache.from_cache(QFiltersKVCache(config(head_dim=96)), 64, 4)):
        with pytest.raises(ValueError, match=r"head_dim \(96\) must be a multiple of kv_group_size \(64\)"):
            make()
    c = QuantizedQFiltersKVCache(config(), bits=4)
    with pytest.raises(ValueError, match="keys head_dim 48 is not a multiple of kv_group_size 64"):
        c.update_and_fetch(mx.zeros((1, 2, 3, 48)), mx.zeros((1, 2, 3, 48)))
    assert c.empty() and c.offset == 0
    with pytest.raises(ValueError, match="values head_dim 40 is not a multiple of kv_group_size 64"):
        c.update_and_fetch(mx.zeros((1, 2, 3, D)), mx.zeros((1, 2, 3, 40)))
    assert c.empty() and c.offset == 0
    k, v = rand_kv(8, 10)
    c.update_and_fetch(k, v)
    with pytest.raises(ValueError, match="cannot requantize to 8, 64"):
        c.to_quantized(group_size=64, bits=8)
    waiting = QFiltersKVCache(config(qfilters_filter_source="queries", qfilters_sign=None))
    with pytest.raises(ValueError, match="before its filter is estimated from queries"):
        waiting.to_quantized(group_size=64, bits=4)
    plain = QFiltersKVCache(config())
    plain.update_and_fetch(k, v)
    with pytest.raises(ValueError, match="saved by another cache class"):
        plain.state = c.state[:7]
    with pytest.raises(ValueError, match="for a QuantizedQFiltersKVCache"):
        c.state = plain.state


# ------------------------------------------------------- evaluation batches
def test_quantized_arms_batch_like_each_alone():
    """QuantizedMultiArmCache: quantized arms of different budgets in one batch give the NLLs
    each gives alone (padding masked); mixing quantized and plain arms is refused."""
    from qfilters_mlx.evaluation.multi_arm import QuantizedMultiArmCache, batch_caches
    from qfilters_mlx.evaluation.perplexity import batched_streaming_nll

    def row(budget, bits=8):
        cfg = config(qfilters_budget=budget, qfilters_recent=4)
        return KVCacheBuilder.for_model(MODEL, cfg, kv_bits=bits)

    rows = [row(20), row(32)]
    assert all(type(c) is QuantizedMultiArmCache and c.bits == 8 for c in batch_caches(rows))
    batched = batched_streaming_nll(MODEL, PROMPT, rows, prefix=8)
    for budget, got in zip((20, 32), batched):
        alone = batched_streaming_nll(MODEL, PROMPT, [row(budget)], prefix=8)[0]
        np.testing.assert_allclose(got, alone, atol=2e-3, rtol=2e-3)  # float16 model, batched matmuls
    with pytest.raises(ValueError, match="cannot share a batch"):
        batch_caches([row(20), KVCacheBuilder.for_model(MODEL, config())])
    with pytest.raises(ValueError, match="one kv_bits/kv_group_size"):
        batch_caches([row(20), row(20, bits=4)])


@pytest.mark.parametrize("dk, dv, group_size", [(64, 32, 32), (32, 64, 32), (128, 64, 64)])
def test_save_load_with_other_key_and_value_widths_and_groups(tmp_path, dk, dv, group_size):
    """Keys and values of different widths (MLA-style heads), groups smaller than a row: the
    loaded cache holds the same rows (``mx.dequantize`` of each) and continues bit for bit."""
    mx.random.seed(dk + dv)
    k = mx.random.normal((1, 2, 60, dk)).astype(mx.float16)
    v = mx.random.normal((1, 2, 60, dv)).astype(mx.float16)
    a = QuantizedQFiltersKVCache(config(), bits=4, group_size=group_size)
    list(feed([a], k, v, [40]))
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [a])
    (b,) = load_prompt_cache(path)
    for x, y in zip(a.state, b.state):
        assert (x is None and y is None) or isinstance(x, str) or mx.array_equal(x, y).item()
    for (ka, va), (kb, vb) in feed([a, b], k[:, :, 40:], v[:, :, 40:], [1] * 8 + [4]):
        for x, y in zip((*ka, *va), (*kb, *vb)):
            assert mx.array_equal(x, y).item()


def test_an_empty_quantized_cache_saves_and_loads_and_a_bad_row_format_is_refused():
    import json

    empty = QuantizedQFiltersKVCache(config(), bits=4).state
    assert json.loads(empty[6])["kv_format"] is None
    assert QuantizedQFiltersKVCache.from_state(empty).empty()
    k, v = rand_kv(3, 30)
    a = QuantizedQFiltersKVCache(config(), bits=4, group_size=32)
    list(feed([a], k, v, [30]))
    s = list(a.state)
    meta = json.loads(s[6])
    assert meta["kv_format"] == [D, D, "float16"]
    for fmt, message in (([D, D, "float99"], r"^state: bad meta \(dtype 'float99'\)$"),
                         ([D], r"^state: bad meta"),
                         ([D, D // 2, "float16"], r"^state: stored rows .* do not match kv_format"),
                         ([D // 2, D, "float16"], r"^state: stored rows .* do not match kv_format"),
                         (None, r"^state: meta 'kv_format' must be given exactly when rows are$")):
        bad = [*s[:6], json.dumps({**meta, "kv_format": fmt}), *s[7:]]
        with pytest.raises(ValueError, match=message):
            QuantizedQFiltersKVCache.from_state(bad)
    for change, message in ((dict(kv_bits=None), r"^state: stored rows without kv_bits"),
                            (dict(kv_bits="4"), r"^state: bad meta \(kv_bits must be an int"),
                            (dict(kv_bits=7), r"^state: bad meta \(kv_bits must be None or one of"),
                            (dict(kv_group_size="32"), r"^state: bad meta \(kv_group_size must be an int"),
                            (dict(kv_group_size=0), r"^state: bad meta \(kv_group_size must be >= 1, got 0\)$"),
                            (dict(kv_group_size=1), r"^state: bad meta \(kv_group_size must be one of"),
                            (dict(kv_group_size=64), r"^state: stored rows .* do not match kv_format"),
                            (dict(zzz=1), r"^state: bad meta \(saved build options \['zzz'\] are not "
                                          r"options \(known: \['backend', 'max_rewind', 'kv_bits', "
                                          r"'kv_group_size'\]\)\)$"),
                            (dict(max_rewind=4), r"^state: bad meta \(kv_bits=4 needs max_rewind=0")):
        bad = [*s[:6], json.dumps({**meta, "build": {**meta["build"], **change}}), *s[7:]]
        with pytest.raises(ValueError, match=message):
            QuantizedQFiltersKVCache.from_state(bad)
    for i in (0, 1):  # float rows of the stored width: not packed rows
        rows = list(s)
        rows[i] = rows[i].astype(mx.float32)
        with pytest.raises(ValueError, match=r"^state: stored rows .* do not match kv_format"):
            QuantizedQFiltersKVCache.from_state(rows)


@pytest.mark.parametrize("dk, dv", [(48, 64), (64, 48)])
def test_from_cache_refuses_key_or_value_widths_that_are_not_whole_groups(dk, dv):
    mx.random.seed(1)
    c = QFiltersKVCache(config())
    c.update_and_fetch(mx.random.normal((1, 2, 20, dk)), mx.random.normal((1, 2, 20, dv)))
    with pytest.raises(ValueError, match=rf"^head_dim \({dk}, {dv}\) is not a multiple of kv_group_size 32$"):
        QuantizedQFiltersKVCache.from_cache(c, group_size=32, bits=4)


def test_nbytes_counts_the_full_precision_keys_held_until_the_first_eviction():
    """Before its first eviction a quantized cache whose filter is estimated from keys also
    holds those keys at full precision: ``nbytes`` is every array it holds, those included."""
    k, v = rand_kv(6, 40)
    c = QuantizedQFiltersKVCache(config(qfilters_calib_tokens=16, qfilters_budget=64), bits=4)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    held = c.storage.fp_keys
    assert held is not None and held.shape[2] == 16 and not c.evicted
    arrays = (c.keys, c.values, c.scores, c.positions, c.filter, held)
    assert c.nbytes == sum(a.nbytes for a in arrays)


def test_fetched_rows_dequantize_to_each_input_row_at_its_own_width():
    """What attention reads: keys and values of different widths each come back as
    ``mx.quantize``'s (packed, scales, biases) of their own rows."""
    mx.random.seed(9)
    k = mx.random.normal((1, 2, 20, 64)).astype(mx.float16)
    v = mx.random.normal((1, 2, 20, 32)).astype(mx.float16)
    c = QuantizedQFiltersKVCache(config(), bits=4, group_size=32)
    ks, vs = c.update_and_fetch(k, v)  # 20 < budget: every row is returned
    assert mx.array_equal(mx.dequantize(*ks, group_size=32, bits=4), qdq(k, 4, 32)).item()
    assert mx.array_equal(mx.dequantize(*vs, group_size=32, bits=4), qdq(v, 4, 32)).item()


def test_a_filter_estimated_from_keys_fed_one_token_at_a_time_equals_the_unquantized_caches():
    """The full-precision keys held before calibration keep every row (calls of one token
    from the first on): the filter is the unquantized cache's, bit for bit."""
    k, v = rand_kv(10, 20)
    cfg = config(qfilters_calib_tokens=8)
    q, plain = QuantizedQFiltersKVCache(cfg, bits=4), QFiltersKVCache(cfg)
    list(feed([q, plain], k, v, [1] * 10))
    assert q.filter is not None
    assert mx.array_equal(q.filter, plain.filter).item()
