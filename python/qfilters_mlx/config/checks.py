"""Field checks shared by the configuration's parts (each error names the field)."""

from __future__ import annotations

INT32_MAX = 2**31 - 1
"""Largest budget/sink/window the kernels index with int32."""


def check_int(name: str, value, minimum: int, maximum: int = INT32_MAX) -> None:
    """Raise unless ``value`` is an int in ``[minimum, maximum]`` (errors name the field ``name``).

    Raises:
        ValueError: ``value`` is None or outside the range.
        TypeError: ``value`` is not an int (a bool is not one).
    """
    if value is None:
        raise ValueError(f"{name} must be an int >= {minimum}, got None")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum} (int32 kernels), got {value}")


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
