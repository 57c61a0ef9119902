"""What ``generate`` prints after the text: cache totals, bytes in context, the comparison table.

Pure functions of the caches, the model and a :class:`~qfilters_mlx.commands.generation.RunResult`
(no printing here except :func:`print_lines`), so tests check the arithmetic directly.
"""

from __future__ import annotations

__all__ = ["cache_summary", "compression_text", "human_bytes", "kv_in_context", "print_lines",
           "table", "weight_bytes"]


def human_bytes(n: int) -> str:
    """``n`` bytes in B / KiB / MiB / GiB (powers of 2, two decimals above 1 KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def cache_summary(caches) -> dict:
    """Totals over the eviction caches of one model (other layer caches are skipped).

    Returns:
        ``layers`` (eviction caches), ``tokens_seen`` and ``kept_tokens`` (max over
        layers), ``kept_bytes`` (``qfilters_kept_bytes``: kept K/V, their float32 scores
        and the filter), ``full_bytes`` (K/V of every token seen, what a full cache
        holds), ``evicted`` (whether any layer evicted a token), ``compression_ratio``
        (``full_bytes / kept_bytes``, 1.0 when nothing is kept).
    """
    from qfilters_mlx.cache.build_report import eviction_caches

    ours = eviction_caches(caches)  # (CacheList members and head groups too)
    kept = sum(c.qfilters_kept_bytes for c in ours)
    full = sum(c.full_seq_bytes for c in ours)
    return {
        "layers": len(ours),
        "tokens_seen": max((c.tokens_seen for c in ours), default=0),
        "kept_tokens": max((c.size() for c in ours), default=0),
        "kept_bytes": kept,
        "full_bytes": full,
        "evicted": any(c.evicted for c in ours),
        "compression_ratio": full / kept if kept else 1.0,
    }


def compression_text(s: dict, method: str) -> str:
    """The compression line: a ratio only once something was evicted.

    Before the first eviction the kept bytes include the scores and the filter, so
    they exceed the full cache's (a ratio below 1 that means nothing was lost).
    """
    from qfilters_mlx.scorers import scorer_class

    if not scorer_class(method).evicts:
        return f"none (method {method} keeps every token)"
    if not s["evicted"]:
        return (f"nothing evicted yet ({s['tokens_seen']} tokens seen, within the budget or "
                f"before the filter is estimated)")
    return f"{s['compression_ratio']:.2f}x"


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (``nbytes`` summed over ``model.parameters()``)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def kv_in_context(kv_bytes: int, weights: int) -> str:
    """``kv_bytes`` with its share of the weights, e.g. ``11.36 MiB (2.2% of 513.0 MiB weights)``."""
    share = 100.0 * kv_bytes / weights if weights else 0.0
    return f"{human_bytes(kv_bytes)} ({share:.1f}% of the {human_bytes(weights)} of weights)"


def print_lines(lines: list[tuple[str, str]]) -> None:
    """Print ``key: value`` lines with the values aligned."""
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key + ':':<{width + 1}} {value}")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (columns padded to align in a terminal)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])
