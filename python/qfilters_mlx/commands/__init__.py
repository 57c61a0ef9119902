"""The ``qfilters-mlx`` command line: the only part of the package that loads models,
reads files and prints (docs/testing.md, "Layout")."""
