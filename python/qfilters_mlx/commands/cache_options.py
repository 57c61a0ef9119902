"""From the cache flags to a validated :class:`~qfilters_mlx.config.KVCacheConfig` and the
:class:`~qfilters_mlx.cache.builder.KVCacheBuilder` holding the build flags (``--backend``,
``--max-rewind``).

Which flag does something depends on the method (and, for ``qfilters``, on
``--filters``): :func:`applicable_flags` is that table, :func:`ignored_flags`
lists what the user gave that does nothing (the command warns), and
:func:`describe_config` prints only what applies. Defaults come from
:mod:`qfilters_mlx.config` (the library's; one set for both).
"""

from __future__ import annotations

import contextlib
import re
import sys

from qfilters_mlx.config import DEFAULT_FILTER_SOURCE, KVCacheConfig, with_stored_windows
from qfilters_mlx.scorers import scorer_class

__all__ = ["applicable_flags", "builder_from_args", "config_from_args", "describe_config",
           "heads_from_args", "ignored_flags", "warn_ignored"]

# KVCacheConfig field -> the flag that sets it (to name flags in its errors).
FIELD_FLAGS = {
    "qfilters_calib_tokens": "--calib-tokens",
    "qfilters_budget": "--budget",
    "qfilters_n_sink": "--n-sink",
    "qfilters_recent": "--recent",
    "qfilters_sign": "--sign",
    "qfilters_seed": "--seed",
    "qfilters_filter_source": "--filter-source",
    "qfilters_filters": "--filters",
}
BUILD_FLAGS = {"backend": "--backend", "max_rewind": "--max-rewind"}
"""Build option -> its flag."""

_CACHE_FLAGS = ("budget", "max_kv_size", "n_sink", "recent", "calib_tokens", "filter_source",
                "sign", "filters", "heads")


def _calibrated(args) -> bool:
    """Whether ``args`` ask for the calibrated filter (``--filter-source``, default calibrated)."""
    return (getattr(args, "filter_source", None) or DEFAULT_FILTER_SOURCE) == "calibrated"


def applicable_flags(method: str, has_filters: bool, calibrated: bool = False) -> set[str]:
    """The cache flags (``args`` attribute names) that change what ``method`` does
    (``has_filters``: ``--filters`` given; ``calibrated``: the calibrated filter, whose
    filter needs no ``--calib-tokens`` or ``--sign``)."""
    scorer = scorer_class(method)
    if not scorer.evicts:
        return set()
    flags = {"budget", "max_kv_size", "n_sink", "heads"}
    if not scorer.ranks:
        return flags
    flags.add("recent")
    if scorer.uses_filter:
        flags.add("filters")
        if not has_filters:
            flags.add("filter_source")
            if not calibrated:
                flags |= {"calib_tokens", "sign"}
    return flags


def ignored_flags(args, method: str | None = None) -> list[str]:
    """Cache flags given on the command line that do nothing for ``method`` (default ``args.method``)."""
    method = method or args.method
    keep = applicable_flags(method, args.filters is not None, _calibrated(args))
    return ["--" + name.replace("_", "-") for name in _CACHE_FLAGS
            if getattr(args, name, None) is not None and name not in keep]


def warn_ignored(parser, args, method: str | None = None) -> None:
    """One warning line on stderr per given flag that ``method`` does not use."""
    method = method or args.method
    detail = ("" if not scorer_class(method).uses_filter else " with --filters" if args.filters is not None else
              " with the calibrated filter (--filter-source calibrated)" if _calibrated(args) else "")
    for flag in ignored_flags(args, method):
        print(f"{parser.prog}: warning: {flag} does nothing with --method {method}{detail} "
              f"(ignored)", file=sys.stderr)


def _budget(parser, args) -> int | None:
    if args.max_kv_size is not None and args.budget is not None and args.max_kv_size != args.budget:
        parser.error(f"--max-kv-size {args.max_kv_size} and --budget {args.budget} disagree: "
                     f"--max-kv-size is mlx-lm's name for the budget; give one of them")
    return args.budget if args.budget is not None else args.max_kv_size


def config_from_args(parser, args, method: str | None = None, budget: int | None = None):
    """The validated ``KVCacheConfig`` for ``args``; errors go to ``parser.error`` naming the flag.

    Args:
        method: overrides ``args.method`` (the comparison mode runs several).
        budget: overrides the budget flags (the comparison mode's ``METHOD@BUDGET``).

    Flags that ``method`` does not use are left out (the library's defaults stand in),
    so ``--method full --budget 8 --recent 8`` is accepted.
    """
    method = method or args.method
    keep = applicable_flags(method, args.filters is not None, _calibrated(args))
    given = {name: getattr(args, name) for name in _CACHE_FLAGS
             if name in keep and getattr(args, name, None) is not None}
    kwargs = {"method": method,
              "qfilters_seed": args.seed if getattr(args, "seed", None) is not None else 0}
    if "budget" in keep:
        b = budget if budget is not None else _budget(parser, args)
        if b is not None:
            kwargs["qfilters_budget"] = b
    for name, field in (("n_sink", "qfilters_n_sink"), ("recent", "qfilters_recent"),
                        ("calib_tokens", "qfilters_calib_tokens"),
                        ("filter_source", "qfilters_filter_source"), ("filters", "qfilters_filters"),
                        ("sign", "qfilters_sign")):
        if name in given:
            kwargs[field] = given[name]
    with _flag_errors(parser):
        config = with_stored_windows(KVCacheConfig(**kwargs))  # (--recent calibrated: read now)
    builder_from_args(parser, args)  # the build flags fail before the model loads, too
    return config


def heads_from_args(args, config):
    """``KVCacheBuilder.for_model``'s ``heads`` for ``args``: ``--heads`` where ``config``'s
    method has a budget, else ``None`` (the flag is then ignored, with the warning of
    :func:`warn_ignored`)."""
    heads = getattr(args, "heads", None)
    return heads if heads is not None and config.scorer.evicts else None


def builder_from_args(parser, args):
    """The :class:`~qfilters_mlx.cache.builder.KVCacheBuilder` of the build flags: ``--backend``
    (checked to be available now, before any model loads) and ``--max-rewind`` (default: the
    library's, or ``--num-draft-tokens`` with ``--draft-model``). Errors go to ``parser.error``
    naming the flag."""
    from qfilters_mlx.backends.dispatch import get_backend
    from qfilters_mlx.cache.builder import KVCacheBuilder

    max_rewind = getattr(args, "max_rewind", None)
    if max_rewind is None and getattr(args, "draft_model", None) is not None:
        max_rewind = args.num_draft_tokens  # rewinds only speculative decoding needs
    with _flag_errors(parser):
        builder = KVCacheBuilder(backend=getattr(args, "backend", None), max_rewind=max_rewind)
        get_backend(builder.backend or "auto")
    return builder


@contextlib.contextmanager
def _flag_errors(parser):
    """Turn a ``TypeError`` / ``ValueError`` raised inside into ``parser.error`` naming the flag."""
    try:
        yield
    except (TypeError, ValueError) as err:
        message = str(err)
        for field, flag in FIELD_FLAGS.items():
            message = re.sub(rf"\b{field}\b", flag, message)
        for option, flag in BUILD_FLAGS.items():  # (a message naming the option starts with it)
            message = re.sub(rf"^{option}\b", flag, message)
        parser.error(message)


def describe_config(config, heads: str | None = None) -> str:
    """The configuration in flag terms, only what applies to its method (``heads``: ``--heads``)."""
    parts, scorer = [f"method={config.method}"], config.scorer
    if not scorer.evicts:
        return parts[0] + " (keeps every token)"
    parts.append(f"budget={config.qfilters_budget} n_sink={config.qfilters_n_sink}")
    if heads is not None:
        parts.append(f"heads={heads} (the model's retrieval heads at their own budgets, the same "
                     f"bytes in all)")
    if not scorer.ranks:
        parts.append(f"recent={config.protected_recent} (budget - n_sink)")
    elif isinstance(config.qfilters_recent, int):
        parts.append(f"recent={config.qfilters_recent}")
    else:  # per-head windows: [n_layers, H_kv] or [H_kv]
        rows = config.qfilters_recent if isinstance(config.qfilters_recent[0], tuple) else (config.qfilters_recent,)
        flat = [w for row in rows for w in row]
        parts.append(f"recent=per head ({min(flat)}..{max(flat)}, mean {sum(flat) / len(flat):.1f})")
    if scorer.uses_filter:
        f = config.qfilters_filters
        if f is not None:
            parts.append(f"filters={f if isinstance(f, str) else 'array'}")
        elif config.qfilters_filter_source == "calibrated":
            parts.append("filter_source=calibrated (the model's calibrated query filter, found or "
                         "made once)")
        else:
            sign = config.qfilters_sign
            sign = sign if isinstance(sign, str) else f"{sign:+d}"
            parts.append(f"filter_source={config.qfilters_filter_source} sign={sign} "
                         f"calib_tokens={config.qfilters_calib_tokens}")
    if scorer.seeded:
        parts.append(f"seed={config.qfilters_seed}")
    return " ".join(parts)
