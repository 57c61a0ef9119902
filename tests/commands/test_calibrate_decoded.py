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
    from qfilters_mlx.filters.decoded_windows import search_windows
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
    assert meta["recent_rule"] == RULES["decoded"]
    assert mx.load(out)["recent_windows"].shape == (2, 2, 1)


def test_decoded_windows_refuse_a_text_too_short(folder, tmp_path, capsys):
    from qfilters_mlx.commands.cli import main

    text = tmp_path / "text.txt"
    text.write_text("short text " * 20)
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", str(folder), "--text", str(text), "--out", str(tmp_path / "f"),
              "--tokens", "120", "--window-budgets", "24", "--window-rule", "decoded"])
    assert "--window-rule decoded: needs more than 129 calibration tokens" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()
