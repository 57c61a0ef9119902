"""The kernel backends available on this machine, for tests that run on every one."""

import mlx.core as mx


def available_backends() -> list[str]:
    """``["reference"]``, plus ``"cpp"`` when the compiled extension imports, plus
    ``"metal"`` when a Metal GPU is present (a Mac)."""
    names = ["reference"]
    try:
        from qfilters_mlx import _ext  # noqa: F401
        names.append("cpp")
    except ImportError:
        pass
    if mx.metal.is_available():
        names.append("metal")
    return names


BACKENDS = available_backends()


def examples(n: int) -> int:
    """Hypothesis ``max_examples``: ``n`` scaled by ``QF_TEST_EXAMPLES_SCALE`` (default 1;
    ``tools/mutation.py`` lowers it so that each mutant's run stays short)."""
    import os

    return max(1, round(n * float(os.environ.get("QF_TEST_EXAMPLES_SCALE", "1"))))
