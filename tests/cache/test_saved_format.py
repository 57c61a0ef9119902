"""Saved prompt-cache files written by 0.2.0 (format 1, the committed fixtures of
tests/helpers/saved_cache_cases.py) load and continue exactly: the logits of every later call,
the kept positions and offsets equal those the 0.2.0 code measured from the caches it saved."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache

from helpers import saved_cache_cases as cases


@pytest.fixture(scope="module")
def model():
    return cases.tiny_model()


def _assert_continues(got: dict, want) -> None:
    assert sorted(got) == sorted(want.files)
    for name in want.files:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.name)
def test_format1_file_loads_and_continues_exactly(model, case):
    caches, meta = load_prompt_cache(str(cases.FORMAT1 / f"{case.name}.safetensors"),
                                     return_metadata=True)
    assert meta == {"case": case.name}
    want = np.load(cases.FORMAT1 / f"{case.name}.npz")
    _assert_continues(cases.run_continuation(case, model, caches), want)


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.name)
def test_fresh_caches_continue_as_the_saved_ones_did(model, case):
    """The recorded continuation is also what caches built now give, unsaved (the reference
    is the 0.2.0 run, not the loader under test)."""
    caches = cases.build(case, model)
    cases.run_prompt(case, model, caches)
    _assert_continues(cases.run_continuation(case, model, caches),
                      np.load(cases.FORMAT1 / f"{case.name}.npz"))
