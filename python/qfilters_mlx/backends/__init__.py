"""Kernel back ends behind one interface (:mod:`~qfilters_mlx.backends.dispatch`):
the pure-MLX ``reference`` (the oracle and the fallback), the compiled ``cpp``
extension and the ``metal`` kernels. Importing this package compiles nothing."""
