"""``KVCacheConfig``: what the eviction method is (validated before any cache exists)."""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass, field, fields

from qfilters_mlx.config.checks import check_choice, check_int
from qfilters_mlx.config.defaults import (DEFAULT_BUDGET, DEFAULT_CALIB_TOKENS,
                                              DEFAULT_FILTER_SOURCE, DEFAULT_METHOD,
                                              DEFAULT_N_SINK, DEFAULT_SEED, FILTER_SOURCES,
                                              default_recent, default_sign)
from qfilters_mlx.config.modes import STREAMING, CompressOnce, Streaming
from qfilters_mlx.config.recent import layer_recent, resolve_recent
from qfilters_mlx.config.removed import missing_attribute, refuse_removed
from qfilters_mlx.scorers import scorer_class


@dataclass(frozen=True)
class _Fields:
    """The stored fields of :class:`KVCacheConfig` (documented there)."""

    method: str = DEFAULT_METHOD
    head_dim: int | None = None
    qfilters_budget: int = DEFAULT_BUDGET
    qfilters_n_sink: int = DEFAULT_N_SINK
    qfilters_recent: int | str | tuple | None = None
    qfilters_calib_tokens: int = DEFAULT_CALIB_TOKENS
    qfilters_sign: int | str | None = None
    qfilters_filter_source: str = DEFAULT_FILTER_SOURCE
    qfilters_filters: object = field(default=None, compare=False, repr=False)
    qfilters_seed: int = DEFAULT_SEED
    mode: Streaming | CompressOnce = STREAMING


@dataclass(frozen=True, init=False)
class KVCacheConfig(_Fields):
    """What the eviction method is: score, budget, protected tokens, filter, mode.

    ``KVCacheConfig()`` is the best measured configuration (the calibrated query filter,
    budget 256, 4 sinks, recent window budget/2; why: docs/configuration.md and
    bench/results/eval_smollm2.md). How the caches are built (kernel backend, rewind depth,
    quantized K/V storage) is not part of it: keywords ``backend``, ``max_rewind``,
    ``kv_bits``, ``kv_group_size`` of ``KVCacheBuilder(...)``, ``KVCacheBuilder.for_model``,
    ``KVCacheBuilder.install`` and the cache constructors
    (:class:`qfilters_mlx.config.BuildOptions`).

    Attributes:
        method: ``"qfilters"`` (default), ``"l2norm"``, ``"streaming_llm"``, ``"random"``,
            ``"full"`` (:data:`METHODS`) or another registered scorer's name
            (:mod:`qfilters_mlx.scorers`).
        head_dim: key head width ``D``; ``None`` (default) takes each layer's from the model.
        qfilters_budget: tokens kept per layer, KV head and batch row after each call, sinks
            and recent window included (default 256; every method but ``full``).
        qfilters_n_sink: leading positions never evicted (default 4; ``< qfilters_budget``).
        qfilters_recent: trailing positions never evicted: an int, a per-head table
            ``[n_layers, n_kv_heads]`` or ``[n_kv_heads]`` (each in ``[0, budget - n_sink]``;
            stored as tuples), or ``"calibrated"`` (the table in the ``qfilters_filters``
            file for this budget and n_sink, read when ``KVCacheBuilder`` builds the caches:
            the constructor reads no file; :mod:`qfilters_mlx.config.recent`).
            ``None`` (default) is resolved at construction: :func:`default_recent` in the
            streaming mode, 0 in the compress-once mode; reading the field gives the
            resolved value, so ``dataclasses.replace(config, qfilters_budget=B)`` keeps the
            old window (pass ``qfilters_recent=None`` again to resolve it for ``B``). With an
            int, ``n_sink + recent < budget``. ``streaming_llm`` keeps the last
            ``budget - n_sink`` positions instead.
        qfilters_calib_tokens: keys (and queries) the online filters are estimated from,
            then frozen; nothing is evicted before (default 128; not used by the
            calibrated filter or given filters).
        qfilters_sign: ``+1`` keeps keys with large ``<k, u>``, ``-1`` small ones, ``"auto"``
            picks per KV head from the first ``calib_tokens`` queries (needs
            ``observe_queries``). ``None`` (default) is resolved at construction to
            :func:`default_sign` of the filter source (``-1`` for ``"keys"``, else ``+1``;
            ``replace`` with another source must pass ``None`` again). The query filters'
            sign is fixed by the queries: ``"calibrated"`` takes only ``+1``, ``"queries"``
            not ``-1``.
        qfilters_filter_source: ``"calibrated"`` (default: the paper's offline query filter
            of the model, found or made by ``KVCacheBuilder.for_model``; a cache built
            directly needs ``filters=``), ``"queries"`` (online, from the first
            ``calib_tokens`` post-RoPE queries; needs ``observe_queries``) or ``"keys"``
            (online key-SVD) (:data:`FILTER_SOURCES`).
        qfilters_filters: given filters ``[n_layers, n_kv_heads, head_dim]``: a path (an
            existing safetensors file from ``qfilters-mlx calibrate``) or an array; eviction
            then starts at once and ``calib_tokens`` / ``filter_source`` are not used.
            Default ``None``. Not compared by ``==``.
        qfilters_seed: seed of the ``random`` method (default 0; in ``[0, 2**63)``).
        mode: :class:`Streaming` (default: evict after every call) or
            :class:`CompressOnce` ``(ratio, growth, at)`` (compress once, then append;
            not with ``method="full"``, one int recent window).

    Raises:
        ValueError: a field out of range or not one of its choices (the message names the
            field), ``n_sink >= budget``, ``n_sink + recent >= budget``, a sign that
            contradicts the filter source, ``qfilters_filters`` neither an existing file nor
            a 3-d array, compress-once with ``method="full"`` or a per-head window.
        TypeError: a field of the wrong type (an int that is not an int, a mode that is not
            :class:`Streaming` / :class:`CompressOnce`); a spelling of 0.1 removed in 0.3.0
            (the message names its new spelling: :mod:`qfilters_mlx.config.removed`).
    """

    def __init__(self, *args, **kwargs):
        names = [f.name for f in fields(_Fields)]
        if len(args) > len(names):
            raise TypeError(f"KVCacheConfig takes at most {len(names)} positional arguments")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"KVCacheConfig got multiple values for argument {name!r}")
            kwargs[name] = value
        refuse_removed(kwargs)
        super().__init__(**_resolved(kwargs))

    def __getattr__(self, name: str):
        """Only called for an attribute the configuration lacks (a field read never gets
        here): ``AttributeError``, naming where a removed 0.1/0.2 spelling is read now."""
        raise missing_attribute(type(self).__name__, name)

    # -- derived values -------------------------------------------------------------------
    @property
    def needs_queries(self) -> bool:
        """Whether the online filter needs observed queries (query source or auto sign)."""
        return (self.scorer.uses_filter and self.qfilters_filters is None
                and (self.qfilters_filter_source == "queries" or self.qfilters_sign == "auto"))

    @property
    def scorer(self) -> type:
        """The :class:`~qfilters_mlx.scorers.Scorer` class registered as ``method``."""
        return scorer_class(self.method)

    @property
    def score_sign(self) -> int:
        """The sign applied when scoring (+1 when the filter's own orientation decides)."""
        return -1 if self.qfilters_sign == -1 else 1

    @property
    def protected_recent(self):
        """Trailing positions kept unconditionally (``budget - n_sink`` for StreamingLLM)."""
        if not self.scorer.ranks:
            return self.qfilters_budget - self.qfilters_n_sink
        return self.qfilters_recent

    @property
    def compress_once(self) -> bool:
        """Whether the mode is :class:`CompressOnce`."""
        return isinstance(self.mode, CompressOnce)

    def layer_recent(self, layer: int):
        """The recent window of layer ``layer``'s cache: :attr:`protected_recent` when it is
        one int, else that layer's ``n_kv_heads`` windows (:mod:`qfilters_mlx.config.recent`)."""
        return layer_recent(self.protected_recent, layer)

    def with_head_dim(self, head_dim: int) -> "KVCacheConfig":
        """A copy with ``head_dim`` set; ``self`` when it has that ``head_dim`` already. Only
        ``head_dim`` is checked (the rest was, at construction).

        Raises:
            TypeError, ValueError: ``head_dim`` is not an int >= 1.
        """
        if head_dim == self.head_dim and type(head_dim) is type(self.head_dim):
            return self
        check_int("head_dim", head_dim, 1)
        return self._derived(head_dim=head_dim)

    def for_layer(self, layer: int, head_dim: int) -> "KVCacheConfig":
        """The configuration of budgeted layer ``layer``'s cache: :meth:`with_head_dim`, and
        that layer's row of a ``[n_layers, n_kv_heads]`` recent table (:meth:`layer_recent`;
        each row was checked with the table).

        Raises:
            TypeError, ValueError: what :meth:`with_head_dim` raises; ``layer`` outside the
                table.
        """
        config = self.with_head_dim(head_dim)
        recent = self.qfilters_recent
        if isinstance(recent, int) or not isinstance(recent[0], tuple):
            return config
        return config._derived(qfilters_recent=layer_recent(recent, layer))

    def _derived(self, **changes) -> "KVCacheConfig":
        """A copy with ``changes`` set, not validated again (the callers check what changes)."""
        new = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        return new


_SIGNATURE = inspect.signature(_Fields)
KVCacheConfig.__signature__ = _SIGNATURE  # what help() and inspect show: the fields


def _resolved(values: dict) -> dict:
    """The fields of a :class:`KVCacheConfig` from ``values`` (field -> value as given, the
    current spellings): checked, ``None`` sign and recent resolved, tables normalised.
    Raises what :class:`KVCacheConfig` documents."""
    v = {f.name: f.default for f in fields(_Fields)}
    unknown = set(values) - set(v)
    if unknown:
        raise TypeError(f"KVCacheConfig got unexpected keyword arguments {sorted(unknown)}")
    v.update(values)
    scorer = scorer_class(v["method"])  # (ValueError naming the registered methods)
    if v["head_dim"] is not None:
        check_int("head_dim", v["head_dim"], 1)
    check_int("qfilters_budget", v["qfilters_budget"], 1)
    check_int("qfilters_n_sink", v["qfilters_n_sink"], 0)
    if not isinstance(v["mode"], (Streaming, CompressOnce)):
        raise TypeError(f"mode must be Streaming() or CompressOnce(...), got {v['mode']!r}")
    mode = v["mode"]
    once = isinstance(mode, CompressOnce)
    recent = v["qfilters_recent"]
    if recent is None:  # compress-once: no window, as kvpress (the question comes after)
        recent = 0 if once else default_recent(v["qfilters_budget"], v["qfilters_n_sink"])
    recent = v["qfilters_recent"] = resolve_recent(
        recent, v["qfilters_budget"], v["qfilters_n_sink"], scorer.ranks, v["qfilters_filters"])
    if isinstance(recent, int):
        check_int("qfilters_recent", recent, 0)
    elif once:
        raise ValueError("qfilters_recent: per-head recent windows are for the streaming mode; "
                         "mode=CompressOnce(...) takes one int window")
    if v["qfilters_sign"] is None:
        v["qfilters_sign"] = default_sign(v["qfilters_filter_source"])
    check_int("qfilters_calib_tokens", v["qfilters_calib_tokens"], 1)
    check_int("qfilters_seed", v["qfilters_seed"], 0, 2**63 - 1)
    _check_counts(v, mode, scorer)
    _check_filter(v)
    return v


def _check_counts(v: dict, mode, scorer) -> None:
    """Sinks, window and budget against each other; compress-once needs an eviction method."""
    budget, n_sink, recent = v["qfilters_budget"], v["qfilters_n_sink"], v["qfilters_recent"]
    if n_sink >= budget:
        raise ValueError(f"qfilters_n_sink ({n_sink}) must be smaller than qfilters_budget ({budget})")
    if isinstance(mode, CompressOnce) and not scorer.evicts:
        raise ValueError(f"mode=CompressOnce needs an eviction method; method={v['method']!r} "
                         "keeps every token")
    ratio = getattr(mode, "ratio", None)
    if (scorer.ranks and ratio is None and isinstance(recent, int)
            and n_sink + recent >= budget):
        raise ValueError(f"qfilters_n_sink + qfilters_recent ({n_sink} + {recent}) must be "
                         f"smaller than qfilters_budget ({budget}): no slot would be left for "
                         "scored tokens")


def _check_filter(v: dict) -> None:
    """The sign, the filter source and given filters, against each other."""
    sign, source = v["qfilters_sign"], v["qfilters_filter_source"]
    if isinstance(sign, bool) or sign not in (1, -1, "auto"):
        raise ValueError(f"qfilters_sign must be +1, -1 or 'auto', got {sign!r}")
    check_choice("qfilters_filter_source", source, FILTER_SOURCES)
    if source == "calibrated" and sign != 1:
        raise ValueError(f"qfilters_sign={sign!r} contradicts qfilters_filter_source='calibrated' "
                         "(the calibrated query filter's sign is fixed by the queries: +1); for "
                         "the key-SVD filter pass qfilters_filter_source='keys'")
    if source == "queries" and sign == -1:
        raise ValueError("qfilters_sign=-1 contradicts qfilters_filter_source='queries' (the query "
                         "filter's sign is fixed by the queries); for the key-SVD filter with sign "
                         "-1 pass qfilters_filter_source='keys'")
    f = v["qfilters_filters"]
    if f is not None and not isinstance(f, str) and getattr(f, "ndim", None) != 3:
        raise ValueError("qfilters_filters must be a path or a [n_layers, n_kv_heads, head_dim] "
                         f"array, got {type(f).__name__}")
    if isinstance(f, str) and not os.path.isfile(f):
        raise ValueError(f"qfilters_filters: no such file: {f!r} (write one with "
                         "`qfilters-mlx calibrate --out FILE`)")
