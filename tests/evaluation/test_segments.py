"""Two held-out segments and the bootstrap gap ratio."""

import numpy as np
import pytest

from helpers.query_models import tiny_llama
from qfilters_mlx.assets.prompts import CALIBRATION_OFFSET, SOURCE_OFFSET
from qfilters_mlx.evaluation.arms import Arm
from qfilters_mlx.evaluation.bootstrap import gap_ratio, gap_ratio_ci
from qfilters_mlx.evaluation.perplexity import full_cache_nll, streaming_nll
from qfilters_mlx.evaluation.segment_report import ratio_table, segment_markdown
from qfilters_mlx.evaluation.segments import SEGMENT_B_OFFSET, SegmentSettings, run_segments, segment_tokens


class CharTokenizer:
    """One token per character (ids mod 101, the tiny model's vocabulary)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 101 for c in text]

    def decode(self, ids):
        return "x" * len(ids)


def _text(n=SEGMENT_B_OFFSET + 5000):
    rng = np.random.default_rng(0)
    body = "".join(chr(97 + i) for i in rng.integers(0, 26, n))
    return body[:SEGMENT_B_OFFSET + 10] + "\n\n" + body[SEGMENT_B_OFFSET + 12:]


def test_gap_ratio_and_interval():
    rng = np.random.default_rng(1)
    full = rng.gamma(2.0, 1.0, 1024)
    ref = full + 0.3 + 0.1 * rng.standard_normal(1024)
    arm = full + 0.15 + 0.1 * rng.standard_normal(1024)
    want = (np.exp(arm.mean()) - np.exp(full.mean())) / (np.exp(ref.mean()) - np.exp(full.mean()))
    assert gap_ratio(arm, ref, full) == pytest.approx(want)
    r, lo, hi = gap_ratio_ci(arm, ref, full, block=32, n_boot=500)
    assert r == pytest.approx(want) and lo < r < hi and 0.3 < lo and hi < 0.7
    assert gap_ratio_ci(ref, ref, full, n_boot=200)[1:] == pytest.approx((1.0, 1.0))
    assert gap_ratio_ci(arm, ref, full, seed=3) == gap_ratio_ci(arm, ref, full, seed=3)
    with pytest.raises(ValueError, match="same length"):
        gap_ratio_ci(arm[:10], ref, full)
    with pytest.raises(ValueError, match="block"):
        gap_ratio_ci(arm, ref, full, block=0)


def test_segments_are_disjoint_from_each_other_and_from_calibration():
    tok = CharTokenizer()
    text = _text()
    a, span_a = segment_tokens(tok, text, "A", 300)
    b, span_b = segment_tokens(tok, text, "B", 300)
    assert span_a == [0, 300] and span_b[0] == SEGMENT_B_OFFSET + 12
    assert span_a[1] <= span_b[0] and span_b[1] <= SOURCE_OFFSET < CALIBRATION_OFFSET
    assert a == tok.encode(text[:300]) and b == tok.encode(text[span_b[0]:span_b[0] + 300])
    with pytest.raises(ValueError, match="segment"):
        segment_tokens(tok, text, "C", 10)


def test_run_segments_matches_running_each_arm_alone():
    model = tiny_llama(layers=2)
    tok = CharTokenizer()
    text = _text()
    arms = [Arm(name="streaming_llm", method="streaming_llm", family="streaming_llm"),
            Arm(name="keys-1@r0", method="qfilters", sign=-1)]
    s = SegmentSettings(budgets=(12,), n_sink=2, calib_tokens=8, ppl_prefix=6, ppl_scored=30,
                        backend="reference")
    results = {}
    run_segments(model, tok, text, s, arms, results)
    for seg in ("A", "B"):
        tokens, _ = segment_tokens(tok, text, seg, 36)
        cells = results["segments"][seg]
        np.testing.assert_allclose(cells["full"]["nll"], full_cache_nll(model, tokens, 6), atol=1e-4)
        for arm in arms:
            cfg = arm.config(12, n_sink=2, calib_tokens=8, head_dim=16)
            alone = streaming_nll(model, tokens, [arm.make_cache(cfg, i, backend="reference") for i in range(2)], 6)
            np.testing.assert_allclose(cells[f"{arm.name}@12"]["nll"], alone, atol=1e-4)
    table = ratio_table(results)
    assert set(table) == {"A", "B"} and set(table["A"]) == {"keys-1@r0"}
    assert "Segment B" in segment_markdown(results)
    with pytest.raises(ValueError, match="different settings"):
        run_segments(model, tok, text, SegmentSettings(budgets=(16,)), arms, results)
