"""Model-level quality measures (no I/O: callers load models and text, and print).

* **Streaming perplexity**: a prefix is prefilled in one call, then the text is
  fed one token at a time (teacher forcing) through the cache, so every scored
  token is predicted from the evicted cache exactly as in decoding
  (:func:`streaming_nll`; :func:`batched_streaming_nll` runs many arms at once).
* **Retrieval**: a pass key hidden at a depth of a long context, a question,
  a short greedy answer (:func:`retrieval_prompt`, :func:`batched_retrieval`).
* **Score quality**: Spearman rank correlation between a method's score of a
  cached token and the attention that token receives from the next queries
  (:func:`score_quality`).

Batching the arms: :class:`MultiArmCache` holds, for one layer, one cache per
arm (each with batch size 1) and serves them as the rows of one batch. Rows
may store different numbers of tokens (different budgets): the returned keys
and values are left-padded with zeros to the longest row and
:meth:`MultiArmCache.make_mask` masks the padding out, so one model call
advances every arm by the same tokens. Each arm's cache sees exactly the
keys/values of its own row, so its eviction is the one it would make alone
(checked in ``tests/test_evaluation.py``).

:func:`run_evaluation` runs the whole issue-5 protocol, resumably: it fills a
plain ``dict`` (JSON-serialisable) and skips cells already present.
"""

from __future__ import annotations

import json
import math
import random as _random
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from qfilters_mlx.evaluation.arms import Arm, default_arms, expand, retrieval_arms
from qfilters_mlx.filters.observe import observe_queries

__all__ = [
    "EvalSettings",
    "MultiArmCache",
    "batched_greedy",
    "batched_streaming_nll",
    "check_quick",
    "full_cache_nll",
    "perplexity",
    "retrieval_prompt",
    "run_evaluation",
    "score_quality",
    "spearman",
    "streaming_nll",
]


# ---------------------------------------------------------------- perplexity
def streaming_nll(model, tokens, caches, prefix: int = 16) -> list[float]:
    """Negative log-likelihoods (nats) of ``tokens[prefix:]`` under teacher forcing.

    Args:
        model: an mlx-lm model.
        tokens: 1-D sequence of token ids (list or ``mx.array``).
        caches: one cache per layer (e.g. from ``KVCacheBuilder.for_model``).
        prefix: tokens prefilled in one call before token-by-token decoding (>= 1).

    Returns:
        ``len(tokens) - prefix`` floats, the NLL of each token given all before it.

    Raises:
        ValueError: ``prefix`` outside ``[1, len(tokens) - 1]``.
    """
    return batched_streaming_nll(model, tokens, [caches], prefix)[0]


def perplexity(nll) -> float:
    """``exp(mean(nll))``."""
    nll = list(nll)
    return math.exp(sum(nll) / len(nll))


class MultiArmCache:
    """One layer's caches of several arms, served as the rows of one batch.

    Args:
        caches: one cache per arm (mlx-lm protocol, batch size 1 each), e.g.
            ``QFiltersKVCache`` objects with different configurations.

    ``update_and_fetch`` gives row ``i`` of the keys/values to ``caches[i]``
    and returns the rows left-padded with zeros to the longest one;
    ``make_mask`` (called by the model *before* ``update_and_fetch``) returns
    a boolean ``[B, 1, N, S_max + N]`` mask that hides the padding and is
    causal (bottom-right aligned) over the real keys. When all rows hold the
    same number of tokens it returns the first cache's own mask.
    """

    def __init__(self, caches):
        self.caches = list(caches)
        if not self.caches:
            raise ValueError("MultiArmCache needs at least one cache")

    def __len__(self) -> int:  # mlx-lm tests `if cache`: keep it truthy
        return len(self.caches)

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def size(self) -> int:
        return max(c.size() for c in self.caches)

    def sizes(self) -> list[int]:
        return [c.size() for c in self.caches]

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.caches):
            raise ValueError(f"batch has {keys.shape[0]} rows for {len(self.caches)} arms")
        # One evaluation of this layer's inputs: each cache then schedules
        # (``async_eval``) only its own small graph instead of walking the
        # whole unevaluated model graph once per row.
        mx.eval(keys, values)
        outs = [c.update_and_fetch(keys[i : i + 1], values[i : i + 1]) for i, c in enumerate(self.caches)]
        S = max(k.shape[2] for k, _ in outs)

        def pad(x):
            n = S - x.shape[2]
            if n == 0:
                return x
            return mx.concatenate([mx.zeros((*x.shape[:2], n, x.shape[3]), x.dtype), x], axis=2)

        if all(k.shape[2] == S for k, _ in outs):
            return (mx.concatenate([k for k, _ in outs], axis=0),
                    mx.concatenate([v for _, v in outs], axis=0))
        return (mx.concatenate([pad(k) for k, _ in outs], axis=0),
                mx.concatenate([pad(v) for _, v in outs], axis=0))

    @property
    def queries_observed(self) -> bool:
        return all(getattr(c, "queries_observed", False) for c in self.caches)

    @queries_observed.setter
    def queries_observed(self, value: bool) -> None:
        for c in self.caches:
            if hasattr(c, "observe_queries"):
                c.queries_observed = value

    def observe_queries(self, queries: mx.array) -> None:
        """Row ``i`` of this layer's queries goes to ``caches[i]`` (query-based filters)."""
        for i, c in enumerate(self.caches):
            fn = getattr(c, "observe_queries", None)
            if fn is not None:
                fn(queries[i : i + 1])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("MultiArmCache does not support sliding-window masks")
        sizes = self.sizes()
        if len(set(sizes)) == 1:
            return self.caches[0].make_mask(N, return_array=return_array)
        S = max(sizes)
        j = mx.arange(S + N)
        causal = j[None, :] <= (S + mx.arange(N))[:, None]  # [N, S + N]
        valid = j[None, :] >= (S - mx.array(sizes))[:, None]  # [B, S + N]
        return valid[:, None, None, :] & causal[None, None]


def _layer_caches(rows: list[list]) -> list[MultiArmCache]:
    n_layers = len(rows[0])
    if any(len(r) != n_layers for r in rows):
        raise ValueError("every row needs one cache per layer")
    return [MultiArmCache([r[i] for r in rows]) for i in range(n_layers)]


def batched_streaming_nll(model, tokens, rows: list[list], prefix: int = 16,
                          on_step: Callable[[int], None] | None = None) -> list[list[float]]:
    """:func:`streaming_nll` for several arms at once, one batch row per arm.

    Args:
        model: an mlx-lm model.
        tokens: 1-D token ids, the same text for every row.
        rows: per arm, one cache per layer (batch size 1 each).
        prefix: tokens prefilled in one call (>= 1).
        on_step: called with 1 after each decoded token (progress).

    Returns:
        Per row, ``len(tokens) - prefix`` NLLs (nats).

    Raises:
        ValueError: ``prefix`` outside ``[1, len(tokens) - 1]``; ragged ``rows``.
    """
    toks = mx.array(tokens)
    T = toks.shape[0]
    if not 1 <= prefix < T:
        raise ValueError(f"prefix must be in [1, {T - 1}], got {prefix}")
    B = len(rows)
    caches = rows[0] if B == 1 else _layer_caches(rows)
    batch = mx.broadcast_to(toks[None], (B, T))
    nll = []
    with observe_queries(model, caches):  # for query-based filters
        logits = model(batch[:, :prefix], cache=caches)[:, -1]
        for t in range(prefix, T):
            lp = logits.astype(mx.float32)
            nll.append(mx.logsumexp(lp, axis=-1) - lp[:, toks[t]])
            if t + 1 < T:
                logits = model(batch[:, t : t + 1], cache=caches)[:, -1]
            if len(nll) % 32 == 0:
                mx.eval(nll, logits)
            if on_step is not None:
                on_step(1)
    out = mx.stack(nll, axis=1)
    mx.eval(out)
    return out.tolist()


def full_cache_nll(model, tokens, prefix: int, chunk: int = 512) -> list[float]:
    """NLLs of ``tokens[prefix:]`` from plain mlx-lm (``KVCache``, chunked forward passes).

    Teacher forcing over a full cache: mathematically the same as
    token-by-token decoding, at a fraction of the cost.
    """
    from mlx_lm.models.cache import make_prompt_cache

    toks = mx.array(tokens)
    T = toks.shape[0]
    cache = make_prompt_cache(model)
    out = []
    for s in range(0, T - 1, chunk):
        e = min(s + chunk, T - 1)
        lp = model(toks[None, s:e], cache=cache)[0].astype(mx.float32)
        nll = mx.logsumexp(lp, axis=-1) - mx.take_along_axis(lp, toks[s + 1 : e + 1, None], axis=-1)[:, 0]
        mx.eval(nll)
        out.extend(nll.tolist())
    return out[prefix - 1 :]


# ----------------------------------------------------------------- retrieval
NEEDLE = "The secret pass key is {key}. Remember it."
QUESTION = "What is the secret pass key?"
INSTRUCTION = (
    "Below is an excerpt from the Python language reference. "
    "A secret pass key is hidden somewhere in it. "
    "Read it carefully and answer the question at the end."
)


def pass_key(seed: int, context: int, depth: float) -> str:
    """A 5-digit pass key, a pure function of ``(seed, context, depth)``."""
    return str(_random.Random(f"{seed}-{context}-{depth}").randint(10000, 99999))


def retrieval_prompt(tokenizer, text: str, context_tokens: int, depth: float, key: str) -> list[int]:
    """Chat-template tokens of: instruction, about ``context_tokens`` tokens of
    ``text`` (whole paragraphs), the needle at relative ``depth`` (a paragraph
    boundary), the question.

    Args:
        tokenizer: an mlx-lm ``TokenizerWrapper`` with a chat template.
        text: source prose, paragraphs separated by blank lines.
        context_tokens: target length of the context part in tokens.
        depth: needle position as a fraction of the context, in ``[0, 1]``.
        key: the pass key.

    Raises:
        ValueError: ``depth`` outside ``[0, 1]`` or ``text`` too short.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    picked, n = [], 0
    for p in paragraphs:
        if n >= context_tokens:
            break
        picked.append(p)
        n += len(tokenizer.encode(p, add_special_tokens=False)) + 1
    if n < context_tokens:
        raise ValueError(f"text too short for {context_tokens} context tokens")
    counts = np.cumsum([len(tokenizer.encode(p, add_special_tokens=False)) + 1 for p in picked])
    cut = int(np.searchsorted(counts, depth * n)) + (0 if depth == 0 else 1)
    cut = min(cut, len(picked))
    body = picked[:cut] + [NEEDLE.format(key=key)] + picked[cut:]
    message = "\n\n".join([INSTRUCTION, *body, f"Question: {QUESTION}"])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(chat, add_special_tokens=False)


def batched_greedy(model, prompt: list[int], rows: list[list], max_tokens: int, chunk: int,
                   on_call: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy answers of every row to the same prompt.

    The prompt is fed in calls of ``chunk`` tokens (each row's cache evicts
    after every call, as in chunked prefill), then each row decodes its own
    greedy tokens.

    Returns:
        Per row, ``max_tokens`` token ids.
    """
    B = len(rows)
    caches = rows[0] if B == 1 else _layer_caches(rows)
    toks = mx.broadcast_to(mx.array(prompt)[None], (B, len(prompt)))
    logits = None
    out = []
    with observe_queries(model, caches):  # for query-based filters
        for s in range(0, len(prompt), chunk):
            logits = model(toks[:, s : s + chunk], cache=caches)[:, -1]
            mx.eval(logits)
            if on_call is not None:
                on_call(1)
        for i in range(max_tokens):
            nxt = mx.argmax(logits, axis=-1)
            out.append(nxt)
            if i + 1 < max_tokens:
                logits = model(nxt[:, None], cache=caches)[:, -1]
                mx.eval(logits)
    return mx.stack(out, axis=1).tolist()


# ------------------------------------------------------------- score quality
def spearman(a, b) -> float:
    """Spearman rank correlation of two 1-D samples (``scipy.stats.spearmanr``);
    NaN when either is constant."""
    from scipy.stats import spearmanr

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def received_attention(queries: np.ndarray, keys: np.ndarray, cached: int, window: int) -> np.ndarray:
    """Attention that each of the first ``cached`` tokens receives from the next ``window`` queries.

    Args:
        queries: ``[Hq, T, D]`` post-RoPE queries of one layer (one sequence).
        keys: ``[Hkv, T, D]`` post-RoPE keys.
        cached: number of cached tokens (positions ``0 .. cached-1``).
        window: queries at positions ``cached .. cached+window-1``; each
            attends causally to every earlier position and itself.

    Returns:
        ``[Hkv, cached]``: softmax weight on each cached token, averaged over
        the ``window`` queries and over the query heads of each GQA group.
    """
    Hq, T, D = queries.shape
    Hkv = keys.shape[0]
    if not 0 < cached and cached + window <= T:
        raise ValueError(f"need 0 < cached and cached + window <= T, got {cached}, {window}, {T}")
    g = Hq // Hkv
    q = queries[:, cached : cached + window].astype(np.float64)  # [Hq, W, D]
    k = np.repeat(keys[:, : cached + window].astype(np.float64), g, axis=0)  # [Hq, S, D]
    logits = q @ k.transpose(0, 2, 1) / math.sqrt(D)  # [Hq, W, S]
    pos = np.arange(cached + window)
    causal = pos[None, :] <= (cached + np.arange(window))[:, None]
    logits = np.where(causal[None], logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(axis=-1, keepdims=True)
    mass = w[:, :, :cached].mean(axis=1)  # [Hq, cached]
    return mass.reshape(Hkv, g, cached).mean(axis=1)


def method_scores(keys: mx.array, layer: int, calib_tokens: int, seed: int, queries=None,
                  calibrated=None) -> dict[str, np.ndarray]:
    """Each method's score of every token, ``[Hkv, T]`` (higher = kept), from the
    same functions the cache uses; ``recency`` (the position) stands for StreamingLLM.

    With ``queries [Hq, T, D]`` the query-based filters are scored too (online
    query filter and auto-sign key filter, both from the first ``calib_tokens``
    queries); with ``calibrated [Hkv, D]`` the offline filter of this layer.
    """
    from qfilters_mlx.backends import reference
    from qfilters_mlx.cache.scorers import insertion_scores

    k = keys[None]  # [1, Hkv, T, D]
    T = k.shape[2]
    pos = mx.broadcast_to(mx.arange(T, dtype=mx.int64)[None, None], k.shape[:3])
    filt = reference.estimate_filter_from_keys(k[:, :, :calib_tokens])
    out = {
        "qfilters-keys+1": insertion_scores("qfilters", k, pos, filters=filt, sign=1),
        "qfilters-keys-1": insertion_scores("qfilters", k, pos, filters=filt, sign=-1),
        "l2norm": insertion_scores("l2norm", k, pos),
        "random": insertion_scores("random", k, pos, seed=seed, layer=layer),
        "recency (streaming_llm)": pos.astype(mx.float32),
    }
    if queries is not None:
        q = queries[None, :, :calib_tokens]
        qf = reference.estimate_filter_from_queries(q, k.shape[1])
        auto = filt * reference.query_orientation(filt, q)[:, None]
        out["qfilters-queries"] = insertion_scores("qfilters", k, pos, filters=qf, sign=1)
        out["qfilters-keys-auto"] = insertion_scores("qfilters", k, pos, filters=auto, sign=1)
    if calibrated is not None:
        out["qfilters-calibrated"] = insertion_scores("qfilters", k, pos, filters=calibrated, sign=1)
    return {name: np.array(v[0]) for name, v in out.items()}


def score_quality(queries: mx.array, keys: mx.array, layer: int, *, cached: int, window: int,
                  calib_tokens: int, n_sink: int, seed: int = 0,
                  calibrated=None) -> dict[str, list[float]]:
    """Per KV head, Spearman between each method's score of the cached tokens
    (sinks excluded) and the attention they receive from the next ``window`` queries.

    Args:
        queries: ``[1, Hq, T, D]`` post-RoPE queries of one layer; keys: ``[1, Hkv, T, D]``.
        layer: layer index (seeds the random arm as in the cache).
        cached: cached tokens; window: following queries.
        calib_tokens: keys the key-SVD filter is estimated from (the first ones).
        n_sink: leading positions excluded (every method keeps them).

    Returns:
        ``{method: [rho per KV head]}``.
    """
    target = received_attention(np.array(queries[0], np.float32), np.array(keys[0], np.float32),
                                cached, window)
    scores = method_scores(keys[0], layer, calib_tokens, seed, queries=queries[0],
                           calibrated=calibrated)
    return {
        name: [spearman(s[h, n_sink:cached], target[h, n_sink:]) for h in range(target.shape[0])]
        for name, s in scores.items()
    }


# --------------------------------------------------------------- the runner
@dataclass(frozen=True)
class EvalSettings:
    """Sizes of one evaluation run (``quick()`` for CI, ``full()`` for the issue-5 protocol)."""

    budgets: tuple = (64, 128, 256, 512)
    n_sink: int = 4
    calib_tokens: int = 128
    seed: int = 0
    backend: str = "auto"
    ppl_prefix: int = 128
    ppl_scored: int = 2048
    check_budget: int | None = None  # extra budget >= length where every arm must equal full
    retrieval_contexts: tuple = (1024, 2048, 4096)
    # Retrieval prefills every prompt in 64-token chunks through one batch row per
    # (arm, budget): the cost grows with the rows, so it runs at two budgets
    # (the smallest and largest that differ in what survives).
    retrieval_budgets: tuple = (128, 512)
    retrieval_depths: tuple = (0.1, 0.5, 0.9)
    retrieval_answer_tokens: int = 16
    retrieval_chunk: int = 64
    retrieval_text_offset: int = 200_000
    sq_tokens: int = 1088
    sq_cached: tuple = (256, 512, 1024)
    sq_window: int = 64
    quick: bool = False

    @classmethod
    def full(cls) -> "EvalSettings":
        return cls()

    @classmethod
    def quick_settings(cls) -> "EvalSettings":
        return cls(budgets=(32,), retrieval_budgets=(32,), calib_tokens=16, ppl_prefix=16,
                   ppl_scored=112, check_budget=256, retrieval_contexts=(256,), retrieval_depths=(0.5,), retrieval_answer_tokens=12,
                   retrieval_chunk=32, sq_tokens=160, sq_cached=(96,), sq_window=32, quick=True)

    def to_json(self) -> dict:
        """The settings as they read back from a JSON file (tuples become lists)."""
        return json.loads(json.dumps(asdict(self)))


@dataclass
class _Work:
    """Progress accounting (model calls)."""

    total: int = 0
    items: list = field(default_factory=list)


def _row_caches(arm: Arm, config, n_layers: int) -> list:
    return [arm.make_cache(config, i) for i in range(n_layers)]


def _head_dim(model) -> int:
    from qfilters_mlx.model_info import model_head_dim

    return model_head_dim(model)


def _ppl_cell(arm: Arm, budget: int, s: EvalSettings, nll: list[float], full_ppl: float) -> dict:
    ppl = perplexity(nll)
    return {**arm.describe(budget, s.n_sink), "ppl": ppl, "gap": ppl - full_ppl,
            "mean_nll": sum(nll) / len(nll), "n_scored": len(nll)}


def run_evaluation(model, tokenizer, text: str, settings: EvalSettings, results: dict,
                   save: Callable[[dict], None] = lambda r: None,
                   progress: Callable[[int, str], None] = lambda n, d: None,
                   set_total: Callable[[int], None] = lambda n: None,
                   arms: list[Arm] | None = None, capture=None, filters=None,
                   parts=("score_quality", "perplexity", "retrieval")) -> dict:
    """Run (or resume) the issue-5 evaluation, filling ``results`` in place.

    Args:
        model, tokenizer: an mlx-lm model and its tokenizer wrapper.
        text: the source prose (evaluation tokens are its first ones;
            retrieval contexts start at ``settings.retrieval_text_offset``).
        settings: sizes.
        results: a previous (partial) results dict, or ``{}``; finished cells are skipped.
        save: called with ``results`` after each finished unit of work.
        progress: ``(n, description)`` after ``n`` model calls.
        set_total: called once with the number of model calls still to run.
        arms: the arms (default :func:`default_arms`).
        capture: :func:`qfilters_mlx.capture.capture_attention` (or the same
            signature ``capture(model, callback, caches)``) for score quality;
            ``None`` skips it.
        filters: calibrated filters ``[n_layers, H_kv, D]`` (score quality of the
            offline filter; the perplexity/retrieval arm comes with ``arms``).
        parts: which measures to run (any of ``"score_quality"``,
            ``"perplexity"``, ``"retrieval"``); cheap ones first by default.

    Returns:
        ``results``.

    Raises:
        ValueError: ``results`` was produced with different settings.
    """
    arms = default_arms() if arms is None else arms
    s = settings
    if results.get("settings") not in (None, s.to_json()):
        raise ValueError("results were produced with different settings; use a new output file")
    results["settings"] = s.to_json()
    results.setdefault("perplexity", {})
    results.setdefault("retrieval", {})
    results.setdefault("score_quality", {})
    hd = _head_dim(model)
    n_layers = len(model.layers)
    all_tokens = tokenizer.encode(text, add_special_tokens=False)
    n_tok = s.ppl_prefix + s.ppl_scored
    tokens = all_tokens[:n_tok]
    results["text_tokens"] = {"perplexity": [0, n_tok], "score_quality": [0, s.sq_tokens]}

    budgets = list(s.budgets) + ([s.check_budget] if s.check_budget else [])
    kw = dict(n_sink=s.n_sink, calib_tokens=s.calib_tokens, seed=s.seed, backend=s.backend)
    ppl_cells = [(a, b, c) for a, b, c in expand(arms, budgets, **kw)
                 if f"{a.name}@{b}" not in results["perplexity"]] if "perplexity" in parts else []
    r_arms = retrieval_arms(arms)
    r_text = text[s.retrieval_text_offset:]
    r_jobs = []
    for ctx in s.retrieval_contexts if "retrieval" in parts else ():
        for depth in s.retrieval_depths:
            cells = [(a, b, c) for a, b, c in expand(r_arms, s.retrieval_budgets, **kw)
                     if f"{a.name}@{b}@{ctx}@{depth}" not in results["retrieval"]]
            full_done = f"full@{ctx}@{depth}" in results["retrieval"]
            if cells or not full_done:
                r_jobs.append((ctx, depth, cells, full_done))
    sq_todo = [c for c in s.sq_cached if str(c) not in results["score_quality"]] \
        if capture and "score_quality" in parts else []

    total = s.ppl_scored * len({b for _, b, _ in ppl_cells}) + len(sq_todo)
    for ctx, _, cells, full_done in r_jobs:
        calls = math.ceil((ctx + 120) / s.retrieval_chunk)
        total += calls * ((1 if cells else 0) + (0 if full_done else 1))
    set_total(total)

    # 1. Score quality (cheap: one forward pass with a full cache).
    if sq_todo:
        records = {}

        def keep(layer, queries, keys):
            records[layer] = (queries, keys)

        from mlx_lm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model)
        with capture(model, keep, caches):
            mx.eval(model(mx.array(all_tokens[: s.sq_tokens])[None], cache=caches))
        for cached in sq_todo:
            per_layer = {}
            for layer in sorted(records):
                q, k = records[layer]
                per_layer[str(layer)] = score_quality(q, k, layer, cached=cached, window=s.sq_window,
                                                      calib_tokens=s.calib_tokens, n_sink=s.n_sink,
                                                      seed=s.seed,
                                                      calibrated=None if filters is None else filters[layer])
            results["score_quality"][str(cached)] = per_layer
            progress(1, "score quality")
        save(results)

    # 2. Perplexity: full cache (plain mlx-lm), then every pending (arm, budget) in one batch.
    if "perplexity" in parts and "full" not in results["perplexity"]:
        nll = full_cache_nll(model, tokens, s.ppl_prefix)
        results["perplexity"]["full"] = {"arm": "full", "method": "full", "ppl": perplexity(nll),
                                         "gap": 0.0, "mean_nll": sum(nll) / len(nll),
                                         "n_scored": len(nll)}
        if s.quick:
            results["perplexity"]["full"]["nll"] = nll
        save(results)
    # One batch per budget: results are saved as each budget finishes.
    for budget in sorted({b for _, b, _ in ppl_cells}):
        cells = [x for x in ppl_cells if x[1] == budget]
        full_ppl = results["perplexity"]["full"]["ppl"]
        rows = [_row_caches(a, c.with_head_dim(hd), n_layers) for a, _, c in cells]
        nlls = batched_streaming_nll(model, tokens, rows, s.ppl_prefix,
                                     on_step=lambda n: progress(n, f"perplexity @{budget}"))
        for (a, b, _), nll in zip(cells, nlls):
            cell = _ppl_cell(a, b, s, nll, full_ppl)
            if s.quick:
                cell["nll"] = nll
            results["perplexity"][f"{a.name}@{b}"] = cell
        save(results)
    if s.quick and ppl_cells:
        # Seeded and reproducible, and batched == alone: the random arm again, on its own.
        a, b, c = next((a, b, c) for a, b, c in ppl_cells if a.method == "random" and b in s.budgets)
        nll = batched_streaming_nll(model, tokens, [_row_caches(a, c.with_head_dim(hd), n_layers)],
                                    s.ppl_prefix)[0]
        results["perplexity"][f"{a.name}@{b}"]["nll_rerun_alone"] = nll
        save(results)

    # 3. Retrieval: per prompt, the full cache alone, then every pending (arm, budget) in one batch.
    for ctx, depth, cells, full_done in r_jobs:
        key = pass_key(s.seed, ctx, depth)
        prompt = retrieval_prompt(tokenizer, r_text, ctx, depth, key)
        desc = f"retrieval {ctx}@{depth}"
        on_call = lambda n: progress(n, desc)  # noqa: E731
        base = {"context": ctx, "depth": depth, "key": key, "prompt_tokens": len(prompt)}

        def record(name, extra, answer_ids):
            answer = tokenizer.decode(answer_ids)
            results["retrieval"][name] = {**extra, **base, "answer": answer, "correct": key in answer}

        if not full_done:
            from mlx_lm.models.cache import make_prompt_cache

            ans = batched_greedy(model, prompt, [make_prompt_cache(model)], s.retrieval_answer_tokens,
                                 s.retrieval_chunk, on_call)[0]
            record(f"full@{ctx}@{depth}", {"arm": "full", "method": "full", "budget": None}, ans)
            save(results)
        if cells:
            rows = [_row_caches(a, c.with_head_dim(hd), n_layers) for a, _, c in cells]
            answers = batched_greedy(model, prompt, rows, s.retrieval_answer_tokens, s.retrieval_chunk,
                                     on_call)
            for (a, b, _), ans in zip(cells, answers):
                record(f"{a.name}@{b}@{ctx}@{depth}", a.describe(b, s.n_sink), ans)
            save(results)
    return results


def check_quick(results: dict, rtol: float = 1e-3) -> dict[str, bool]:
    """The ``--quick`` sanity checks on a finished quick run.

    * ``full_matches_kvcache_streaming``: filled in by the caller (the CLI
      compares plain mlx-lm token-by-token decoding with the full-cache NLLs);
    * ``budget_covers_length_equals_full``: every arm at ``check_budget`` has
      the full cache's perplexity within ``rtol``;
    * ``random_reproducible``: the random arm rerun alone gives the same NLLs (1e-4).
    """
    p = results["perplexity"]
    full = p["full"]["ppl"]
    cb = results["settings"]["check_budget"]
    cover = [c for k, c in p.items() if k.endswith(f"@{cb}")]
    out = {
        "budget_covers_length_equals_full": bool(cover) and all(
            abs(c["ppl"] - full) <= rtol * full for c in cover),
    }
    rerun = [c for c in p.values() if "nll_rerun_alone" in c]
    out["random_reproducible"] = bool(rerun) and all(
        np.max(np.abs(np.array(c["nll"]) - np.array(c["nll_rerun_alone"]))) <= 1e-4 for c in rerun)
    return out
