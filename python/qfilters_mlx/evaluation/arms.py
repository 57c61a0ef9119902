"""The arms of the model-level evaluation, as data.

An :class:`Arm` names one eviction method with its fixed settings (sign,
recent window as a fraction of the budget); :func:`Arm.config` turns it into
a validated :class:`~qfilters_mlx.config.KVCacheConfig` for one budget and
:func:`Arm.make_cache` into one layer's cache. New arms (for example the
query-derived filters of :func:`query_arms`) plug in by adding an ``Arm`` to a list,
with their own ``cache_factory`` when ``QFiltersKVCache(config)`` is not
enough; the harness never branches on arm names.

The default list (:func:`default_arms`): Q-Filters key-SVD sign +1 and -1, L2Norm and
random, each with ``recent`` in ``{0, budget/4, budget/2}``, and StreamingLLM
(4 sinks + the rest recent). The full cache is not an arm of the batch: the
harness runs it with mlx-lm's own ``KVCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

__all__ = ["Arm", "RECENT_FRACTIONS", "default_arms", "expand", "perhead_arm", "query_arms",
           "retrieval_arms"]

RECENT_FRACTIONS = (Fraction(0), Fraction(1, 4), Fraction(1, 2))
"""Recent windows of the default arms, as fractions of the budget."""


@dataclass(frozen=True)
class Arm:
    """One evaluated method with fixed settings.

    Attributes:
        name: unique label used in results files (e.g. ``"qfilters-keys-sign-1@r1/2"``).
        method: a ``KVCacheConfig.method``.
        sign: ``qfilters_sign`` (only read by ``qfilters``).
        recent: recent window as a fraction of the budget (floored); ignored
            by ``streaming_llm``, which keeps ``budget - n_sink`` recent tokens.
        family: label that groups arms differing only by ``recent`` (tables, plots).
        filter_source: ``qfilters_filter_source`` (only read by ``qfilters``).
        cache_factory: optional ``(config, layer_idx, **build) -> cache`` (``build``: the
            build options of :meth:`make_cache`); default ``build_cache(config, layer_idx,
            **build)`` (:mod:`qfilters_mlx.cache.kv_cache`).
        extra: free-form settings recorded in results (JSON-serialisable).
    """

    name: str
    method: str
    sign: int = 1
    recent: Fraction = Fraction(0)
    family: str = ""
    filter_source: str = "keys"
    cache_factory: Callable | None = field(default=None, compare=False, repr=False)
    extra: tuple = ()

    def recent_tokens(self, budget: int) -> int:
        """The recent window in tokens at ``budget``."""
        return int(self.recent * budget)

    def config(self, budget: int, *, n_sink: int = 4, calib_tokens: int = 128, seed: int = 0,
               head_dim: int | None = None):
        """The validated ``KVCacheConfig`` of this arm at ``budget``.

        Raises:
            ValueError: the combination is invalid (e.g. ``n_sink + recent >= budget``).
        """
        from qfilters_mlx.config import KVCacheConfig

        return KVCacheConfig(
            method=self.method,
            head_dim=head_dim,
            qfilters_budget=budget,
            qfilters_n_sink=n_sink,
            qfilters_recent=0 if self.method == "streaming_llm" else self.recent_tokens(budget),
            qfilters_calib_tokens=calib_tokens,
            qfilters_sign=self.sign,
            qfilters_seed=seed,
            qfilters_filter_source=self.filter_source,
        )

    def make_cache(self, config, layer_idx: int, **build):
        """One layer's cache for this arm; ``build``: build options, the keywords of
        :func:`~qfilters_mlx.cache.kv_cache.build_cache` (``backend``, ``max_rewind``,
        ``bits``, ``group_size``)."""
        if self.cache_factory is not None:
            return self.cache_factory(config, layer_idx, **build)
        from qfilters_mlx.cache.kv_cache import build_cache

        return build_cache(config, layer_idx=layer_idx, **build)

    def describe(self, budget: int, n_sink: int) -> dict:
        """JSON-serialisable settings of this arm at ``budget``."""
        recent = budget - n_sink if self.method == "streaming_llm" else self.recent_tokens(budget)
        out = {
            "arm": self.name,
            "family": self.family or self.name,
            "method": self.method,
            "budget": budget,
            "n_sink": n_sink,
            "recent": recent,
            "recent_fraction": None if self.method == "streaming_llm" else str(self.recent),
        }
        if self.method == "qfilters":
            out["sign"] = self.sign
            out["filter_source"] = self.filter_source
        out.update(dict(self.extra))
        return out


def _frac_label(f: Fraction) -> str:
    return "0" if f == 0 else f"{f.numerator}/{f.denominator}"


def default_arms(recent_fractions=RECENT_FRACTIONS) -> list[Arm]:
    """The default arm list: the scorers at every recent fraction, and StreamingLLM (full cache
    excluded)."""
    families = [
        ("qfilters-keys+1", "qfilters", 1),
        ("qfilters-keys-1", "qfilters", -1),
        ("l2norm", "l2norm", 1),
        ("random", "random", 1),
    ]
    arms = [
        Arm(name=f"{fam}@r{_frac_label(f)}", method=method, sign=sign, recent=Fraction(f), family=fam)
        for fam, method, sign in families
        for f in recent_fractions
    ]
    arms.append(Arm(name="streaming_llm", method="streaming_llm", family="streaming_llm"))
    return arms


def query_arms(filters=None, recent: Fraction = Fraction(1, 2)) -> list[Arm]:
    """The query-derived arms, at one recent window (cost): the online query filter (the
    paper's estimator), the key-SVD filter with the sign chosen from queries
    (``"auto"``), and, given ``filters [n_layers, H_kv, D]`` from
    ``qfilters-mlx calibrate``, the offline calibrated filter."""
    label = _frac_label(recent)
    arms = [
        Arm(name=f"qfilters-queries@r{label}", method="qfilters", sign=1, recent=recent,
            family="qfilters-queries", filter_source="queries"),
        Arm(name=f"qfilters-keys-auto@r{label}", method="qfilters", sign="auto", recent=recent,
            family="qfilters-keys-auto"),
    ]
    if filters is not None:
        def calibrated(config, layer_idx, _f=filters, **build):
            from qfilters_mlx.cache.kv_cache import build_cache

            return build_cache(config, layer_idx=layer_idx, filters=_f[layer_idx], **build)

        arms.append(Arm(name=f"qfilters-calibrated@r{label}", method="qfilters", sign=1,
                        recent=recent, family="qfilters-calibrated", cache_factory=calibrated))
    return arms


def perhead_arm(filters, windows: dict) -> Arm:
    """The per-head arm: the offline calibrated filter with per-head recent windows
    calibrated for each budget (``windows[budget]``: ``[n_layers, H_kv]`` from
    :func:`qfilters_mlx.filters.windows.load_windows`). Budgets without windows are
    skipped (its config is refused there)."""
    def per_head(config, layer_idx, _f=filters, _w=windows, **build):
        from dataclasses import replace

        from qfilters_mlx.cache.kv_cache import build_cache

        cfg = replace(config, qfilters_recent=_w[config.qfilters_budget])
        return build_cache(cfg, layer_idx=layer_idx, filters=_f[layer_idx], **build)

    return Arm(name="qfilters-perhead", method="qfilters", sign=1, recent=Fraction(0),
               family="qfilters-perhead", cache_factory=per_head,
               extra=(("recent", "per head (calibrated)"), ("recent_fraction", None)))


def retrieval_arms(arms: list[Arm], recent: Fraction = Fraction(1, 2)) -> list[Arm]:
    """The subset used for retrieval (cost): one recent window per scored family, and StreamingLLM."""
    return [a for a in arms if a.method == "streaming_llm" or a.recent == recent]


def expand(arms: list[Arm], budgets, *, n_sink: int = 4, calib_tokens: int = 128,
           seed: int = 0) -> list[tuple[Arm, int, object]]:
    """``(arm, budget, config)`` for every valid combination (invalid ones are skipped)."""
    out = []
    for budget in budgets:
        for arm in arms:
            try:
                cfg = arm.config(budget, n_sink=n_sink, calib_tokens=calib_tokens, seed=seed)
            except ValueError:
                continue
            out.append((arm, budget, cfg))
    return out
