"""Saved prompt-cache files written by 0.2.0 (format 1, the committed fixtures of
tests/helpers/saved_cache_cases.py) load and continue exactly: the logits of every later call,
the kept positions and offsets equal those the 0.2.0 code measured from the caches it saved.
Saved again they are format 2 (current names, ``"format": 2``), which mlx-lm reads in a fresh
process; another format is refused naming it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from helpers import saved_cache_cases as cases
from qfilters_mlx import QFiltersKVCache
from qfilters_mlx.blas import enable_fast_blas
from qfilters_mlx.config import FORMAT, from_format1
from qfilters_mlx.config.removed import REMOVED

TESTS = Path(__file__).resolve().parents[1]


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


def _raw_metas(path) -> list[dict]:
    """The JSON meta of each cache in a prompt-cache file, as stored (mlx-lm saves a string
    entry as an array of its character codes)."""
    arrays = mx.load(str(path))
    return [json.loads("".join(chr(c) for c in arrays[f"{i}.6"].tolist()))
            for i in range(len({k.split(".")[0] for k in arrays}))]


_FRESH = """
import sys
assert "qfilters_mlx" not in sys.modules
from mlx_lm.models.cache import load_prompt_cache
caches = load_prompt_cache(sys.argv[1])
import numpy as np
from helpers import saved_cache_cases as cases
case = {c.name: c for c in cases.CASES}[sys.argv[2]]
np.savez(sys.argv[3], **cases.run_continuation(case, cases.tiny_model(), caches))
"""


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.name)
def test_format1_saved_again_is_format2_and_continues_in_a_fresh_process(tmp_path, model, case):
    """A format-1 file loaded and saved again is written in format 2 (current names, a format
    marker, nothing of the 0.1 spellings); mlx-lm's ``load_prompt_cache`` reads it in a process
    that has not imported qfilters_mlx (the startup hook registers the classes), and it
    continues exactly as the 0.2.0 caches did."""
    caches = load_prompt_cache(str(cases.FORMAT1 / f"{case.name}.safetensors"))
    path = tmp_path / "format2.safetensors"
    save_prompt_cache(str(path), caches)
    old = _raw_metas(cases.FORMAT1 / f"{case.name}.safetensors")
    for meta, before in zip(_raw_metas(path), old, strict=True):
        assert "format" not in before and meta["format"] == FORMAT == 2
        assert not set(REMOVED) & set(meta["config"]) and set(meta["build"]) == {
            "backend", "max_rewind", "kv_bits", "kv_group_size"}
        assert from_format1(before)["config"] == meta["config"]
        assert from_format1(before)["build"] == {k: v for k, v in meta["build"].items()
                                                 if v is not None}
    out = tmp_path / "continued.npz"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    blas = enable_fast_blas()  # (loaded by conftest: the path) the same BLAS there, preloaded
    if blas:
        env["LD_PRELOAD"] = blas
    run = subprocess.run([sys.executable, "-c", _FRESH, str(path), case.name, str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    _assert_continues(dict(np.load(out)), np.load(cases.FORMAT1 / f"{case.name}.npz"))


@pytest.mark.parametrize("fmt", [3, "2", 0, None, True, 1, 2.0])
def test_an_unknown_format_is_refused_naming_it(tmp_path, fmt):
    """Only the int 2 marks a format: format 1 never had a marker, so ``"format": 1`` is
    refused as well (it is not what 0.2 wrote)."""
    (path,) = [cases.FORMAT1 / "streaming.safetensors"]
    state = list(load_prompt_cache(str(path))[0].state)
    meta = json.loads(state[6])
    before = list(state)
    state[6] = json.dumps({**meta, "format": fmt})
    with pytest.raises(ValueError, match=rf"^state: saved cache format {re.escape(repr(fmt))} is not a "
                                         r"format this version reads \(formats 1 and 2: format 1 has "
                                         r"no 'format' entry, format 2 the int 2\)"):
        QFiltersKVCache.from_state(state)
    # the same refusal through mlx-lm's loader, for a file
    cache = QFiltersKVCache.from_state(before)
    save_prompt_cache(str(tmp_path / "f.safetensors"), [cache])
    arrays, metadata = mx.load(str(tmp_path / "f.safetensors"), return_metadata=True)
    arrays["0.6"] = mx.array([ord(c) for c in state[6]])
    mx.save_safetensors(str(tmp_path / "g.safetensors"), arrays, metadata)
    with pytest.raises(ValueError, match=rf"saved cache format {re.escape(repr(fmt))} "):
        load_prompt_cache(str(tmp_path / "g.safetensors"))


@pytest.mark.parametrize("name", ["streaming", "compress_once", "quantized"])
def test_a_format2_body_is_not_read_as_format1(name):
    """A format-2 meta marked ``"format": 1``, or with its marker taken out, is refused, not
    translated (translated, a compress-once file's mode became streaming and its backend the
    default); the cache class named by its build options reads it unchanged when marked 2."""
    cache = load_prompt_cache(str(cases.FORMAT1 / f"{name}.safetensors"))[0]
    state = list(cache.state)
    meta = json.loads(state[6])
    assert meta["format"] == 2 and meta["config"]["mode"]["name"] == (
        "compress_once" if name == "compress_once" else "streaming")
    marked_1 = [*state[:6], json.dumps({**meta, "format": 1}), *state[7:]]
    with pytest.raises(ValueError, match=r"^state: saved cache format 1 is not a format"):
        type(cache).from_state(marked_1)
    unmarked = {k: v for k, v in meta.items() if k != "format"}
    with pytest.raises(ValueError, match=r"^state: not a format-1 meta \(.*got \['build', "
                                         r"'config.mode'\]\)$"):
        type(cache).from_state([*state[:6], json.dumps(unmarked), *state[7:]])
    again = type(cache).from_state(state)
    assert (again.config, again.limits, again.max_rewind) == (cache.config, cache.limits, cache.max_rewind)


def test_a_refused_state_leaves_the_cache_as_it_was():
    """``cache.state = bad`` raises before anything changes: the cache saves the same state
    and continues as its untouched twin does."""
    cache = load_prompt_cache(str(cases.FORMAT1 / "compress_once.safetensors"))[0]
    twin = load_prompt_cache(str(cases.FORMAT1 / "compress_once.safetensors"))[0]
    good = list(cache.state)
    meta = json.loads(good[6])
    old = _raw_metas(cases.FORMAT1 / "compress_once.safetensors")[0]  # (format 1)
    bads = [{**meta, "format": 3}, {**meta, "format": 1}, {**meta, "format": "2"},
            {k: v for k, v in meta.items() if k != "format"},
            {**meta, "build": []}, {**meta, "build": {**meta["build"], "zzz": 1}},
            {**old, "config": {**old["config"], "qfilters_mode": "streaming"}},  # ratio, growth set
            {**old, "config": {k: v for k, v in old["config"].items() if k != "qfilters_mode"}}]
    for bad in bads:
        with pytest.raises(ValueError, match=r"^state: "):
            cache.state = [*good[:6], json.dumps(bad), *good[7:]]
        assert json.loads(cache.state[6]) == meta
        for x, y in zip(cache.state[:6], good[:6]):
            assert (x is None and y is None) or mx.array_equal(x, y).item()
    k = mx.random.normal((1, 2, 3, 32), key=mx.random.key(3))
    for x, y in zip(cache.update_and_fetch(k, k), twin.update_and_fetch(k, k)):
        assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("build", [[], "x", None, 3])
def test_saved_build_options_that_are_not_an_object_are_refused_naming_them(build):
    """Dense rows, quantized rows and a batch's rows: ``ValueError`` quoting the value."""
    from qfilters_mlx.cache.batch import BatchQFiltersCache

    want = rf"saved build options must be an object {{option: value}}, got {re.escape(repr(build))}\)$"
    for name in ("streaming", "quantized"):
        cache = load_prompt_cache(str(cases.FORMAT1 / f"{name}.safetensors"))[0]
        state = list(cache.state)
        bad = (*state[:6], json.dumps({**json.loads(state[6]), "build": build}), *state[7:])
        with pytest.raises(ValueError, match=r"^state: bad meta \(" + want):
            type(cache).from_state(bad)
        with pytest.raises(ValueError, match=r"^state: bad row meta \(" + want):
            BatchQFiltersCache.from_state(tuple(state) + bad)


def test_a_batch_of_format1_rows_loads_each_row_through_the_translator():
    """A ``BatchQFiltersCache`` state is its rows' states: rows saved in format 1 (the meta as
    0.2.0 wrote it) load as the single caches do, quantized rows by the class their build
    options name."""
    from qfilters_mlx.cache.batch import BatchQFiltersCache

    for name in ("streaming", "quantized"):
        path = cases.FORMAT1 / f"{name}.safetensors"
        singles = load_prompt_cache(str(path))
        raw = [json.dumps(m) for m in _raw_metas(path)]
        single = singles[0]  # (a batch's rows share the layer: layer 0's state twice)
        row = (*single.state[:6], raw[0], *single.state[7:])
        batch = BatchQFiltersCache.from_state(row + row)
        assert [type(r) for r in batch.caches] == [type(single)] * 2
        for r, c in zip(batch.caches, [single, single]):
            assert (r.offset, r.limits, r.config) == (c.offset, c.limits, c.config)
            np.testing.assert_array_equal(np.array(r.kept_positions()), np.array(c.kept_positions()))
