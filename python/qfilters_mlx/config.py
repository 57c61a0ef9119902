"""Validated configuration of a KV-cache eviction method.

One frozen dataclass, passed down to every cache; never global. All fields are
checked in ``__post_init__`` so that an invalid configuration fails at
construction with a ``ValueError`` (or ``TypeError`` for a wrong type) naming
the field, before any cache exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from qfilters_mlx.backends.dispatch import BACKENDS
from qfilters_mlx.config_checks import (  # noqa: F401  (constants re-exported)
    COMPRESS_AT,
    DEFAULT_KV_GROUP_SIZE,
    INT32_MAX,
    KV_BITS,
    KV_GROUP_SIZES,
    MODES,
    check_compression,
    check_int,
    check_kv_quantization,
)
from qfilters_mlx.recent_config import layer_recent, resolve_recent

METHODS = ("qfilters", "l2norm", "streaming_llm", "random", "full")
"""Eviction methods sharing one engine (see DESIGN.md, "Scorers")."""

FILTER_SOURCES = ("calibrated", "queries", "keys")
"""Where the Q-Filter comes from: ``"calibrated"`` (the paper's offline query estimator, found
or made once per model by ``KVCacheBuilder.for_model``: :mod:`qfilters_mlx.filters.default_filters`),
or estimated online inside the cache: ``"queries"`` (the paper's query-SVD of the first
``calib_tokens`` queries; needs ``observe_queries``) or ``"keys"`` (key-SVD, sign from the config)."""

# The defaults of the library and of ``qfilters-mlx generate`` (one set; measured in README,
# "Evaluation (SmolLM2-135M-Instruct)", from ``qfilters-mlx eval``: bench/results/eval_smollm2.md).
DEFAULT_METHOD = "qfilters"
DEFAULT_BUDGET = 256
"""Tokens kept per layer and KV head: the budget at which the measured online filters beat
StreamingLLM on perplexity (13.86-13.87 vs 13.91; at 512 no scored method beats it)."""
DEFAULT_N_SINK = 4
DEFAULT_CALIB_TOKENS = 128
DEFAULT_RECENT_FRACTION = 0.5
"""The recent window as a fraction of the budget (see :func:`default_recent`): with recent
budget/2 every scored method is far better in perplexity than with recent 0 (key-SVD -1 at
budget 128: 16.05 vs 188.03) and better than with budget/4 at every budget (16.05 vs 16.82)."""
DEFAULT_FILTER_SOURCE = "calibrated"
"""The paper's offline estimator (post-RoPE queries of calibration text), found or made once per
model by ``KVCacheBuilder.for_model``. The best score measured (README, "Evaluation"): Spearman
with the attention a cached token receives +0.78/+0.84/+0.75 at 256/512/1024 cached tokens
(online query filter +0.61/+0.55/+0.53, key-SVD sign -1 +0.34/+0.47/+0.47) and the best
perplexity of every scored arm at every budget (13.48 at budget 256 vs 13.87 online queries,
13.91 StreamingLLM). Generation needs keys and values only: no ``observe_queries``."""
DEFAULT_SIGN = 1
"""Sign of the query filter's score (``qfilters_sign=None`` with the query source): +1 leaves
its orientation as estimated (its sign is fixed by the queries)."""
DEFAULT_KEY_SIGN = -1
"""Sign of the key-SVD filter's score (``qfilters_sign=None`` with ``filter_source="keys"``, the
library and the command line alike): better than +1 and than ``"auto"`` on SmolLM2 (perplexity
16.05 vs 17.96 and 17.13 at budget 128; Spearman with received attention +0.47 vs -0.47)."""


def default_sign(filter_source: str) -> int:
    """The sign ``qfilters_sign=None`` resolves to: :data:`DEFAULT_KEY_SIGN` for the key-SVD
    filter, :data:`DEFAULT_SIGN` for the query filter."""
    return DEFAULT_KEY_SIGN if filter_source == "keys" else DEFAULT_SIGN


def default_recent(budget: int, n_sink: int) -> int:
    """The default recent window: ``floor(budget * DEFAULT_RECENT_FRACTION)``, capped at
    ``budget - n_sink - 1`` so that at least one slot is left for scored tokens (never < 0).

    ``KVCacheConfig(qfilters_recent=None)`` (the default) and ``qfilters-mlx generate`` without
    ``--recent`` both use it."""
    return max(0, min(int(budget * DEFAULT_RECENT_FRACTION), budget - n_sink - 1))


@dataclass(frozen=True)
class KVCacheConfig:
    """Configuration of the eviction cache.

    ``KVCacheConfig()`` is the best measured configuration (README, "Evaluation"): the
    calibrated query filter (the paper's offline estimator), budget 256, 4 sinks, a recent
    window of budget/2. It needs no model: ``qfilters_filter_source="calibrated"`` means "the
    calibrated filter of the model the caches are built for", which
    :meth:`qfilters_mlx.KVCacheBuilder.for_model` finds or makes (in this order: the file
    ``qfilters_filters`` names; a file for the model's identity in the model folder or the user
    cache ``$QFILTERS_MLX_HOME/filters``; else it calibrates once, on text that ships with
    Python, and stores the file there; :mod:`qfilters_mlx.filters.default_filters`). To bring
    your own filters pass ``qfilters_filters=`` (a file from ``qfilters-mlx calibrate`` or an
    array). Generation then needs keys and values only (``mlx_lm.generate``, ``BatchGenerator``,
    the server, draft models, ``mlx.launch`` ranks). The command line uses the same defaults
    (``tests/test_cli.py`` states them).

    Attributes:
        method: one of ``"qfilters"``, ``"l2norm"``, ``"streaming_llm"``,
            ``"random"``, ``"full"``.
        head_dim: key head dimension ``D``; ``None`` to take it from the model
            (``KVCacheBuilder.for_model`` checks it against the model either way).
        qfilters_budget: tokens kept per layer, KV head and batch row after each
            call (sinks and recent window included). Used by every method but
            ``full``.
        qfilters_n_sink: leading positions never evicted (attention sinks).
        qfilters_recent: trailing positions never evicted: one int for every layer and
            KV head, a per-head table ``[n_layers, n_kv_heads]`` (or ``[n_kv_heads]`` for
            every layer; each window in ``[0, budget - n_sink]``), or ``"calibrated"``
            (the table stored in the ``qfilters_filters`` file for this budget and n_sink,
            see :mod:`qfilters_mlx.recent_config`); ``None`` (default)
            means :func:`default_recent` of the budget and sinks (budget/2, capped to
            leave one scored slot), resolved at construction (so ``dataclasses.replace``
            with another budget must pass ``qfilters_recent=None`` again).
            ``streaming_llm`` ignores it and keeps the last ``budget - n_sink`` positions.
        qfilters_calib_tokens: number of keys (and queries) the online filters
            (``qfilters_filter_source="queries"`` or ``"keys"``) are estimated from, then
            frozen; nothing is evicted before that. The calibrated filter (the default)
            does not use it.
        qfilters_sign: ``+1`` keeps keys with large ``<k, u>``, ``-1`` keeps
            keys with small ``<k, u>``; ``None`` (default) resolves at construction
            to :func:`default_sign` of the filter source (+1 for the query filters, -1 for
            keys; ``dataclasses.replace`` with another source must pass ``None`` again).
            The calibrated filter's sign is fixed by the queries: only ``+1``. The
            key-SVD direction has no intrinsic sign (see README, "Caveats"); ``"auto"`` picks it per KV head from
            the queries of the first ``calib_tokens`` tokens (needs
            :func:`qfilters_mlx.observe.observe_queries` around generation).
        qfilters_filter_source: ``"calibrated"`` (default: the paper's offline query
            filter for the model, found or made by ``KVCacheBuilder.for_model``, see
            above; a ``QFiltersKVCache`` built directly needs ``filters=``),
            ``"queries"`` (opt-in: the paper's estimator from the first ``calib_tokens``
            post-RoPE queries, online; needs ``observe_queries``; its sign is fixed by
            the queries, so ``qfilters_sign`` must be ``+1`` or ``"auto"``) or ``"keys"``
            (key-SVD online, no queries needed; use ``qfilters_sign=-1``, see
            :data:`DEFAULT_KEY_SIGN`).
        qfilters_filters: precomputed filters ``[n_layers, n_kv_heads, head_dim]``
            (a safetensors path written by ``qfilters-mlx calibrate``, or an
            array). With filters, eviction starts at once and
            ``qfilters_calib_tokens`` and ``qfilters_filter_source`` are ignored.
            A path must name an existing file (checked here; its contents are
            checked against the model by ``KVCacheBuilder.for_model``).
        qfilters_seed: seed of the ``random`` control arm.
        qfilters_backend: kernel backend, one of ``"auto"``, ``"reference"``,
            ``"cpp"``, ``"metal"``; resolved when a cache is built.
        qfilters_max_rewind: tokens ``trim`` can rewind exactly after an eviction
            (speculative decoding's rejected drafts, prompt-cache prefixes): the
            cache keeps what its last calls overwrote or evicted (see
            ``qfilters_mlx.cache.journal``; counted in ``nbytes``). Deeper rewinds
            raise. ``0`` (default) keeps nothing: ``is_trimmable()`` is then False (mlx-lm
            refuses speculative decoding before the prompt; its server reuses stored
            prefixes without trimming) and ``trim`` after an eviction raises ``ValueError``
            naming this field. Default 0 because the journal doubles the cache's
            decode-step cost (``bench/results/rewind.md``: 1.4 -> 3.3 ms per step over
            30 layers at budget 256); set it to at least ``num_draft_tokens`` for
            speculative decoding (``qfilters-mlx generate --draft-model`` does).
        qfilters_mode: ``"streaming"`` (default: evict down to ``qfilters_budget`` after
            every call) or ``"compress_once"`` (kvpress's and the paper's protocol: keep
            every token until the cache is compressed once, then append without
            eviction; :mod:`qfilters_mlx.cache.compression`). Not with ``method="full"``.
        qfilters_compression_ratio: compress-once only: the fraction of the tokens seen
            that a compression removes (kvpress's ``compression_ratio``; in ``[0, 1)``):
            each (batch row, KV head) keeps ``max(1, int(T * (1 - ratio)))`` of its ``T``
            tokens. ``None``: keep the absolute ``qfilters_budget`` instead.
        qfilters_growth: compress-once only: tokens the cache may grow by after the
            compression before it evicts again (back to compressed size + growth, with
            the streaming rule); ``None`` (default) grows without limit.
        qfilters_compress_at: compress-once only: ``"prompt_end"`` (default: the first
            single-token call after a multi-token call, i.e. where mlx-lm's
            ``generate_step`` has prefilled the prompt but its last token) or
            ``"manual"`` (only :func:`qfilters_mlx.compress_caches`).

    In compress-once mode ``qfilters_recent=None`` resolves to 0 (kvpress has no window;
    the question comes after the compression) and ``n_sink + recent`` may exceed the
    kept count of a short context (the sinks, then the window, are cut to it).
        kv_bits: ``None`` (default: K/V stored in the model's dtype) or 2, 4, 8: the kept
            K/V are stored quantized as mlx-lm's ``QuantizedKVCache`` stores them
            (``mx.quantize`` along the head dimension; see ``qfilters_mlx.cache.quantized``);
            scores still come from the full-precision keys. Needs ``qfilters_max_rewind=0``.
        kv_group_size: quantization group size along the head dimension (32, 64 or 128;
            default 64, as mlx-lm's ``--kv-group-size``); ``head_dim`` must be a multiple.

    Raises:
        ValueError: budget < 1 or None, n_sink < 0, recent < 0, max_rewind < 0,
            ``n_sink + recent >= budget``, calib_tokens < 1, sign not +1/-1,
            unknown method or backend, head_dim < 1, a ``qfilters_filters``
            path that is not an existing file, an unknown ``qfilters_mode`` or
            ``qfilters_compress_at``, a compression ratio outside ``[0, 1)``,
            ``qfilters_growth < 0``, compress-once fields in streaming mode,
            compress-once with ``method="full"``.
        TypeError: a field that must be an int (or float ratio) is not one.
    """

    method: str = DEFAULT_METHOD
    head_dim: int | None = None
    qfilters_budget: int = DEFAULT_BUDGET
    qfilters_n_sink: int = DEFAULT_N_SINK
    qfilters_recent: int | str | tuple | None = None
    qfilters_calib_tokens: int = DEFAULT_CALIB_TOKENS
    qfilters_sign: int | str | None = None
    qfilters_seed: int = 0
    qfilters_backend: str = "auto"
    qfilters_filter_source: str = DEFAULT_FILTER_SOURCE
    qfilters_max_rewind: int = 0
    qfilters_filters: object = field(default=None, compare=False, repr=False)
    qfilters_mode: str = "streaming"
    qfilters_compression_ratio: float | None = None
    qfilters_growth: int | None = None
    qfilters_compress_at: str = "prompt_end"
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.head_dim is not None:
            check_int("head_dim", self.head_dim, 1)
        check_int("qfilters_budget", self.qfilters_budget, 1)
        check_int("qfilters_n_sink", self.qfilters_n_sink, 0)
        if self.qfilters_recent is None:  # (compress_once: none, as kvpress; the question is outside)
            object.__setattr__(self, "qfilters_recent", 0 if self.qfilters_mode == "compress_once"
                               else default_recent(self.qfilters_budget, self.qfilters_n_sink))
        object.__setattr__(self, "qfilters_recent", resolve_recent(
            self.qfilters_recent, self.qfilters_budget, self.qfilters_n_sink, self.method,
            self.qfilters_filters))
        if isinstance(self.qfilters_recent, int):
            check_int("qfilters_recent", self.qfilters_recent, 0)
        elif self.qfilters_mode == "compress_once":
            raise ValueError("qfilters_recent: per-head recent windows are for the streaming mode; "
                             "qfilters_mode='compress_once' takes one int window")
        if self.qfilters_sign is None:
            object.__setattr__(self, "qfilters_sign", default_sign(self.qfilters_filter_source))
        check_int("qfilters_calib_tokens", self.qfilters_calib_tokens, 1)
        check_int("qfilters_seed", self.qfilters_seed, 0, 2**63 - 1)
        check_int("qfilters_max_rewind", self.qfilters_max_rewind, 0)
        if self.qfilters_n_sink >= self.qfilters_budget:
            raise ValueError(
                f"qfilters_n_sink ({self.qfilters_n_sink}) must be smaller than "
                f"qfilters_budget ({self.qfilters_budget})"
            )
        check_compression(self)
        if self.method != "streaming_llm" and self.qfilters_compression_ratio is None and isinstance(
            self.qfilters_recent, int) and (
            self.qfilters_n_sink + self.qfilters_recent >= self.qfilters_budget
        ):
            raise ValueError(
                f"qfilters_n_sink + qfilters_recent ({self.qfilters_n_sink} + "
                f"{self.qfilters_recent}) must be smaller than qfilters_budget "
                f"({self.qfilters_budget}): no slot would be left for scored tokens"
            )
        if isinstance(self.qfilters_sign, bool) or self.qfilters_sign not in (1, -1, "auto"):
            raise ValueError(f"qfilters_sign must be +1, -1 or 'auto', got {self.qfilters_sign!r}")
        if self.qfilters_filter_source not in FILTER_SOURCES:
            raise ValueError(
                f"qfilters_filter_source must be one of {FILTER_SOURCES}, "
                f"got {self.qfilters_filter_source!r}"
            )
        if self.qfilters_filter_source == "calibrated" and self.qfilters_sign != 1:
            raise ValueError(f"qfilters_sign={self.qfilters_sign!r} contradicts "
                             "qfilters_filter_source='calibrated' (the calibrated query filter's sign "
                             "is fixed by the queries: +1); for the key-SVD filter pass "
                             "qfilters_filter_source='keys'")
        if self.qfilters_filter_source == "queries" and self.qfilters_sign == -1:
            raise ValueError("qfilters_sign=-1 contradicts qfilters_filter_source='queries' "
                             "(the query filter's sign is fixed by the queries); for the key-SVD "
                             "filter with sign -1 pass qfilters_filter_source='keys'")
        f = self.qfilters_filters
        if f is not None and not isinstance(f, str) and getattr(f, "ndim", None) != 3:
            raise ValueError("qfilters_filters must be a path or a [n_layers, n_kv_heads, "
                             f"head_dim] array, got {type(f).__name__}")
        if isinstance(f, str) and not os.path.isfile(f):
            raise ValueError(f"qfilters_filters: no such file: {f!r} (write one with "
                             f"`qfilters-mlx calibrate --out FILE`)")
        if self.qfilters_backend not in BACKENDS:
            raise ValueError(
                f"qfilters_backend must be one of {BACKENDS}, got {self.qfilters_backend!r}"
            )
        check_kv_quantization(self)

    @property
    def needs_queries(self) -> bool:
        """Whether the online filter needs observed queries (query source or auto sign)."""
        return (self.method == "qfilters" and self.qfilters_filters is None
                and (self.qfilters_filter_source == "queries" or self.qfilters_sign == "auto"))

    @property
    def score_sign(self) -> int:
        """The sign applied when scoring (+1 when the filter's own orientation decides)."""
        return -1 if self.qfilters_sign == -1 else 1

    @property
    def protected_recent(self) -> int:
        """Trailing positions kept unconditionally (``budget - n_sink`` for StreamingLLM)."""
        if self.method == "streaming_llm":
            return self.qfilters_budget - self.qfilters_n_sink
        return self.qfilters_recent

    @property
    def compress_once(self) -> bool:
        """Whether this is the compress-once mode (``qfilters_mode="compress_once"``)."""
        return self.qfilters_mode == "compress_once"

    def layer_recent(self, layer: int):
        """The recent window of layer ``layer``'s cache: :attr:`protected_recent` when it is
        one int, else that layer's ``n_kv_heads`` windows (see :mod:`qfilters_mlx.recent_config`)."""
        return layer_recent(self.protected_recent, layer)

    def with_head_dim(self, head_dim: int) -> "KVCacheConfig":
        """A copy with ``head_dim`` set (validated)."""
        return replace(self, head_dim=head_dim)
