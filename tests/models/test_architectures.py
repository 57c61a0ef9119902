"""The architecture matrix: every decoder-only module of the installed mlx-lm.

For each ``mlx_lm.models`` module (enumerated by ``pkgutil`` in :mod:`arch_models`,
tiny float32 random weights, seeded): the build either succeeds or is refused at
build time with the cause named; with budget >= length the logits equal those of
the model's own caches bit for bit; with eviction every budgeted cache stays within
budget (+ the call's tokens) and ``offset`` counts the tokens fed; mlx-lm's
``generate_step`` runs; prompt-cache save/load and ``copy.deepcopy`` give the same
next logits; ``filter_source="queries"`` inside ``observe_queries`` evicts or raises.
"""

import copy
import os
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from helpers import arch_matrix, arch_models
from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache, observe_queries
from qfilters_mlx.model_info import default_caches, walk

MODULES = arch_models.decoder_modules()
CHUNKS = [6, 1, 3, 1]  # prefill, decode, a short block, decode
TOKENS = [(5 * i + 3) % arch_models.VOCAB for i in range(40)]
BUDGET = arch_matrix.BUILD_CONFIG.qfilters_budget


@pytest.fixture(scope="module", autouse=True)
def _no_compile():
    """Compiled activations JIT one C++ kernel each on the CPU (seconds per model); the
    comparisons below run both sides with the same setting."""
    mx.disable_compile()
    yield
    mx.enable_compile()


def _row(name):
    return arch_matrix.row(name)


def _built(name):
    r = _row(name)
    if r.status in ("refused", "skipped"):
        pytest.skip(f"{name} {r.status}: {r.why}")
    return arch_matrix.tiny_model(name)


def _ours(c):
    return isinstance(c, QFiltersKVCache)


def _feed(model, caches, chunks=CHUNKS, tokens=TOKENS):
    out, start = [], 0
    for L in chunks:
        out.append(model(mx.array([tokens[start:start + L]]), cache=caches))
        mx.eval(out[-1])
        start += L
    return out


@pytest.mark.parametrize("name", MODULES)
def test_builds_or_refuses_at_build_time(name):
    r = _row(name)
    if r.status == "skipped":
        assert name in arch_models.SKIP or name in arch_models.IMPORT_ERRORS
        return
    model = arch_matrix.tiny_model(name)
    own_plain = [p for p, c in walk(default_caches(model)) if type(c) is KVCache]
    if r.status == "refused":
        with pytest.raises(ValueError) as err:
            KVCacheBuilder.for_model(model, arch_matrix.BUILD_CONFIG)
        if "beyond mlx-lm's cache protocol" in str(err.value):  # the trial forward failed
            assert own_plain and isinstance(err.value.__cause__, (AttributeError, TypeError))
        elif own_plain:  # plain caches refused otherwise: only for a latent (kv_lora_rank) attention
            assert "multi-head latent attention (MLA)" in str(err.value)
            assert any(isinstance(getattr(m, "kv_lora_rank", None), int) for _, m in model.named_modules())
        else:
            assert "no layer stores per-head keys" in str(err.value)
        return
    caches = KVCacheBuilder.for_model(model, arch_matrix.BUILD_CONFIG)
    ours = [p for p, c in walk(caches) if _ours(c)]
    assert ours and set(ours) <= set(own_plain)
    assert ("partial" in repr(caches)) == (r.status == "partial") == (len(ours) < len(list(walk(caches))))


@pytest.mark.parametrize("name", MODULES)
def test_budget_covering_the_sequence_gives_the_models_own_logits(name):
    model = _built(name)
    cfg = KVCacheConfig(qfilters_budget=64, qfilters_recent=0, qfilters_calib_tokens=4, qfilters_filter_source="keys")
    want = _feed(model, default_caches(model))
    got = _feed(model, KVCacheBuilder.for_model(model, cfg))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.array(g), np.array(w))


@pytest.mark.parametrize("name", MODULES)
def test_eviction_keeps_budget_and_offset(name):
    model = _built(name)
    caches = KVCacheBuilder.for_model(model, arch_matrix.BUILD_CONFIG)
    ours = [c for _, c in walk(caches) if _ours(c)]
    start = 0
    for L in [12, 1, 1, 5, 1]:
        model(mx.array([TOKENS[start:start + L]]), cache=caches)
        start += L
        for c in ours:
            mx.eval(c.keys)
            assert c.size() <= BUDGET + L and c.offset == start
    assert all(c.size() <= BUDGET + 1 for c in ours) and any(c.evicted for c in ours)


@pytest.mark.parametrize("name", MODULES)
def test_generate_step_runs(name):
    model = _built(name)
    caches = KVCacheBuilder.for_model(model, arch_matrix.BUILD_CONFIG)
    toks = [int(t) for t, _ in generate_step(mx.array(TOKENS[:12]), model, prompt_cache=caches,
                                             max_tokens=3, prefill_step_size=5)]
    vocab = model(mx.array([[1]]), cache=default_caches(model)).shape[-1]
    assert len(toks) == 3 and all(0 <= t < vocab for t in toks)
    offsets = {c.offset for _, c in walk(caches) if _ours(c)}
    assert len(offsets) == 1 and 12 < offsets.pop() <= 12 + 3  # generate_step feeds ahead by one


def _evicted(name):
    model = _built(name)
    caches = KVCacheBuilder.for_model(model, arch_matrix.BUILD_CONFIG)
    _feed(model, caches, [12, 1, 3])
    return model, caches


def _next_logits(model, caches):
    return np.array(model(mx.array([[7]]), cache=caches))


@pytest.mark.parametrize("name", MODULES)
def test_prompt_cache_file_round_trip(name, tmp_path):
    model, caches = _evicted(name)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c).__name__ for _, c in walk(loaded)] == [type(c).__name__ for _, c in walk(caches)]
    np.testing.assert_array_equal(_next_logits(model, loaded), _next_logits(model, caches))


@pytest.mark.parametrize("name", MODULES)
def test_deepcopy_continues_like_the_original(name):
    model, caches = _evicted(name)
    twin = copy.deepcopy(caches)
    want = _next_logits(model, caches)
    np.testing.assert_array_equal(_next_logits(model, twin), want)


@pytest.mark.parametrize("name", MODULES)
def test_query_filter_evicts_or_raises(name):
    model = _built(name)
    cfg = KVCacheConfig(qfilters_budget=BUDGET, qfilters_n_sink=1, qfilters_recent=2,
                        qfilters_calib_tokens=4, qfilters_filter_source="queries")
    caches = KVCacheBuilder.for_model(model, cfg)
    ours = [c for _, c in walk(caches) if _ours(c)]
    try:
        with observe_queries(model, caches):
            _feed(model, caches, [12, 1])
    except (ValueError, RuntimeError) as err:
        assert re.search(r"quer", str(err)), err  # a clear error about the queries
        assert "run the model inside" not in str(err), f"misleading inside observe_queries: {err}"
        return
    assert all(c.size() <= BUDGET + 1 and c.filter is not None for c in ours)


def _docs_section():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "mlx-lm.md")
    text = open(path).read() if os.path.exists(path) else ""
    m = re.search(r"^## Architectures\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1) if m else None


def test_docs_table_matches_the_matrix():
    section = _docs_section()
    assert section is not None, "docs/mlx-lm.md has no '## Architectures' section (tools/arch_table.py)"
    table = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert "\n".join(table) + "\n" == arch_matrix.markdown_table()
