"""Per-head recent windows: the ``recent`` argument of the selection ops.

Every backend's ``select_compact`` and ``decode_select`` take ``recent`` as one int
(every head keeps its last ``recent`` positions) or one window per KV head (``H``
ints: head ``h`` keeps its last ``recent[h]``). This module expands and checks it;
it imports nothing from MLX.
"""

from __future__ import annotations

import numbers


def recent_windows(recent, n_heads: int, n_sink: int, limit: int, inclusive: bool,
                   limit_name: str = "budget") -> list[int]:
    """The recent window of each head: ``recent`` is one int (every head) or a
    sequence / 1-D array of ``n_heads`` ints (head ``h``'s window).

    Returns:
        ``n_heads`` Python ints.

    Raises:
        TypeError: a window is not an integer.
        ValueError: wrong count, a window < 0, ``n_sink < 0``, or ``n_sink + window``
            above ``limit`` (``inclusive``) / at or above it (otherwise); the message names
            the head.
    """
    if hasattr(recent, "tolist"):
        recent = recent.tolist()
    per_head = isinstance(recent, (list, tuple))
    if per_head:
        values = list(recent)
        if len(values) != n_heads:
            raise ValueError(f"recent must be one int or one window per head ({n_heads}), "
                             f"got {len(values)} values")
    else:
        values = [recent] * n_heads
    for h, v in enumerate(values):
        where = f" (head {h})" if per_head and len(values) > 1 else ""
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"recent must be an int{where}, got {type(v).__name__}")
        v = values[h] = int(v)
        total = n_sink + v
        if v < 0 or n_sink < 0:
            raise ValueError(f"n_sink and recent must be >= 0, got {n_sink}, {v}{where}")
        if inclusive and total > limit:
            raise ValueError(f"n_sink + recent ({total}) must not exceed {limit_name} ({limit}){where}")
        if not inclusive and total >= limit:
            raise ValueError(f"n_sink + recent ({total}) must be smaller than {limit_name} ({limit}){where}")
    return values
