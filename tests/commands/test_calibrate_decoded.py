"""``qfilters-mlx calibrate --window-rule decoded``: the windows in the file are the decoded-loss
search's on the first ``--window-chunk`` calibration tokens, stored as the other rules' are."""

import json

import numpy as np
import pytest

from helpers.tiny_folder import tiny_model_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model", head_dim=16)


def test_decoded_windows_are_the_search_s_and_load(folder, tmp_path, capsys):
    import mlx.core as mx
    from mlx_lm import load

    from qfilters_mlx.commands.cli import main
    from qfilters_mlx.filters.calibration import load_filters
    from qfilters_mlx.evaluation.decoded_windows import search_windows
    from qfilters_mlx.filters.windows import RULES, load_windows

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    out = str(tmp_path / "f.safetensors")
    assert main(["calibrate", "--model", str(folder), "--text", str(text), "--out", out, "--tokens", "400",
                 "--chunk", "200", "--samples", "64", "--window-budgets", "24,40", "--window-chunk", "300",
                 "--window-rule", "decoded"]) == 0
    err = capsys.readouterr().err
    assert "rule decoded" in err and "budget 24: mean NLL" in err and "budget 40: mean NLL" in err
    model, tokenizer = load(str(folder))
    filters, meta = load_filters(out, model)
    ids = tokenizer.encode(text.read_text(), add_special_tokens=False)[:400][:300]
    for b in (24, 40):
        want, trace = search_windows(model, ids, np.array(filters), b, 4)
        assert load_windows(out, b, 4) == tuple(tuple(int(v) for v in row) for row in want)
        summary = json.loads(meta["recent_summary"])[str(b)]
        assert summary["rule"] == "decoded" and summary["nll"] == pytest.approx(trace["nll"], abs=1e-9)
        assert summary["start_nll"] == pytest.approx(trace["start_nll"], abs=1e-9)
        assert summary["mean_window"] == pytest.approx(float(np.mean(want)))
        assert summary["groups"] == [g["chosen"] for g in trace["groups"]] == [int(want[0, 0])]  # one group of 2
    assert meta["recent_rule"] == RULES["decoded"]
    assert mx.load(out)["recent_windows"].shape == (2, 2, 1)


def test_decoded_windows_refuse_a_text_too_short_before_searching(folder, tmp_path, capsys, monkeypatch):
    import qfilters_mlx.evaluation.decoded_windows as dw
    from qfilters_mlx.commands.cli import main

    searched = []
    monkeypatch.setattr(dw, "search_windows", lambda *a, **k: searched.append(a))
    text = tmp_path / "text.txt"
    text.write_text("short text " * 20)
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", str(folder), "--text", str(text), "--out", str(tmp_path / "f"),
              "--tokens", "131", "--window-budgets", "24,129,128", "--window-rule", "decoded"])
    assert ("--window-rule decoded: budgets 129 need more calibration tokens than 131: at least "
            "max(128, budget + 1) + 2") in capsys.readouterr().err
    assert not (tmp_path / "f").exists() and not searched  # budget 24 was not searched first


def test_a_model_the_simulation_cannot_mask_is_refused_naming_it(folder, tmp_path, capsys, monkeypatch):
    import mlx_lm.models.llama as llama

    from qfilters_mlx.commands.cli import main

    original = llama.scaled_dot_product_attention
    monkeypatch.setattr(llama, "scaled_dot_product_attention",
                        lambda *a, **k: original(*a, **k))  # attention the masks cannot reach
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", str(folder), "--text", str(text), "--out", str(tmp_path / "f"),
              "--tokens", "200", "--samples", "64", "--window-budgets", "24", "--window-rule", "decoded"])
    err = capsys.readouterr().err
    assert ("--window-rule decoded: simulated eviction: the attention of layers [0, 1] did not go through "
            "mlx-lm's scaled_dot_product_attention") in err
    assert not (tmp_path / "f").exists()


def test_default_budgets_too_long_for_the_text_are_skipped_and_said(folder, tmp_path, capsys):
    import mlx.core as mx

    from qfilters_mlx.commands.cli import main

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    out = str(tmp_path / "f.safetensors")
    # 131 tokens: budget 64 needs max(128, 65) + 2 = 130, 128 needs 131, 256 and 512 more
    assert main(["calibrate", "--model", str(folder), "--text", str(text), "--out", out, "--tokens", "131",
                 "--samples", "64", "--window-chunk", "131", "--window-rule", "decoded"]) == 0
    err = capsys.readouterr().err
    assert ("budgets 256, 512 skipped (the calibration sequences hold 131 tokens; a budget needs at least "
            "max(128, budget + 1) + 2)") in err
    assert mx.load(out, return_metadata=True)[1]["recent_budgets"] == "[64, 128]"
    assert main(["calibrate", "--model", str(folder), "--text", str(text), "--out", out, "--tokens", "131",
                 "--samples", "64", "--window-chunk", "131"]) == 0  # the measured rules need budget + 2
    assert "budgets 256, 512 skipped (the calibration sequences hold 131 tokens; a budget needs at least " \
           "budget + 2)" in capsys.readouterr().err
    assert mx.load(out, return_metadata=True)[1]["recent_budgets"] == "[64, 128]"
