"""Call boundaries of ``qfilters-mlx server``'s prompts and stored caches: where a prompt is
cut into model calls, and where a stored eviction cache can be rewound to so that a prompt
served from it gets its cold run's answer.

An eviction cache's state after a token depends on where the calls that fed it ended (each
call evicts at its end, and a call's later tokens attend to its earlier ones before that).
So a stored cache equals a cold run's only at a call boundary both runs have, and a rewind
is exact only to a boundary the cache recorded (:mod:`qfilters_mlx.cache.journal`: a rewind
that ends inside a recorded call re-applies that call's head as one call).
"""

from __future__ import annotations

import math

__all__ = ["PREFILL", "drops_prefix", "prefill_segments", "rewind_reach", "rewind_target", "rows_back_to"]

PREFILL = "prefill"
"""Cache type of a cut made only to align prefill calls: never stored."""

def prefill_segments(segments, types, step: int, cuts=()):
    """mlx-lm's prompt ``segments`` (lists of token ids, in prompt order) and their cache
    ``types``, cut at every multiple of ``step`` tokens of the whole prompt and at the
    absolute positions ``cuts`` (the same cuts whatever part of the prompt a stored cache
    supplies).

    Each piece but the last of a segment is typed :data:`PREFILL`; the last keeps the
    segment's type. ``step <= 0`` and no ``cuts``: unchanged.

    Returns:
        ``(pieces, types)``: lists of equal length; the pieces joined are the segments joined.
    """
    cuts = set(cuts)
    if step <= 0 and not cuts:
        return list(segments), list(types)
    pieces, kinds, start = [], [], 0
    for segment, kind in zip(segments, types):
        end = start + len(segment)
        inner = set(range((start // step + 1) * step, end, step)) if step > 0 else set()
        bounds = [start, *sorted(inner | {c for c in cuts if start < c < end}), end]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append(segment[a - start:b - start])
            kinds.append(PREFILL)
        kinds[-1] = kind
        start = end
    if len(pieces) > 1 and len(pieces[-1]) == 1 and kinds[-2] == PREFILL:
        kinds[-2] = kinds[-1]  # (mlx-lm computes a one-token last piece as the prompt's end:
        # the checkpoint of the segment is then where that piece starts)
    return pieces, kinds


def rewind_reach(caches) -> float:
    """Tokens every cache of ``caches`` can remove with ``trim`` now: an eviction cache's
    ``rewindable_tokens``; ``inf`` for a trimmable mlx-lm cache (it trims any count it holds),
    0 for an untrimmable one."""
    reach = math.inf
    for c in caches:
        if hasattr(c, "rewindable_tokens"):
            reach = min(reach, c.rewindable_tokens)
        elif not c.is_trimmable():
            return 0
    return reach


def rewind_target(caches, length: int, prefix: int, floor: int, accept) -> int | None:
    """Where to rewind a stored entry (``caches`` holding ``length`` tokens) for a prompt that
    shares ``prefix`` tokens with it: the largest token count ``t`` with ``floor < t <=
    prefix`` that the entry reaches without re-applying part of a recorded call and that
    ``accept(t)`` (a call boundary the cold run of the prompt also has); ``None``: none.

    Before any eviction every count within reach is exact and the same as a cold run's
    (nothing was dropped, so how the prompt was cut into calls changed nothing kept). After
    one, only where a journaled call or decode step starts (the same in every layer): a rewind
    that ends inside a recorded call re-applies its head as one evicting call, which the cold
    run never makes.
    """
    reach = rewind_reach(caches)
    lo = length - min(reach, length)
    ours = [c for c in caches if hasattr(c, "rewindable_tokens")]
    if not any(getattr(c, "evicted", False) for c in ours):
        t = min(prefix, length)
        return t if t > floor and t >= lo else None
    bounds, pos = [length], length
    for tokens, _ in ours[0]._journal.calls_newest_first():
        if tokens == 0:
            continue  # (a slot-layout switch: no token)
        pos -= tokens
        if pos < lo:
            break
        bounds.append(pos)
    for t in bounds:  # (newest first: the largest count first)
        if floor < t <= prefix and accept(t):
            return t
    return None


def rows_back_to(caches, length: int, target: int) -> int | None:
    """K/V rows of rewind journal (:func:`~qfilters_mlx.cache.journal.record_rows`) that
    take a stored entry (``caches`` holding ``length`` tokens) back to exactly ``target``
    tokens without splitting a recorded call; 0 before any eviction (a plain trim); ``None``
    when its journal does not reach there."""
    ours = [c for c in caches if hasattr(c, "rewindable_tokens")]
    if not ours or length - target > rewind_reach(caches):
        return None
    if not any(getattr(c, "evicted", False) for c in ours):
        return 0
    pos, rows = length, 0
    for tokens, held in ours[0]._journal.calls_newest_first():
        if pos <= target:
            break
        pos -= tokens
        rows += held
    return rows if pos == target else None


def drops_prefix(new_length: int, new_reach: float, old_type: str, old_length: int,
                 own_prompt: bool = False) -> bool:
    """Whether storing an entry (``new_length`` tokens, rewinding ``new_reach``) drops a stored
    entry that is a prefix of it (``old_type``, ``old_length < new_length`` tokens).

    Never a ``"system"`` checkpoint (other conversations start with it; the count and byte
    bounds limit them). Otherwise always when the new entry can rewind back to the old one's
    end (it serves the same prompts); else only when the old one is not ``own_prompt``: the
    checkpoint of the prompt a new answer continues (the longest stored prefix of an answer
    that is not a system prompt), which a regenerated answer reuses. An older turn of the same
    conversation, or a checkpoint a new prompt extends, is dropped.
    """
    if old_type == "system":
        return False
    if new_length - new_reach <= old_length:
        return True
    return not own_prompt
