"""Test inputs shared by the kernel equivalence tests (cpp, emulated Metal, native Metal)."""

import numpy as np

SCORE_MODES = ("random", "ties", "const")


def score_array(rng: np.random.Generator, shape, mode: str) -> np.ndarray:
    """float32 scores: ``random`` normal; ``ties`` a handful of distinct values with
    -0.0, NaN and -inf mixed in (ties everywhere); ``const`` one value."""
    s = rng.standard_normal(shape).astype(np.float32)
    if mode == "ties":
        s = np.round(s * 2) / 2
        s[rng.random(shape) < 0.1] = -0.0
        s[rng.random(shape) < 0.05] = np.nan
        s[rng.random(shape) < 0.03] = -np.inf
    elif mode == "const":
        s = np.full(shape, 0.25, np.float32)
    return s


# One row of scores and, per (budget, n_sink, recent), the positions select_keep keeps.
# Equal scores: the earlier position wins; NaN ranks with -inf; -0.0 == +0.0.
TIE_BREAK_SCORES = np.array([1.0, 0.0, np.nan, -0.0, 1.0, -np.inf, 0.0, 1.0], np.float32)
TIE_BREAK_CASES = {
    (1, 0, 0): [0],
    (3, 0, 0): [0, 4, 7],
    (4, 0, 0): [0, 1, 4, 7],  # 0.0 at 1 beats -0.0 at 3 (earlier)
    (5, 0, 0): [0, 1, 3, 4, 7],
    (7, 0, 0): [0, 1, 2, 3, 4, 6, 7],  # NaN (2) ties -inf (5): earlier wins
    (4, 1, 1): [0, 1, 4, 7],
    (3, 0, 2): [0, 6, 7],
    (3, 2, 1): [0, 1, 7],
}
