"""Decode steps of the rewind journal packed at rest.

A slot-mode decode step's undo record (``StepRecord`` in :mod:`.journal`) holds five small
arrays per layer: the slot it wrote ``[B, H]`` and the rows that slot held (K/V ``[B, H, 1,
D]``, score and position ``[B, H, 1]``). A stored cache whose journal keeps 64 steps then
holds about 10,000 arrays over 30 layers, and each array costs the process about 500 bytes
besides its data (MLX's array and buffer objects, the Python wrapper, the allocator's
rounding): about 5 MB that no byte count sees, per stored entry. :class:`StepRun` holds a run
of consecutive steps as the same arrays stacked on a leading step axis (``[k, B, H, ...]``):
five arrays per layer whatever ``k``. A rewind takes its steps back newest first
(:meth:`StepRun.pop_last`: views of the stacked arrays), so what it undoes is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

__all__ = ["StepRun", "pack_runs"]


def _stack(items):
    """``items`` (nested tuples of arrays, one per step, the same structure) stacked per leaf."""
    first = items[0]
    if isinstance(first, tuple):
        return tuple(_stack(list(parts)) for parts in zip(*items))
    return mx.stack(items)


def _at(x, index):
    if isinstance(x, tuple):
        return tuple(_at(a, index) for a in x)
    return x[index]


def _shape(x):
    if isinstance(x, tuple):
        return tuple(_shape(a) for a in x)
    return (tuple(x.shape), x.dtype)


@dataclass
class StepRun:
    """Consecutive slot-mode decode steps: ``free [k, B, H]`` int32 (the slot each wrote),
    ``rows`` the (keys, values, scores, positions) each slot held, stacked
    (``[k, B, H, 1, D]``, or the quantized cache's tuples of such arrays; ``[k, B, H, 1]``),
    ``n`` the live rows before each step; oldest first."""

    free: mx.array
    rows: tuple
    n: list

    @property
    def tokens(self) -> int:
        return len(self.n)

    def pop_last(self) -> tuple:
        """``(free, rows, n)`` of the newest step, removed from the run."""
        out = (self.free[-1], _at(self.rows, -1), self.n[-1])
        self.free, self.rows, self.n = self.free[:-1], _at(self.rows, slice(0, -1)), self.n[:-1]
        return out

    def drop_oldest(self, k: int) -> None:
        """Forget the ``k`` oldest steps."""
        self.free, self.rows, self.n = self.free[k:], _at(self.rows, slice(k, None)), self.n[k:]


def pack_runs(records, packable) -> list:
    """``records`` with every run of two or more consecutive ``packable(record)`` steps whose
    arrays have the same shapes replaced by one :class:`StepRun` (a packable record has
    ``free``, ``rows`` and ``n``, and covers one token)."""
    out, run = [], []

    def flush():
        if len(run) > 1:
            out.append(StepRun(_stack([r.free for r in run]), _stack([r.rows for r in run]),
                               [r.n for r in run]))
        else:
            out.extend(run)
        run.clear()

    for r in records:
        if packable(r) and (not run or _shape((r.free, r.rows)) == _shape((run[0].free, run[0].rows))):
            run.append(r)
            continue
        flush()
        if packable(r):
            run.append(r)
        else:
            out.append(r)
    flush()
    return out
