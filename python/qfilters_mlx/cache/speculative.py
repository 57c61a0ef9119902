"""Speculative decoding with eviction caches on the draft model too.

mlx-lm's ``speculative_generate_step`` asks only the main model's caches whether they can
rewind (``can_trim_prompt_cache``, before the prompt) and later trims the draft model's
caches through ``trim_prompt_cache``, which silently skips a cache that says it cannot. With
the default ``max_rewind="auto"`` an eviction cache journals its rewinds only when asked
before its first eviction, so unasked draft caches would keep rejected draft tokens at wrong
positions and the draft's proposals would degrade with no error. With ``kv_bits`` mlx-lm
turns every cache into its quantized copy mid-generation, and a quantized eviction cache
cannot rewind: the main model's rejected drafts would stay too.

:func:`guard_speculative` wraps ``mlx_lm.generate.speculative_generate_step`` once per
process; every eviction cache runs it when it is built or loaded, so the wrapper is in place
before any generation can use one. When the generator starts (at its first ``next``, as
mlx-lm's own), the wrapper builds the two models' caches exactly as mlx-lm does when none are
given, asks the draft model's eviction caches before the prompt (which turns their journals
on), and raises a ``ValueError`` naming the option that fixes it when one of them cannot
rewind or when ``kv_bits`` is asked of eviction caches. Caches that are not ours are left as
they are. Code that took a reference to ``speculative_generate_step`` before the first
eviction cache existed calls mlx-lm's function directly, unguarded.
"""

from __future__ import annotations

import functools
import importlib

from qfilters_mlx.model_info import walk

__all__ = ["guard_speculative"]

_MARKER = "_asks_qfilters_draft_caches"


def _ours(caches) -> list:
    """The eviction caches among ``caches`` (``CacheList`` members included)."""
    return [c for _, c in walk(caches) if hasattr(c, "rewindable_tokens")]


def check_speculative(caches, n_main_layers: int, kv_bits=None) -> None:
    """Refuse, before the prompt, speculative decoding that would leave rejected draft tokens
    in an eviction cache; ask the draft model's eviction caches ``is_trimmable()`` (their
    journals turn on). ``caches``: the main model's then the draft model's.

    Raises:
        ValueError: ``kv_bits`` with eviction caches, or a draft eviction cache that cannot
            rewind (names its index and the option).
    """
    if kv_bits is not None and _ours(caches):
        raise ValueError(
            f"speculative decoding with kv_bits={kv_bits}: a quantized eviction cache cannot "
            "rewind rejected draft tokens; leave kv_bits unset, or use mlx-lm's own caches")
    for i, c in enumerate(_ours(caches[n_main_layers:])):
        if not c.is_trimmable():
            raise ValueError(
                f"speculative decoding: the draft model's eviction cache {i} cannot rewind the "
                f"rejected draft tokens (max_rewind={c.max_rewind!r}"
                f"{', quantized K/V' if c.quantized else ''}"
                f"{', evicted without a journal' if c.evicted else ''}); build the draft's caches "
                "with max_rewind >= num_draft_tokens (or the default 'auto', before any "
                "eviction), or give the draft model mlx-lm's own caches")


def guard_speculative() -> None:
    """Make ``mlx_lm.generate.speculative_generate_step`` (and so ``mlx_lm.generate`` /
    ``stream_generate`` with ``draft_model``) check :func:`check_speculative` when it starts
    (module docstring). Idempotent, and cheap once done."""
    generate = importlib.import_module("mlx_lm.generate")  # (mlx_lm.generate, the package's
    # attribute, is the function of that name)
    original = generate.speculative_generate_step
    if getattr(original, _MARKER, False):
        return

    @functools.wraps(original)
    def speculative_generate_step(prompt, model, draft_model, *args, prompt_cache=None, **kwargs):
        if prompt_cache is None:
            make = generate.make_prompt_cache
            prompt_cache = list(make(model)) + list(make(draft_model))
        check_speculative(prompt_cache, len(model.layers), kwargs.get("kv_bits"))
        yield from original(prompt, model, draft_model, *args, prompt_cache=prompt_cache, **kwargs)

    setattr(speculative_generate_step, _MARKER, True)
    generate.speculative_generate_step = speculative_generate_step
