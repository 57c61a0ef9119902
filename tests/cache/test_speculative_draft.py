"""Speculative decoding through mlx-lm's own entry (``mlx_lm.generate`` / ``stream_generate``
with ``draft_model``), with the eviction caches installed on the draft model too.

mlx-lm builds both models' caches with ``model.make_cache`` (``install``), asks only the main
model's whether they can rewind, and trims the draft's without asking. Reference: the same
run with mlx-lm's own full cache on the draft model (how far the draft lags behind the main
model after each accepted/rejected round is set by the emitted tokens alone).
"""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache
from test_rewind import DRAFT, MAIN, prompt_tokens

generate = importlib.import_module("mlx_lm.generate")  # (mlx_lm.generate is also a function)
CONFIG = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=0,
                       qfilters_calib_tokens=8, qfilters_filter_source="keys")


def run(draft_installed: bool, **draft_options):
    """Tokens, main caches and draft caches of one ``speculative_generate_step`` run reached
    through the module (as ``stream_generate`` reaches it), caches built by ``make_cache``."""
    built = {}

    def recording(model, name):
        make = model.make_cache

        def make_cache(*a, **k):
            built[name] = make(*a, **k)
            return built[name]
        model.make_cache = make_cache

    KVCacheBuilder.install(MAIN, CONFIG)
    if draft_installed:
        KVCacheBuilder.install(DRAFT, CONFIG, **draft_options)
    recording(MAIN, "main")
    if draft_installed:
        recording(DRAFT, "draft")
    try:
        out = [(int(t), bool(d)) for t, _, d in generate.speculative_generate_step(
            prompt_tokens(3, 60), MAIN, DRAFT, num_draft_tokens=3, max_tokens=20)]
    finally:
        del MAIN.make_cache
        if draft_installed:
            del DRAFT.make_cache
    return out, built.get("main"), built.get("draft")


def test_installed_draft_caches_rewind_exactly():
    """Each draft cache lags the main caches as the reference's full draft cache does (a draft
    cache that skipped its rewinds ends ahead: 99 against 79, rejected drafts kept at wrong
    positions), and holds no position at or past its offset."""
    ref_out, ref_main, _ = run(False)
    out, main, draft = run(True)
    assert any(not d for _, d in out[:-1])  # a draft was rejected: rewinds happened
    assert all(isinstance(c, QFiltersKVCache) and c.evicted for c in draft)
    ref_draft = make_prompt_cache(DRAFT)  # the reference run, the draft's own full cache given
    ref_caches = KVCacheBuilder.for_model(MAIN, CONFIG) + ref_draft
    list(generate.speculative_generate_step(prompt_tokens(3, 60), MAIN, DRAFT, num_draft_tokens=3,
                                            max_tokens=20, prompt_cache=ref_caches))
    lag = ref_caches[0].offset - ref_draft[0].offset
    assert main[0].offset - len(out) == ref_main[0].offset - len(ref_out)  # (main: no lost token)
    assert all(main[0].offset - c.offset == lag for c in draft), (
        main[0].offset, [c.offset for c in draft], lag)
    for c in draft:
        pos = np.array(c.kept_positions())
        assert pos.max() < c.offset and len(np.unique(pos[0, 0])) == pos.shape[-1]


def test_draft_caches_that_cannot_rewind_are_refused_before_the_prompt():
    with pytest.raises(ValueError, match="draft model.s eviction cache 0 cannot rewind.*max_rewind=0"):
        run(True, max_rewind=0)


def test_the_guard_leaves_mlx_lms_own_draft_caches_and_a_given_prompt_cache_alone():
    """mlx-lm's own caches on the draft (never asked by the guard's refusal) and a prompt cache
    given by the caller run as mlx-lm alone runs them (same tokens)."""
    prompt = prompt_tokens(4, 30)
    given = KVCacheBuilder.for_model(MAIN, CONFIG)
    a = [int(t) for t, _, _ in generate.speculative_generate_step(
        prompt, MAIN, DRAFT, num_draft_tokens=2, max_tokens=8,
        prompt_cache=list(given) + list(make_prompt_cache(DRAFT)))]
    b = [int(t) for t, _ in generate.generate_step(prompt, MAIN, max_tokens=8,
                                                   prompt_cache=KVCacheBuilder.for_model(MAIN, CONFIG))]
    assert a == b


def test_building_or_loading_an_eviction_cache_installs_the_guard(monkeypatch, tmp_path):
    """No builder needed: a cache built by its constructor, or loaded from a prompt-cache file,
    puts the guard in place (mlx-lm's function restored first, as in a fresh process)."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    original = generate.speculative_generate_step.__wrapped__
    c = QFiltersKVCache(CONFIG)
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    for make in (lambda: QFiltersKVCache(CONFIG), lambda: load_prompt_cache(str(tmp_path / "c.safetensors"))):
        monkeypatch.setattr(generate, "speculative_generate_step", original)
        make()
        assert generate.speculative_generate_step.__wrapped__ is original
        make()  # once in place, not wrapped again
        assert generate.speculative_generate_step.__wrapped__ is original


def test_kv_bits_with_eviction_caches_is_refused_before_the_prompt():
    """mlx-lm quantizes every cache mid-generation with kv_bits, and a quantized eviction cache
    cannot rewind: refused at the generator's start, nothing fed."""
    main = KVCacheBuilder.for_model(MAIN, CONFIG)
    steps = generate.speculative_generate_step(prompt_tokens(3, 60), MAIN, DRAFT, num_draft_tokens=3,
                                               max_tokens=4, prompt_cache=main + make_prompt_cache(DRAFT),
                                               kv_bits=4, quantized_kv_start=0)
    with pytest.raises(ValueError, match="speculative decoding with kv_bits=4"):
        next(steps)
    assert all(c.offset == 0 for c in main)


def test_draft_caches_inside_a_cache_list_are_asked_too():
    from mlx_lm.models.cache import CacheList

    from qfilters_mlx.cache.speculative import check_speculative

    fresh = QFiltersKVCache(CONFIG)
    check_speculative([QFiltersKVCache(CONFIG), CacheList(fresh)], 1)
    assert fresh._journal.active  # asked: its rewind journal is on
    with pytest.raises(ValueError, match="draft model's eviction cache 0 cannot rewind.*max_rewind=0"):
        check_speculative([QFiltersKVCache(CONFIG), CacheList(QFiltersKVCache(CONFIG, max_rewind=0))], 1)


@pytest.mark.parametrize("kind, why", [("max_rewind_0", "max_rewind=0"),
                                       ("evicted", "max_rewind='auto', evicted without a journal"),
                                       ("quantized", "max_rewind='auto', quantized K/V")])
def test_the_refusal_names_why_the_draft_cache_cannot_rewind(kind, why):
    from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache
    from qfilters_mlx.cache.speculative import check_speculative

    cfg = KVCacheConfig(method="l2norm", qfilters_budget=8, qfilters_n_sink=1, qfilters_recent=2)
    if kind == "max_rewind_0":
        draft = QFiltersKVCache(cfg, max_rewind=0)
    elif kind == "evicted":  # evicted before it was asked: no journal holds what it dropped
        draft = QFiltersKVCache(cfg)
        draft.update_and_fetch(mx.zeros((1, 2, 20, 64)), mx.zeros((1, 2, 20, 64)))
    else:
        draft = QuantizedQFiltersKVCache(cfg, bits=4)
    want = (f"speculative decoding: the draft model's eviction cache 0 cannot rewind the rejected draft "
            f"tokens ({why}); build the draft's caches with max_rewind >= num_draft_tokens (or the default "
            "'auto', before any eviction), or give the draft model mlx-lm's own caches")
    with pytest.raises(ValueError) as err:
        check_speculative([QFiltersKVCache(cfg), draft], 1)
    assert str(err.value) == want
