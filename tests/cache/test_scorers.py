"""Scorers as objects: a scorer defined here (not in the package) runs through every path of
the engine by its registered name, and the engine compares no method name.

References: numpy's top-k with sinks and window (``helpers.oracle.np_keep_rows``) over the
scores written out in numpy; mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``; the
command line's own parser; the package's sources read with ``ast``.
"""

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from helpers.oracle import np_keep_rows
from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.commands.cache_options import applicable_flags, config_from_args, describe_config
from qfilters_mlx.commands.cli import build_parser
from qfilters_mlx.config import CompressOnce
from qfilters_mlx.scorers import Scorer, register, scorer_class, scorer_names
from qfilters_mlx.scorers.registry import unregister

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "qfilters_mlx"
ENGINE = ("cache", "backends", "filters")


class FirstCoordinate(Scorer):
    """A scorer of the tests: the key's first coordinate (large is kept)."""

    name = "first_coordinate"

    def scores(self, keys, positions, filters=None, backend=None):
        return keys[..., 0].astype(mx.float32)


@pytest.fixture
def first_coordinate():
    register(FirstCoordinate)
    yield FirstCoordinate
    unregister(FirstCoordinate.name)


def keys_values(T, H=2, D=8, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, H, T, D)).astype(np.float32)
    v = rng.standard_normal((1, H, T, D)).astype(np.float32)
    return mx.array(k), mx.array(v)


def feed(cache, k, v, prefill):
    cache.update_and_fetch(k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, k.shape[2]):
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])


@pytest.mark.parametrize("prefill", [40, 12])
def test_a_scorer_defined_outside_the_package_keeps_what_numpy_keeps(first_coordinate, prefill):
    """Prefill then decode steps (slot mode): the kept positions are numpy's top-k of the
    first coordinates with 2 sinks and a window of 3, over every token fed."""
    k, v = keys_values(48)
    config = KVCacheConfig(method="first_coordinate", qfilters_budget=10, qfilters_n_sink=2,
                           qfilters_recent=3)
    c = QFiltersKVCache(config, backend="reference")
    assert isinstance(c.scorer, FirstCoordinate) and config.scorer is FirstCoordinate
    feed(c, k, v, prefill)
    want = np_keep_rows(np.array(k)[..., 0], 10, 2, 3)
    np.testing.assert_array_equal(np.array(c.kept_positions()), want)
    assert c.evicted and c.size() == 10 and c.qfilters_kept_bytes == 2 * 10 * (2 * 8 * 4 + 4)


def test_a_registered_scorer_works_compress_once_rewinds_and_round_trips(first_coordinate, tmp_path):
    """Compress-once by ratio, an exact rewind after an eviction, and mlx-lm's prompt-cache file
    (the method is saved by name and resolved through the registry on load)."""
    k, v = keys_values(30, seed=1)
    once = QFiltersKVCache(KVCacheConfig(method="first_coordinate", qfilters_n_sink=1,
                                         mode=CompressOnce(ratio=0.5, at="manual")))
    once.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert once.compress() == 10
    np.testing.assert_array_equal(np.array(once.kept_positions()),
                                  np_keep_rows(np.array(k[:, :, :20])[..., 0], 10, 1, 0))
    config = KVCacheConfig(method="first_coordinate", qfilters_budget=8, qfilters_n_sink=1,
                           qfilters_recent=2)
    a, b = QFiltersKVCache(config, max_rewind=4), QFiltersKVCache(config)
    feed(a, k, v, 20)
    feed(b, k[:, :, :27], v[:, :, :27], 20)
    assert a.trim(3) == 3
    np.testing.assert_array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))
    save_prompt_cache(str(tmp_path / "c.safetensors"), [b])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert loaded.config == config and isinstance(loaded.scorer, FirstCoordinate)
    np.testing.assert_array_equal(np.array(loaded.kept_positions()), np.array(b.kept_positions()))


def test_the_command_line_takes_a_registered_scorer(first_coordinate):
    parser = build_parser()
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "p",
                              "--method", "first_coordinate", "--budget", "32"])
    config = config_from_args(parser, args)
    assert config.method == "first_coordinate" and config.qfilters_budget == 32
    assert applicable_flags("first_coordinate", False) == {"budget", "max_kv_size", "n_sink", "recent",
                                                           "heads"}
    assert describe_config(config).startswith("method=first_coordinate budget=32")


def test_the_registry_refuses_what_it_cannot_resolve(first_coordinate):
    assert scorer_names()[:5] == ("qfilters", "l2norm", "streaming_llm", "random", "full")
    assert scorer_names()[-1] == "first_coordinate" and scorer_class("first_coordinate") is FirstCoordinate
    with pytest.raises(ValueError, match="method must be one of .*'first_coordinate'.*got 'nope'"):
        KVCacheConfig(method="nope")

    class Other(FirstCoordinate):
        pass

    with pytest.raises(ValueError, match="'first_coordinate' is already registered by FirstCoordinate"):
        register(Other)
    with pytest.raises(TypeError, match="Scorer subclass"):
        register(int)

    class Nameless(Scorer):
        pass

    with pytest.raises(ValueError, match="name must be a non-empty string"):
        register(Nameless)
    with pytest.raises(ValueError, match="no scorer named 'nope'"):
        unregister("nope")
    unregister("first_coordinate")
    with pytest.raises(ValueError, match="method must be one of"):
        KVCacheConfig(method="first_coordinate")
    register(FirstCoordinate)  # (the fixture unregisters it)


def method_names_in_engine(root: Path, names) -> list[str]:
    """``file:line`` of every place in ``root``'s engine folders that compares a ``method``
    attribute, or holds a registered method name as a string (a comparison, a dict key, a
    default, a ``match`` case; docstrings aside)."""
    found = []
    for folder in ENGINE:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                          if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and n.body and isinstance(n.body[0], ast.Expr)
                          and isinstance(n.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                compares_method = isinstance(node, ast.Compare) and any(
                    isinstance(e, ast.Attribute) and e.attr == "method" for e in [node.left, *node.comparators])
                names_one = (isinstance(node, ast.Constant) and node.value in names
                             and id(node) not in docstrings)
                if compares_method or names_one:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_engine_names_no_method(tmp_path):
    assert method_names_in_engine(PACKAGE, scorer_names()) == []
    planted = tmp_path / "cache"
    planted.mkdir()
    (planted / "x.py").write_text('"""full docstring"""\ndef f(c):\n    a = c.method == "x"\n'
                                  '    return {"full": 1}[c.kind]\n')
    assert method_names_in_engine(tmp_path, {"full"}) == ["cache/x.py:3", "cache/x.py:4"]


def test_insertion_scores_by_name_pass_the_layer_seed_and_sign_to_the_scorer():
    """``insertion_scores(method, ...)``: the scorer built with the given layer, seed and sign
    (the random arm hashes (seed, layer, head, position); the filter score is ``sign * <k, f>``,
    written out in numpy)."""
    from qfilters_mlx.scorers import insertion_scores, random_scores

    rng = np.random.default_rng(4)
    keys = mx.array(rng.standard_normal((1, 2, 20, 8)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(20)[None, None], (1, 2, 20))
    got = insertion_scores("random", keys, pos, seed=3, layer=2)
    assert mx.array_equal(got, random_scores(pos, 3, 2)).item()
    assert not mx.array_equal(got, random_scores(pos, 0, 2)).item()
    assert not mx.array_equal(got, random_scores(pos, 3, 0)).item()
    f = rng.standard_normal((2, 8)).astype(np.float32)
    want = -np.einsum("bhtd,hd->bht", np.array(keys, dtype=np.float64), f.astype(np.float64))
    got = insertion_scores("qfilters", keys, pos, filters=mx.array(f), sign=-1)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


class FilterDot(Scorer):
    """A scorer of the tests that reads the filter: ``<k, f>`` (large is kept); it records the
    positions and backend each call of ``scores`` gets."""

    name = "filter_dot"
    uses_filter = True
    calls = []

    def scores(self, keys, positions, filters=None, backend=None):
        FilterDot.calls.append((positions, backend))
        return (keys * filters[None, :, None, :]).sum(-1).astype(mx.float32)


def test_a_filter_reading_scorer_gets_the_filter_positions_and_backend_in_every_decode_step():
    """Slot-mode decode steps score the new key with the cache's filter, its int64 position and
    the cache's backend: the kept positions are numpy's top-k of <k, f>, and every call of
    ``scores`` was handed what the contract says."""
    register(FilterDot)
    try:
        k, v = keys_values(40, seed=3)
        f = mx.array(np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32))
        c = QFiltersKVCache(KVCacheConfig(method="filter_dot", qfilters_budget=10, qfilters_n_sink=2,
                                          qfilters_recent=3), filters=f, backend="reference")
        FilterDot.calls = []
        feed(c, k, v, 12)
        want = np_keep_rows(np.einsum("bhtd,hd->bht", np.array(k, np.float64), np.array(f, np.float64)), 10, 2, 3)
        np.testing.assert_array_equal(np.array(c.kept_positions()), want)
        assert len(FilterDot.calls) == 1 + 28  # the prefill, then one per decoded token
        for i, (pos, backend) in enumerate(FilterDot.calls[1:]):
            assert pos.dtype == mx.int64 and pos.shape == (1, 2, 1) and (np.array(pos) == 12 + i).all()
            assert backend is c.backend
    finally:
        unregister(FilterDot.name)
