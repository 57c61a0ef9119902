"""The default filter: the calibrated query filter, found or made by ``KVCacheBuilder.for_model``.

Every test runs with ``QFILTERS_MLX_HOME`` in a temporary folder (``conftest.qfilters_home``;
tests that need an empty cache point it at their own ``tmp_path``).
"""

import json

import mlx.core as mx
import numpy as np
import pytest

from helpers.tiny_folder import tiny_model_folder
from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.filters import default_filters
from qfilters_mlx.identity import model_identity

PROMPT = ("The calibrated query filter ranks every cached key by its projection on one "
          "direction per KV head. ") * 8  # 792 bytes: 792 tokens of the byte tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture()
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("QFILTERS_MLX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _file_filters(path):
    from safetensors.numpy import load_file

    return load_file(str(path))["filters"]


def test_method_page_example_holds_the_budget_through_mlx_lm_generate(folder, empty_home):
    import mlx_lm
    from helpers.method_example import run

    ns = run(folder)  # the method page's example; the model path (and import name) differ
    model, tokenizer, caches = ns["model"], ns["tokenizer"], ns["caches"]
    assert ns["config"].qfilters_filter_source == "calibrated"
    # End of the example: generation needs no context manager.
    prompt = tokenizer.encode(PROMPT)
    assert len(prompt) == len(PROMPT.encode())
    mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=12)
    fed = caches[0].offset  # the prompt, then the generated tokens (mlx-lm computes one ahead)
    assert len(prompt) < fed <= len(prompt) + 12
    stored = default_filters.stored_path(model_identity(model))
    want = _file_filters(stored)  # [n_layers, H_kv, D] written on first use
    for i, c in enumerate(caches):
        assert c.offset == fed and c.size() == 512  # the budget holds past the 512th token
        np.testing.assert_array_equal(np.array(c.filter), want[i])
        k = np.array(c.keys[0, :, :c.size()]).astype(np.float32)  # [H_kv, 512, D]
        scores = np.einsum("htd,hd->ht", k, want[i])
        np.testing.assert_allclose(np.array(c.scores[0, :, :c.size()]), scores, rtol=1e-5, atol=1e-5)
        assert np.array(c.positions[0, 0, :4]).tolist() == [0, 1, 2, 3]  # the sinks
    assert f"filter: calibrated query filter {stored}" in repr(caches)


def test_mlx_lm_generate_with_the_default_config_holds_the_budget(folder):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))
    report = KVCacheBuilder.install(model, KVCacheConfig(qfilters_budget=64))
    built, make = [], model.make_cache
    model.make_cache = lambda *a, **k: built.append(make(*a, **k)) or built[-1]
    mlx_lm.generate(model, tokenizer, prompt=PROMPT, max_tokens=8)
    assert "calibrated query filter" in report.summary() and len(built) == 1
    n_prompt = len(tokenizer.encode(PROMPT))
    for c in built[0]:  # the caches mlx_lm.generate itself used
        assert c.filter is not None and c.size() == 64 and n_prompt < c.offset <= n_prompt + 8
    caches = model.make_cache()
    model(mx.array([tokenizer.encode(PROMPT)]), cache=caches)
    assert all(c.size() == 64 and c.offset == len(PROMPT) for c in caches)


def test_first_use_calibrates_once_says_so_and_the_next_build_loads_the_file(folder, empty_home,
                                                                                capsys, monkeypatch):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))
    first = KVCacheBuilder.for_model(model, tokenizer=tokenizer)
    err = capsys.readouterr().err
    path = empty_home / "filters" / f"{model_identity(model)}.safetensors"
    line = [x for x in err.splitlines() if "calibrated Q-Filters" in x]
    n = default_filters.CALIBRATION_TOKENS
    assert len(line) == 1 and f"from {n} tokens of pydoc_data.topics" in line[0]
    assert f"stored in {path}" in line[0] and "Calibrating Q-Filters" in err  # the progress bar
    # The filters are the paper's estimator on the first n tokens of the calibration text.
    from qfilters_mlx.assets.prompts import calibration_text
    from qfilters_mlx.filters.calibration import calibrate_filters

    ids, step = tokenizer.encode(calibration_text()[0])[:n], default_filters.CALIBRATION_CHUNK
    chunks = [ids[i:i + step] for i in range(0, n, step)]
    np.testing.assert_array_equal(_file_filters(path), np.array(calibrate_filters(model, chunks)))

    def refuse(*_a, **_k):
        raise AssertionError("calibrated again although the file exists")

    monkeypatch.setattr("qfilters_mlx.filters.calibration.calibrate_filters", refuse)
    second = KVCacheBuilder.for_model(model)
    assert "calibrated Q-Filters" not in capsys.readouterr().err
    assert "found by model identity" in second.report.filters
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.array(a.filter), np.array(b.filter))


def test_order_given_file_then_model_folder_then_user_cache(folder, empty_home, tmp_path):
    import mlx_lm

    from qfilters_mlx.filters.calibration import save_filters

    model, _ = mlx_lm.load(str(folder))
    rng = np.random.default_rng(0)
    arrays = [mx.array(rng.standard_normal((2, 1, 128)).astype(np.float32)) for _ in range(3)]
    given, in_folder = tmp_path / "given.safetensors", tmp_path / "folder"
    in_folder.mkdir()
    save_filters(str(given), arrays[0], model)
    save_filters(str(in_folder / default_filters.FOLDER_FILENAME), arrays[1], model)
    cached = default_filters.stored_path(model_identity(model))
    cached.parent.mkdir(parents=True)
    save_filters(str(cached), arrays[2], model)
    for cfg, path, want, how in (
            (KVCacheConfig(qfilters_filters=str(given)), in_folder, 0, "given"),
            (KVCacheConfig(), in_folder, 1, "the model folder's"),
            (KVCacheConfig(), None, 2, "found by model identity")):
        caches = KVCacheBuilder.for_model(model, cfg, model_path=path)
        np.testing.assert_array_equal(np.array(caches[1].filter), np.array(arrays[want][1]))
        assert how in caches.report.filters


def test_a_found_file_of_another_model_is_refused_not_replaced(folder, empty_home, tmp_path):
    import mlx_lm

    from qfilters_mlx.filters.calibration import save_filters

    model, _ = mlx_lm.load(str(folder))
    other = tiny_model_folder(tmp_path / "other", seed=1)
    other_model, _ = mlx_lm.load(str(other))
    save_filters(str(tmp_path / default_filters.FOLDER_FILENAME), mx.zeros((2, 1, 128)) + 1, other_model)
    with pytest.raises(ValueError, match="calibrated for another model.*weights"):
        KVCacheBuilder.for_model(model, model_path=tmp_path)
    assert (tmp_path / default_filters.FOLDER_FILENAME).exists()


def test_an_unwritable_cache_still_builds_and_says_it_was_not_stored(folder, tmp_path, monkeypatch,
                                                                    capsys):
    import mlx_lm

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("QFILTERS_MLX_HOME", str(blocker))
    model, _ = mlx_lm.load(str(folder))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=32))
    assert "not stored" in capsys.readouterr().err and "not stored" in caches.report.filters
    assert all(c.filter is not None for c in caches)


def test_a_failed_write_still_builds_says_so_and_leaves_no_temporary_file(folder, empty_home,
                                                                          monkeypatch, capsys):
    import mlx_lm

    def cannot_write(path, *_a, **_k):
        open(path, "wb").close()  # as a write that fails half-way leaves its file behind
        raise RuntimeError(f"[save_safetensors] Failed to open file {path}")

    monkeypatch.setattr("qfilters_mlx.filters.calibration.save_filters", cannot_write)
    model, _ = mlx_lm.load(str(folder))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=32))
    assert "not stored" in capsys.readouterr().err and "not stored" in caches.report.filters
    assert all(c.filter is not None for c in caches)
    assert not [p for p in empty_home.rglob("*") if p.is_file()]  # no file, not even a temporary one


def test_no_query_filter_to_be_had_says_so_and_names_the_command(folder, empty_home, monkeypatch,
                                                                 capsys):
    import mlx_lm

    from qfilters_mlx.filters.capture import QueriesNotCaptured

    def not_captured(*_a, **_k):
        raise QueriesNotCaptured("no post-RoPE queries were found for layer 0", {0: "inline"})

    monkeypatch.setattr("qfilters_mlx.filters.calibration.calibrate_filters", not_captured)
    model, _ = mlx_lm.load(str(folder))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=32))
    lines = [x for x in capsys.readouterr().err.splitlines() if "qfilters-mlx calibrate" in x]
    assert len(lines) == 1 and "online key-SVD filter, sign -1" in lines[0]
    assert caches[0].config.qfilters_filter_source == "keys" and caches[0].config.qfilters_sign == -1
    assert "no query-derived filter" in caches.report.filters


def test_cache_built_directly_with_the_default_needs_filters():
    with pytest.raises(ValueError, match="calibrated.*for_model"):
        QFiltersKVCache(KVCacheConfig(head_dim=16))
    c = QFiltersKVCache(KVCacheConfig(head_dim=16, qfilters_budget=8, qfilters_recent=0),
                        filters=mx.ones((2, 16)))
    c.update_and_fetch(mx.ones((1, 2, 12, 16)), mx.ones((1, 2, 12, 16)))
    assert c.size() == 8  # evicts from the first call


@pytest.mark.parametrize("sign", [-1, "auto"])
def test_the_calibrated_filter_takes_only_sign_plus_one(sign):
    with pytest.raises(ValueError, match="qfilters_sign.*calibrated"):
        KVCacheConfig(qfilters_sign=sign)


def test_default_config_is_valid_without_a_model_and_means_the_calibrated_filter():
    cfg = KVCacheConfig()
    assert cfg.qfilters_filter_source == "calibrated" and cfg.qfilters_sign == 1
    assert not cfg.needs_queries and json.loads(json.dumps(cfg.qfilters_filter_source)) == "calibrated"


def test_server_with_no_cache_flags_logs_the_calibrated_filter(folder, caplog):
    """``qfilters-mlx server``'s model provider (mlx-lm's ``ModelProvider._load``) with the
    configuration the server builds from no cache flags: the library's default, logged."""
    import argparse
    import logging

    from qfilters_mlx.commands import server

    p = server.cache_parser()
    args, rest = p.parse_known_args(["--port", "9"])
    config, described = server._config(p, args)
    assert config == KVCacheConfig() and "filter_source=calibrated" in described
    cli = argparse.Namespace(model=str(folder), adapter_path=None, draft_model=None, pipeline=False,
                             trust_remote_code=False, chat_template=None,
                             use_default_chat_template=False)
    provider = server.QFiltersModelProvider(cli)
    old, server._CONFIG = server._CONFIG, config
    try:
        with caplog.at_level(logging.INFO):
            provider._load(str(folder))
    finally:
        server._CONFIG = old
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))  # the file the server used: by model identity
    stored = default_filters.stored_path(model_identity(model))
    assert stored.is_file()
    line = [r.getMessage() for r in caplog.records if "qfilters-mlx: all" in r.getMessage()]
    assert len(line) == 1 and f"filter: calibrated query filter {stored}" in line[0]
    caches = provider.model.make_cache()
    np.testing.assert_array_equal(np.array(caches[0].filter), _file_filters(stored)[0])
    assert provider.is_batchable


def test_batch_generator_with_the_default_config_equals_each_row_alone():
    """mlx-lm's ``BatchGenerator`` builds and merges the installed caches itself: with the
    default config (the calibrated filter, no ``observe_queries``) each row's tokens, logprobs
    and kept positions equal the prompt generated alone."""
    from helpers.batch_helpers import batched, prompts, tiny_llama
    from helpers.batch_helpers import LENGTHS, _check_against_alone

    model = tiny_llama()
    cfg = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4)
    report = KVCacheBuilder.install(model, cfg)
    assert "calibrated query filter" in report.filters
    rows = prompts(LENGTHS)
    toks, caches, lps = batched(model, rows, 10)
    assert all(c.filter is not None and c.config.qfilters_filter_source == "calibrated"
               for cs in caches.values() for c in cs)
    assert max(c.size() for c in caches[3]) == 16  # the 70-token row holds the budget
    _check_against_alone(model, cfg, rows, toks, caches, lps, 10)


def test_a_file_made_without_a_tokenizer_is_replaced_once_a_tokenizer_is_at_hand(folder, empty_home):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))
    first = KVCacheBuilder.for_model(model)  # no tokenizer: the model samples its own text
    assert default_filters.TOKENIZER_FREE in first.report.filters
    second = KVCacheBuilder.for_model(model, tokenizer=tokenizer)
    assert "calibrated now" in second.report.filters and "pydoc_data" in second.report.filters
    third = KVCacheBuilder.for_model(model)  # the text-calibrated file now serves every build
    assert "found by model identity" in third.report.filters and "pydoc_data" in third.report.filters
    np.testing.assert_array_equal(np.array(third[0].filter), np.array(second[0].filter))
