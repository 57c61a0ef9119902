"""Speculative decoding with eviction caches on the draft model too.

mlx-lm's ``speculative_generate_step`` asks only the main model's caches whether they can
rewind (``can_trim_prompt_cache``, before the prompt) and later trims the draft model's
caches through ``trim_prompt_cache``, which silently skips a cache that says it cannot. With
the default ``max_rewind="auto"`` an eviction cache journals its rewinds only when asked
before its first eviction, so unasked draft caches would keep rejected draft tokens at wrong
positions and the draft's proposals would degrade with no error.

:func:`guard_speculative` (run by ``KVCacheBuilder.for_model`` and ``install``) wraps
``mlx_lm.generate.speculative_generate_step`` once per process: before the prompt it asks the
draft model's eviction caches too, which turns their journals on, and raises a
``ValueError`` naming ``max_rewind`` when one of them cannot rewind (``max_rewind=0``,
quantized storage, or evicted already without a journal). It builds the two models' caches
exactly as mlx-lm does when none are given; mlx-lm's own caches are left as they are.
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["guard_speculative"]

_MARKER = "_asks_qfilters_draft_caches"


def _check_draft(caches) -> None:
    """Ask every eviction cache of ``caches`` (a draft model's) :meth:`is_trimmable`.

    Raises:
        ValueError: one cannot rewind (names its layer and the option).
    """
    for i, c in enumerate(caches):
        if hasattr(c, "rewindable_tokens") and not c.is_trimmable():
            raise ValueError(
                f"speculative decoding: the draft model's cache of layer {i} cannot rewind the "
                f"rejected draft tokens (max_rewind={c.max_rewind!r}"
                f"{', quantized K/V' if getattr(c, 'quantized', False) else ''}"
                f"{', evicted without a journal' if c.evicted else ''}); build the draft's caches "
                "with max_rewind >= num_draft_tokens (or the default 'auto', before any "
                "eviction), or give the draft model mlx-lm's own caches")


def guard_speculative() -> None:
    """Make ``mlx_lm.generate.speculative_generate_step`` (and so ``mlx_lm.generate`` /
    ``stream_generate`` with ``draft_model``) ask the draft model's eviction caches before the
    prompt (module docstring). Idempotent; changes nothing for caches that are not ours."""
    from mlx_lm.models.cache import make_prompt_cache

    generate = importlib.import_module("mlx_lm.generate")  # (the package's attribute of that name
    # is the function mlx_lm.generate)

    original = generate.speculative_generate_step
    if getattr(original, _MARKER, False):
        return

    @functools.wraps(original)
    def speculative_generate_step(prompt, model, draft_model, *args, prompt_cache=None, **kwargs):
        if prompt_cache is None:
            prompt_cache = list(make_prompt_cache(model)) + list(make_prompt_cache(draft_model))
        _check_draft(prompt_cache[len(model.layers):])
        return original(prompt, model, draft_model, *args, prompt_cache=prompt_cache, **kwargs)

    setattr(speculative_generate_step, _MARKER, True)
    generate.speculative_generate_step = speculative_generate_step
