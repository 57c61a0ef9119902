"""The model-level evaluation protocol (docs/evaluation.md), resumable: settings, orchestration, quick checks.

:func:`run_evaluation` runs score quality (:mod:`.score_quality`), streaming
perplexity (:mod:`.perplexity`) and pass-key retrieval (:mod:`.retrieval`) over
the arms (:mod:`.arms`), each budget's arms batched in one model call
(:mod:`.multi_arm`). It fills a plain ``dict`` (JSON-serialisable) and skips
cells already present, so an interrupted run resumes. No I/O: callers load the
model and text, save and print (``qfilters_mlx.commands.eval``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from qfilters_mlx.evaluation.arms import Arm, default_arms, expand, retrieval_arms
from qfilters_mlx.evaluation.perplexity import PerplexitySizes, batched_streaming_nll, full_cache_nll, perplexity
from qfilters_mlx.evaluation.retrieval import batched_greedy, pass_key, retrieval_prompt
from qfilters_mlx.evaluation.score_quality import score_quality
from qfilters_mlx.model_info import model_head_dim

__all__ = ["EvalSettings", "check_quick", "run_evaluation"]


@dataclass(frozen=True)
class EvalSettings(PerplexitySizes):
    """Sizes of one evaluation run (``quick()`` for CI, ``full()`` for the full protocol)."""

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


def _row_caches(arm: Arm, config, n_layers: int, backend: str) -> list:
    return [arm.make_cache(config, i, backend=backend) for i in range(n_layers)]


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
    """Run (or resume) the evaluation, filling ``results`` in place.

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
        capture: :func:`qfilters_mlx.filters.capture.capture_attention` (or the same
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
    hd = model_head_dim(model)
    n_layers = len(model.layers)
    all_tokens = tokenizer.encode(text, add_special_tokens=False)
    n_tok = s.ppl_prefix + s.ppl_scored
    tokens = all_tokens[:n_tok]
    results["text_tokens"] = {"perplexity": [0, n_tok], "score_quality": [0, s.sq_tokens]}

    budgets = list(s.budgets) + ([s.check_budget] if s.check_budget else [])
    kw = dict(n_sink=s.n_sink, calib_tokens=s.calib_tokens, seed=s.seed)
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
        rows = [_row_caches(a, c.with_head_dim(hd), n_layers, s.backend) for a, _, c in cells]
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
        nll = batched_streaming_nll(model, tokens, [_row_caches(a, c.with_head_dim(hd), n_layers, s.backend)],
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
            rows = [_row_caches(a, c.with_head_dim(hd), n_layers, s.backend) for a, _, c in cells]
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
