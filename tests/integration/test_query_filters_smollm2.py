"""SmolLM2: offline calibration from the CLI, generation with the filters and the auto sign."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def filters_file(model_path, tmp_path_factory):
    from qfilters_mlx.commands.cli import main

    out = str(tmp_path_factory.mktemp("filters") / "smollm2.safetensors")
    assert main(["calibrate", "--model", str(model_path), "--out", out, "--tokens", "512",
                 "--chunk", "256", "--samples", "256"]) == 0
    return out


def test_calibrated_filters_fit_the_model_and_oppose_the_key_direction(model_path, filters_file):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache

    from qfilters_mlx.backends import reference as ref
    from qfilters_mlx.filters.calibration import load_filters
    from qfilters_mlx.assets.prompts import calibration_text

    model, tokenizer = load(str(model_path))
    filters, meta = load_filters(filters_file, model)
    assert filters.shape == (30, 3, 64) and meta["calibration_tokens"] == "512"
    np.testing.assert_allclose(np.linalg.norm(np.array(filters), axis=-1), 1.0, atol=1e-4)
    # docs/method.md ("Filters"): the key-SVD direction (keys project positively) points against the query
    # filter in most KV heads of SmolLM2.
    ids = tokenizer.encode(calibration_text()[0])[:128]
    caches = [KVCache() for _ in model.layers]
    model(mx.array([ids]), cache=caches)
    cos = np.stack([np.sum(np.array(ref.estimate_filter_from_keys(c.keys[:, :, :128])) *
                           np.array(filters[i]), -1) for i, c in enumerate(caches)])
    print(f"key-SVD vs query filter: {(cos < 0).mean():.0%} of KV heads negative, "
          f"median cosine {np.median(cos):.2f}")
    assert (cos < 0).mean() > 0.75 and np.median(cos) < 0, cos


def test_generate_with_filters_and_auto_sign(model_path, filters_file, capsys):
    from qfilters_mlx.commands.cli import main

    base = ["generate", "--model", str(model_path), "--max-tokens", "4", "--budget", "128"]
    assert main(base + ["--filters", filters_file]) == 0
    out = capsys.readouterr().out
    assert f"filters={filters_file}" in out and "Kept tokens per layer: 128" in out
    assert main(base + ["--filter-source", "keys", "--sign", "auto"]) == 0
    out = capsys.readouterr().out
    assert "filter_source=keys sign=auto" in out and "Kept tokens per layer: 128" in out


def test_shipped_filters_file_loads_on_a_fresh_setup(model_path):
    """bench/results/smollm2_filters.safetensors carries the parameter-based identity:
    it loads without a warning, and the same architecture with other weights is refused naming
    the field."""
    import os
    import warnings

    import mlx.core as mx
    from mlx_lm import load

    from qfilters_mlx.filters.calibration import load_filters

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results", "smollm2_filters.safetensors")
    model, _ = load(str(model_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        filters, meta = load_filters(path, model)
    assert filters.shape == (30, 3, 64) and "model_fields" in meta
    w = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = w + mx.ones_like(w)  # same shapes, other weights
    with pytest.raises(ValueError, match="differing fields: weights"):
        load_filters(path, model)
