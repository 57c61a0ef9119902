"""Copies and files: deepcopy/pickle, prompt-cache files, LRUPromptCache, kv_bits."""

import copy
import pickle
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache, save_prompt_cache

from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.backends.dispatch import get_backend


def available_backends():
    out = []
    for name in ("reference", "cpp", "metal"):
        try:
            get_backend(name)
        except ValueError:
            continue
        out.append(name)
    return out


def config(method="qfilters", **kw):
    base = dict(method=method, qfilters_budget=12, qfilters_n_sink=2, qfilters_recent=2,
                qfilters_calib_tokens=8, qfilters_filter_source="keys")
    return KVCacheConfig(**{**base, **kw})


def rand_kv(seed, T=80, H=2, D=8):
    mx.random.seed(seed)
    return mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D))


def run(c, k, v, lo, hi):
    """Feed tokens lo..hi-1 one at a time; the returned keys/values of every step, as numpy."""
    return [tuple(np.array(a) for a in c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1]))
            for t in range(lo, hi)]


def assert_runs_equal(a, b):
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a, b):
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)


# ------------------------------------------------------------ deepcopy / pickle
@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_are_independent_and_continue_bit_for_bit(backend, how):
    k, v = rand_kv(1)
    c = QFiltersKVCache(config(), layer_idx=1, backend=backend, max_rewind=16)
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    run(c, k, v, 30, 40)  # mid-decode: slot mode, journal filled
    d = copy.deepcopy(c) if how == "deepcopy" else pickle.loads(pickle.dumps(c))
    assert type(d) is QFiltersKVCache and d.backend.name == c.backend.name == get_backend(backend).name
    assert d.config == c.config and d.offset == c.offset and d.keys is not c.keys
    twin = copy.deepcopy(c)
    out_c = run(c, k, v, 40, 60)
    c.trim(5)  # the original rewinds: the copy must not see it
    out_d = run(d, k, v, 40, 60)
    assert_runs_equal(out_c, out_d)
    assert d.offset == 60 and c.offset == 55
    assert d.trim(5) == 5  # the copy's journal is its own
    assert_runs_equal(run(c, k, v, 55, 60), run(d, k, v, 55, 60))
    assert_runs_equal(run(twin, k, v, 40, 45), out_c[:5])


def test_deepcopy_of_a_prompt_cache_list_with_the_cpp_backend():
    """What mlx_lm.server does on every request sharing a prefix."""
    if "cpp" not in available_backends():
        pytest.skip("the compiled extension is not installed")
    k, v = rand_kv(2)
    caches = [QFiltersKVCache(config(), i, backend="cpp", max_rewind=16) for i in range(2)]
    for c in caches:
        c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    copies = copy.deepcopy(caches)
    for a, b in zip(caches, copies):
        assert_runs_equal(run(a, k, v, 20, 30), run(b, k, v, 20, 30))


# ----------------------------------------------------------- prompt-cache files
def tiny_llama(seed=0):
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=61, num_key_value_heads=2, rope_theta=10000.0,
                           tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


MODEL = tiny_llama()
CFG = KVCacheConfig(qfilters_budget=12, qfilters_n_sink=2, qfilters_recent=2, qfilters_calib_tokens=8,
                    qfilters_filter_source="keys")


def greedy(caches, first, steps):
    """``steps`` greedy decode steps from token ``first``: (tokens, logits as numpy)."""
    y, toks, logits = first, [], []
    for _ in range(steps):
        out = MODEL(mx.array([[y]], mx.uint32), cache=caches)[0, -1]
        logits.append(np.array(out))
        y = int(mx.argmax(out))
        toks.append(y)
    return toks, logits


def test_saved_mid_decode_reloads_and_continues_bit_for_bit(tmp_path):
    prompt = mx.array(np.random.default_rng(0).integers(0, 61, 30), dtype=mx.uint32)
    caches = KVCacheBuilder.for_model(MODEL, CFG, max_rewind=16)
    MODEL(prompt[None, :-1], cache=caches)
    toks, _ = greedy(caches, int(prompt[-1]), 7)  # slot mode now
    assert all(c._free is not None for c in caches)
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert [type(c) for c in loaded] == [QFiltersKVCache] * 2
    ta, la = greedy(caches, toks[-1], 12)
    tb, lb = greedy(loaded, toks[-1], 12)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    # the journal is not saved: a reloaded cache rewinds only what it saw since
    assert loaded[0].rewindable_tokens == 12 and loaded[0].trim(12) == 12
    with pytest.raises(ValueError, match="loaded from a file"):
        loaded[0].trim(1)


def test_load_prompt_cache_after_plain_import_without_importing_mlx(tmp_path):
    caches = KVCacheBuilder.for_model(MODEL, CFG, max_rewind=16)
    MODEL(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]], mx.uint32), cache=caches)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    code = (
        "import sys, qfilters_mlx\n"
        "assert 'mlx.core' not in sys.modules, 'import qfilters_mlx imported mlx'\n"
        "from mlx_lm.models.cache import load_prompt_cache\n"
        f"c = load_prompt_cache({path!r})\n"
        "print(type(c[0]).__name__, c[0].offset, c[0].size())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["QFiltersKVCache", "15", "12"]


# ------------------------------------------------------------------- kv_bits
def test_kv_bits_with_rewind_is_refused_clearly():
    """kv_bits works (tests/cache/test_quantized.py) but not with a rewind journal (max_rewind 16)."""
    caches = KVCacheBuilder.for_model(MODEL, CFG, max_rewind=16)
    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8], mx.uint32)
    with pytest.raises(ValueError, match="kv_bits=4 needs .*max_rewind=0"):
        list(generate_step(prompt, MODEL, max_tokens=3, prompt_cache=caches, kv_bits=4,
                           quantized_kv_start=0))


# ------------------------------------------------------------- LRUPromptCache
def test_lru_prompt_cache_second_request_sharing_a_prefix():
    """mlx_lm.server: after a first request the cache is stored under its tokens; a second
    request that diverges 3 tokens before the end fetches a deep copy trimmed by 3 (within
    max_rewind): it continues exactly like the first run's cache at that point, and
    the stored entry is unchanged. A divergence deeper than the journal raises clearly."""
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 61, 25)]
    caches = KVCacheBuilder.for_model(MODEL, CFG, max_rewind=16)
    MODEL(mx.array(prompt[:-1], mx.uint32)[None], cache=caches)
    y, tokens, snapshot = prompt[-1], list(prompt), None
    for _ in range(10):  # the first request's decode steps (tokens fed = tokens[:-1])
        if len(tokens) - 1 == 31:
            snapshot = copy.deepcopy(caches)
        out = MODEL(mx.array([[y]], mx.uint32), cache=caches)
        y = int(mx.argmax(out[0, -1]))
        tokens.append(y)
    lru = LRUPromptCache()
    lru.insert_cache("m", tokens[:-1], caches)  # what the cache has seen
    stored = [c.state for c in caches]
    # second request: shares the first 31 tokens of the stored 34, then diverges
    second = tokens[:31] + [5, 6, 7]
    fetched, rest = lru.fetch_nearest_cache("m", second)
    assert rest == second[31:] and [c.offset for c in fetched] == [31, 31]
    ta, la = [], []
    for c_set, out in ((fetched, la), (snapshot, ta)):
        logits = MODEL(mx.array(rest, mx.uint32)[None], cache=c_set)
        out.append(np.array(logits))
        out.append(greedy(c_set, int(mx.argmax(logits[0, -1])), 5)[1])
    np.testing.assert_array_equal(la[0], ta[0])
    for x, z in zip(la[1], ta[1]):
        np.testing.assert_array_equal(x, z)
    for c, st in zip(lru.fetch_nearest_cache("m", tokens[:-1])[0], stored):  # entry unchanged
        for a, b in zip(c.state[:4], st[:4]):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    with pytest.raises(ValueError, match="cannot rewind"):
        lru.fetch_nearest_cache("m", tokens[:10] + [1, 2])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_cache_waiting_for_queries_is_not_observed(how):
    """A copy is not the cache an observe_queries block registered: its first update outside one
    raises (never grows unobserved), like a fresh cache's."""
    c = QFiltersKVCache(KVCacheConfig(qfilters_budget=12, qfilters_n_sink=2, qfilters_calib_tokens=8,
                                      qfilters_filter_source="queries"))
    k = mx.array(np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32))
    c.queries_observed = True  # as inside observe_queries
    c.update_and_fetch(k, k)
    twin = copy.deepcopy(c) if how == "deepcopy" else pickle.loads(pickle.dumps(c))
    assert c.queries_observed and not twin.queries_observed
    with pytest.raises(ValueError, match="observe_queries"):
        twin.update_and_fetch(k, k)
    assert twin.offset == 4


def test_lru_prompt_cache_with_the_default_depth_falls_back_to_a_stored_prefix():
    """With the default max_rewind="auto" a cache that evicted before anyone asked is_trimmable()
    has no journal and is not trimmable: mlx-lm's
    LRUPromptCache keeps the shorter stored prefix and a diverging request gets a copy of that
    (never a failed request), which continues exactly like the prefix's own cache."""
    cfg = KVCacheConfig(qfilters_budget=12, qfilters_n_sink=2, qfilters_recent=2,
                        qfilters_calib_tokens=8, qfilters_filter_source="keys")
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 61, 20)]
    lru = LRUPromptCache()
    short = KVCacheBuilder.for_model(MODEL, cfg)
    assert short[0].max_rewind == "auto"
    MODEL(mx.array(prompt, mx.uint32)[None], cache=short)
    assert all(c.evicted and not c.is_trimmable() for c in short)
    reference = copy.deepcopy(short)
    lru.insert_cache("m", prompt, short)
    longer = copy.deepcopy(short)
    tokens = prompt + [3, 4, 5, 6]
    MODEL(mx.array(tokens[20:], mx.uint32)[None], cache=longer)
    lru.insert_cache("m", tokens, longer)
    assert len(lru) == 2  # the shorter entry is kept (the longer one cannot be trimmed)
    second = prompt + [9, 9]
    fetched, rest = lru.fetch_nearest_cache("m", second)
    assert rest == [9, 9] and [c.offset for c in fetched] == [20, 20]
    got = MODEL(mx.array(rest, mx.uint32)[None], cache=fetched)
    want = MODEL(mx.array(rest, mx.uint32)[None], cache=reference)
    np.testing.assert_array_equal(np.array(got), np.array(want))
