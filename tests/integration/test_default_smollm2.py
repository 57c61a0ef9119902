"""The default configuration on SmolLM2-135M-Instruct: the method page's usage example through
``mlx_lm.generate`` with no context manager, and a draft model holding the budget with the
calibrated filters."""

import numpy as np
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture()
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("QFILTERS_MLX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_method_page_example_holds_the_budget_through_mlx_lm_generate(model_path, empty_home, capsys):
    import mlx_lm
    from helpers.method_example import run

    from qfilters_mlx import KVCacheBuilder, KVCacheConfig

    # The method page's example; the model path differs, and head_dim is SmolLM2's (64; the
    # page's 128 is its Llama-3.2-3B's, and a wrong width is refused by name, tested below).
    ns = run(model_path, head_dim=64)
    model, tokenizer, caches = ns["model"], ns["tokenizer"], ns["caches"]
    # End of the example.
    from qfilters_mlx.assets.prompts import long_prompt
    from qfilters_mlx.filters.default_filters import stored_path
    from qfilters_mlx.identity import model_identity

    from qfilters_mlx.filters.default_filters import SAMPLED_TOKENS

    err = capsys.readouterr().err  # the example passes no tokenizer: the model samples its text
    assert f"calibrated Q-Filters (30 layers x 3 KV heads x 64) from {SAMPLED_TOKENS} tokens" in err
    prompt = tokenizer.encode(long_prompt())
    mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=8)
    assert all(c.size() == 512 and c.offset == caches[0].offset > len(prompt) for c in caches)
    from safetensors.numpy import load_file

    want = load_file(str(stored_path(model_identity(model))))["filters"]
    for i, c in enumerate(caches):
        np.testing.assert_array_equal(np.array(c.filter), want[i])
    with pytest.raises(ValueError, match="head_dim=128 does not match the model's key head width 64"):
        KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=128))


def test_draft_model_with_the_default_holds_the_budget(model_path):
    """Speculative decoding (mlx-lm's ``speculative_generate_step``) with the default caches on
    both models (SmolLM2 drafting for itself), no observe_queries: both hold the budget, the
    draft scores with the same calibrated filters (same model identity, one file), and the first
    token (after the same prefill) equals plain greedy decoding's."""
    import mlx_lm
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from qfilters_mlx import KVCacheBuilder, KVCacheConfig
    from qfilters_mlx.assets.prompts import long_prompt

    model, tokenizer = mlx_lm.load(str(model_path))
    draft, _ = mlx_lm.load(str(model_path))
    cfg = KVCacheConfig(qfilters_budget=256)
    prompt = tokenizer.encode(long_prompt())[:700]
    main, drafted = (KVCacheBuilder.for_model(m, cfg, tokenizer=tokenizer, max_rewind=3)
                     for m in (model, draft))
    spec = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=12, draft_model=draft,
                                             num_draft_tokens=3, prompt_cache=main + drafted,
                                             sampler=make_sampler(0.0))]
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=1,
                                              prompt_cache=KVCacheBuilder.for_model(model, cfg),
                                              sampler=make_sampler(0.0))]
    assert len(spec) == 12 and spec[0] == plain[0]
    for a, b in zip(main, drafted):
        assert a.size() == b.size() == 256 and len(prompt) < a.offset <= len(prompt) + 12
        np.testing.assert_array_equal(np.array(a.filter), np.array(b.filter))
    assert "calibrated query filter" in main.report.filters
