"""The ``qfilters-mlx`` console script: the parser and the dispatch to one module per subcommand.

Subcommands: ``prepare-model`` (:mod:`~qfilters_mlx.commands.prepare`), ``generate``
(:mod:`~qfilters_mlx.commands.generate`, with ``--compare`` in
:mod:`~qfilters_mlx.commands.compare`), ``cache-prompt``
(:mod:`~qfilters_mlx.commands.cache_prompt`), ``calibrate``
(:mod:`~qfilters_mlx.commands.calibrate`), ``eval``
(:mod:`~qfilters_mlx.commands.eval`) and ``server``
(:mod:`~qfilters_mlx.commands.server`). Each module has ``add_parser(sub)`` and
``run(parser, args, blas_library)``.

Fast BLAS on Linux: :func:`main` calls :func:`qfilters_mlx.blas.ensure_fast_blas`
before anything imports mlx (the subcommand modules are imported inside
:func:`build_parser`); when run as a program (``argv is None``) in a process that
already imported mlx, that re-executes this module once with ``LD_PRELOAD``. A
library call ``main([...])`` never re-executes. ``QFILTERS_MLX_NO_FAST_BLAS=1``
skips all of this.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]

_MODULE = "qfilters_mlx.commands.cli"
"""This module's name, re-executed with ``python -m`` (pyproject's console script points here)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``qfilters-mlx`` argument parser (imports mlx through the config module)."""
    from qfilters_mlx import __version__
    from qfilters_mlx.commands import (cache_prompt, calibrate, eval as eval_command, generate,
                                       prepare, server)

    parser = argparse.ArgumentParser(prog="qfilters-mlx",
                                     description="Q-Filters KV-cache eviction for MLX / mlx-lm.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (prepare, generate, cache_prompt, calibrate, eval_command, server):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qfilters-mlx`` console script.

    Args:
        argv: arguments without the program name; ``None`` reads ``sys.argv``
            (and allows one re-execution with ``LD_PRELOAD`` for fast BLAS).

    Returns:
        The subcommand's exit status; argument errors exit with status 2 through
        argparse, ``--version`` and ``--help`` with 0.
    """
    from qfilters_mlx.blas import ensure_fast_blas

    blas_library = ensure_fast_blas(_MODULE if argv is None else None)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passes_through", False):  # `server`: the rest goes to mlx_lm.server
        args.server_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args._run(args._parser, args, blas_library)


if __name__ == "__main__":
    sys.exit(main())
