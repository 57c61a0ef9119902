"""Documented rules checked exactly against the rule written out in numpy (added for
mutants that survived ``tools/mutation.py``; see bench/results/mutation.md)."""

import mlx.core as mx
import numpy as np

from qfilters_mlx.backends import reference as ref


def np_victim(scores, positions, position, n_sink, recent):
    """The slot to free next (reference.decode_select's rule): among positions neither
    a sink (< n_sink) nor in the recent window (>= position + 1 - recent), the lowest
    score, and among equal scores the latest position; NaN/inf already stored as -inf."""
    B, H, S = scores.shape
    out = np.zeros((B, H), np.int32)
    for b in range(B):
        for h in range(H):
            cand = [s for s in range(S)
                    if n_sink <= positions[b, h, s] < position + 1 - recent]
            out[b, h] = min(cand, key=lambda s: (scores[b, h, s], -positions[b, h, s]))
    return out


def test_decode_select_stores_the_new_token_and_frees_the_documented_victim():
    rng = np.random.default_rng(3)
    B, H, S, n_sink, recent = 2, 3, 9, 2, 2
    for trial in range(12):
        position = 20 + trial
        # distinct past positions per row, in slot order shuffled; ties in scores
        positions = np.stack([np.stack([rng.permutation(np.arange(position))[:S]
                                        for _ in range(H)]) for _ in range(B)]).astype(np.int64)
        positions[..., 0] = np.arange(n_sink)[rng.integers(0, n_sink)]  # a sink in slot 0
        scores = rng.integers(-2, 2, size=(B, H, S)).astype(np.float32)
        free = rng.integers(0, S, size=(B, H)).astype(np.int32)
        new = rng.integers(-2, 2, size=(B, H, 1)).astype(np.float32)
        new[0, 0, 0] = [np.nan, np.inf, -np.inf][trial % 3]
        s, p, v = ref.decode_select(mx.array(scores), mx.array(positions), mx.array(new),
                                    mx.array(free), position, n_sink, recent)
        exp_s, exp_p = scores.copy(), positions.copy()
        for b in range(B):
            for h in range(H):
                x = new[b, h, 0]
                exp_s[b, h, free[b, h]] = x if np.isfinite(x) else -np.inf
                exp_p[b, h, free[b, h]] = position
        np.testing.assert_array_equal(np.array(s), exp_s)
        np.testing.assert_array_equal(np.array(p), exp_p)
        assert np.array(s).dtype == np.float32 and np.array(p).dtype == np.int64
        np.testing.assert_array_equal(np.array(v), np_victim(exp_s, exp_p, position, n_sink, recent))
