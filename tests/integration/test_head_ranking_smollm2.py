"""SmolLM2: the retrieval-head ranking as computed (routed attention, shared starts reused, the
tokens before the answer through the backbone only) against the needle attention written out in
numpy from mlx-lm's own full-cache passes, needle by needle, and the same top heads."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def test_ranking_equals_numpy_from_mlx_lm_passes_and_keeps_the_top_heads(model_path):
    from mlx_lm import load

    from helpers.head_models import np_needle_mass
    from qfilters_mlx.filters.head_budgets import big_heads
    from qfilters_mlx.filters.head_ranking import calibration_needles, rank_heads

    model, tokenizer = load(str(model_path))
    got = rank_heads(model, tokenizer)
    needles = calibration_needles(tokenizer)
    want = np.stack([np_needle_mass(model, n.prompt) for n in needles])
    np.testing.assert_allclose(got.per_needle, want, rtol=1e-3, atol=1e-5)
    assert big_heads(got.ranking, 8) == big_heads(want.mean(axis=0), 8)
    assert got.computed < 0.8 * sum(len(n.prompt.tokens) - 1 for n in needles)
