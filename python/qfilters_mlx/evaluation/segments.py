"""Streaming perplexity on two held-out segments, every (arm, budget) in one batch.

Two segments so that no conclusion rests on one span. Segment ``"A"`` is the perplexity text of
:mod:`.run` (the first tokens of the documentation text); segment ``"B"`` starts at the
first paragraph after character :data:`SEGMENT_B_OFFSET`, disjoint from segment A
(its first ~9k characters), the retrieval contexts (from character 200,000), the shipped
prompt and the calibration text (from character 300,000; see
:mod:`qfilters_mlx.assets.prompts`). Each cell keeps its per-token NLLs (nats, rounded to
1e-5) so that :mod:`.bootstrap` can put a confidence interval on gap ratios. All arms and
budgets of a segment are rows of one batch (:class:`.multi_arm.MultiArmCache` pads rows
of different budgets), so a segment costs one token-by-token pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from qfilters_mlx.evaluation.arms import Arm, expand
from qfilters_mlx.evaluation.perplexity import PerplexitySizes, batched_streaming_nll, full_cache_nll, perplexity

__all__ = ["SEGMENT_B_OFFSET", "SegmentSettings", "run_segments", "segment_tokens"]

SEGMENT_B_OFFSET = 100_000
"""Character offset of segment B (after segment A, before retrieval and calibration text)."""
SEGMENT_B_CHARS = 40_000
"""Characters of segment B tokenized (more than ``prefix + scored`` tokens need)."""


@dataclass(frozen=True)
class SegmentSettings(PerplexitySizes):
    """Sizes of the two-segment perplexity run: the shared sizes and the segments run."""

    segments: tuple = ("A", "B")


def segment_tokens(tokenizer, text: str, segment: str, n: int) -> tuple[list[int], list[int]]:
    """The first ``n`` token ids of ``segment`` and its character span ``[start, end)``.

    Raises:
        ValueError: unknown segment, or the text is too short for ``n`` tokens.
    """
    if segment == "A":
        start, chunk = 0, text
    elif segment == "B":
        cut = text.find("\n\n", SEGMENT_B_OFFSET)
        if cut < 0:
            raise ValueError(f"the text has no paragraph after character {SEGMENT_B_OFFSET}")
        start = cut + 2
        chunk = text[start:start + SEGMENT_B_CHARS]
    else:
        raise ValueError(f"segment must be 'A' or 'B', got {segment!r}")
    ids = tokenizer.encode(chunk if segment == "B" else text[:SEGMENT_B_OFFSET], add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"segment {segment} has {len(ids)} tokens, {n} needed")
    ids = ids[:n]
    end = start + len(tokenizer.decode(ids))
    return ids, [start, end]


def _round(nll) -> list[float]:
    return [round(float(x), 5) for x in nll]


def run_segments(model, tokenizer, text: str, settings: SegmentSettings, arms: list[Arm], results: dict,
                 save=lambda r: None, progress=lambda n, d: None) -> dict:
    """Fill ``results["segments"][seg]`` with the full cache and every (arm, budget) cell:
    ``{"ppl", "gap", "mean_nll", "n_scored", "nll", ...arm.describe()}``; resumable (cells
    present are skipped; a segment's pending cells run as one batch).

    Raises:
        ValueError: ``results`` holds segments of other settings.
    """
    from qfilters_mlx.model_info import model_head_dim  # here: importing it first loads mlx-lm's hook

    s = settings
    if results.get("segments_settings") not in (None, s.to_json()):
        raise ValueError("segment results were produced with different settings; use a new output file")
    results["segments_settings"] = s.to_json()
    out = results.setdefault("segments", {})
    hd = model_head_dim(model)
    n_layers = len(model.layers)
    n = s.ppl_prefix + s.ppl_scored
    kw = dict(n_sink=s.n_sink, calib_tokens=s.calib_tokens, seed=s.seed)
    for seg in s.segments:
        cells = out.setdefault(seg, {})
        tokens, span = segment_tokens(tokenizer, text, seg, n)
        results.setdefault("segment_spans", {})[seg] = span
        if "full" not in cells:
            nll = full_cache_nll(model, tokens, s.ppl_prefix)
            cells["full"] = {"arm": "full", "ppl": perplexity(nll), "gap": 0.0, "n_scored": len(nll),
                             "nll": _round(nll)}
            save(results)
        todo = [(a, b, c) for a, b, c in expand(arms, list(s.budgets), **kw) if f"{a.name}@{b}" not in cells]
        if not todo:
            continue
        rows = [[a.make_cache(c.with_head_dim(hd), i, backend=s.backend) for i in range(n_layers)]
                for a, _, c in todo]
        nlls = batched_streaming_nll(model, tokens, rows, s.ppl_prefix,
                                     on_step=lambda k, seg=seg: progress(k, f"segment {seg}"))
        full = cells["full"]["ppl"]
        for (a, b, _), nll in zip(todo, nlls):
            ppl = perplexity(nll)
            cells[f"{a.name}@{b}"] = {**a.describe(b, s.n_sink), "ppl": ppl, "gap": ppl - full,
                                      "n_scored": len(nll), "nll": _round(nll)}
        save(results)
    return results
