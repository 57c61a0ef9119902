"""``Backend``: the operations every kernel back end provides (shapes and semantics:
:mod:`qfilters_mlx.backends.dispatch`). Ops a back end lacks default to the reference's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from qfilters_mlx.backends import reference


@dataclass(frozen=True)
class Backend:
    """The operations of one backend (see the module docstring for shapes)."""

    name: str
    projection_scores: Callable[[mx.array, mx.array, int], mx.array]
    select_compact: Callable[..., tuple[mx.array, mx.array, mx.array]]
    decode_select: Callable[..., tuple] = reference.decode_select
    write_slot: Callable[..., mx.array] = reference.write_slot
    decode_select_keys: Callable[..., tuple] | None = None

    def __post_init__(self):
        if self.decode_select_keys is None:  # compose this backend's own two ops
            project, select = self.projection_scores, self.decode_select

            def decode_select_keys(scores, positions, new_keys, filters, free, position, sign,
                                   n_sink, recent):
                return select(scores, positions, project(new_keys, filters, sign), free,
                              position, n_sink, recent)

            object.__setattr__(self, "decode_select_keys", decode_select_keys)
