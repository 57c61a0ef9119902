"""The architecture matrix: how ``KVCacheBuilder.for_model`` treats every mlx-lm architecture.

Shared by ``tests/models/test_architectures.py`` (which checks each row's promise) and
``tools/arch_table.py`` (which prints the table of docs/mlx-lm.md). A row is one
``mlx_lm.models`` module, built tiny by :mod:`arch_models`:

* ``supported``: every cache slot gets a :class:`QFiltersKVCache`;
* ``partial``: attention slots are budgeted, the others keep the model's own
  cache (their memory is bounded: sliding window, recurrent state, chunk);
* ``refused``: ``for_model`` raises at build time (the reason is the error's cause);
* ``skipped``: the tiny model cannot be built here (the reason says why).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from helpers import arch_models
from qfilters_mlx import KVCacheBuilder, KVCacheConfig
from qfilters_mlx.model_info import BOUNDED_CACHES

BUILD_CONFIG = KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_recent=2,
                             qfilters_calib_tokens=4, qfilters_filter_source="keys")
"""The configuration every row is built with (eviction after a few tokens)."""


@dataclass(frozen=True)
class Row:
    module: str
    status: str  # supported | partial | refused | skipped
    why: str


@functools.lru_cache(maxsize=None)
def tiny_model(name: str):
    """The module's tiny model (built once per process), or the exception that prevented it."""
    try:
        return arch_models.build(name)
    except (ImportError, NotImplementedError) as err:
        return err


def _refusal_cause(msg: str) -> str:
    if "multi-head latent attention" in msg:
        return "multi-head latent attention (MLA): the cache holds a compressed latent, not per-head keys"
    if "no layer stores per-head keys" in msg:
        kinds = msg.split("(the model's caches: ", 1)[1].split(")", 1)[0]
        return f"no attention KV cache to budget (the model's caches: {kinds})"
    if "beyond mlx-lm's cache protocol" in msg:
        return "reads its attention caches beyond mlx-lm's cache protocol (" + msg.rsplit("(", 1)[1].split(")")[0] + ")"
    return msg


@functools.lru_cache(maxsize=None)
def row(name: str) -> Row:
    """Build the module's caches with :data:`BUILD_CONFIG` and classify the result."""
    model = tiny_model(name)
    if isinstance(model, Exception):
        why = str(model)
        if isinstance(model, ImportError):
            why = f"cannot be imported here ({why})"
        return Row(name, "skipped", why)
    try:
        caches = KVCacheBuilder.for_model(model, BUILD_CONFIG)
    except ValueError as err:
        return Row(name, "refused", _refusal_cause(str(err)))
    report = caches.report
    inside = " (inside CacheList)" if any(len(s.path) > 1 for s in report.budgeted) else ""
    if not report.partial:
        return Row(name, "supported", f"every cache is a plain attention KVCache: all budgeted{inside}")
    kept = sorted({s.cache_type for s in report.kept})
    why = "; ".join(f"{t} kept ({BOUNDED_CACHES.get(t, 'as the model built it')})" for t in kept)
    return Row(name, "partial", f"attention KVCache budgeted{inside}; {why}")


def rows() -> list[Row]:
    return [row(n) for n in arch_models.decoder_modules()]


def markdown_table(all_rows: list[Row] | None = None) -> str:
    """The architecture table of docs/mlx-lm.md (``| architecture | status | why |``), one line per module."""
    all_rows = rows() if all_rows is None else all_rows
    lines = ["| architecture | status | why |", "|---|---|---|"]
    lines += [f"| {r.module} | {r.status} | {r.why} |" for r in all_rows]
    return "\n".join(lines) + "\n"
