"""Retrieval heads: which KV heads copy a key from far back, measured on calibration needles.

The measure (:func:`needle_attention`): in a full-cache teacher-forced pass over a needle prompt
followed by its answer (:class:`~qfilters_mlx.filters.needles.NeedlePrompt`), the attention
weight that the queries predicting the answer's key tokens give the key's tokens in the prompt,
per query, averaged over those queries and the query heads of each KV head. A head that copies
the key attends there; the ranking (:func:`rank_heads`) is its mean over the calibration needles
(:func:`calibration_needles`): about :data:`CONTEXT_TOKENS` tokens of the calibration text
(:func:`qfilters_mlx.assets.prompts.calibration_text`, disjoint from the evaluation text and
prompts) in whole lines from each of :data:`SPANS` starting points, a needle in each of the
:data:`FORMS` (a 5-digit pass key, a secret word) as its own line at the line boundary nearest
each of :data:`DEPTHS`, framed by an instruction and a question (the chat template's user turn
when the tokenizer has one): 12 prompts, one forward pass each.

Every prompt counts, whether or not the full cache answers it (the count it answers is reported):
the attention of the copying queries is measured either way.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from qfilters_mlx.filters.attention_route import refuse_own_mask, route_attention
from qfilters_mlx.filters.needles import NeedlePrompt, needle_body, needle_sequence

__all__ = ["CONTEXT_TOKENS", "DEPTHS", "FORMS", "SPANS", "CalibrationNeedle", "HeadRanking",
           "NeedleForm", "calibration_needles", "needle_attention", "needle_pass", "rank_heads"]


@dataclass(frozen=True)
class NeedleForm:
    """One kind of needle: the sentence hidden in the text, the question, the answer's start."""

    name: str
    needle: str  # with ``{key}``
    question: str
    answer_prefix: str

    def key(self, seed: str) -> str:
        """The key of this form for ``seed`` (a pure function of both)."""
        rng = random.Random(f"{self.name}-{seed}")
        if self.name == "number":
            return str(rng.randint(10000, 99999))
        return rng.choice(WORDS)


WORDS = ("pelican", "lantern", "meadow", "violin", "harbor", "walnut", "glacier", "saffron",
         "compass", "orchard", "falcon", "marble")
"""Secret words (none a Python keyword or built-in name)."""

FORMS = (
    NeedleForm("number", "The secret pass key is {key}. Remember it.", "What is the secret pass key?",
               "The secret pass key is "),
    NeedleForm("word", 'The secret word is "{key}". Remember it.', "What is the secret word?",
               'The secret word is "'),
)
"""The needle forms: a 5-digit number and a word."""

INSTRUCTION = ("Below is a text. A secret is hidden somewhere in it. "
               "Read it carefully and answer the question at the end.")
CONTEXT_TOKENS = 512
"""Tokens of calibration text around each needle."""
DEPTHS = (0.1, 0.4, 0.7)
"""Relative depths of the needle in the text."""
SPANS = (0.0, 0.5)
"""Starting points in the calibration text (fractions of its length, moved to the next paragraph)."""


@dataclass(frozen=True)
class CalibrationNeedle:
    """One calibration prompt: its form, depth, key, the calibration text's lines it holds (in
    order, the needle left out) and the teacher-forced sequence."""

    form: str
    depth: float
    key: str
    lines: tuple
    prompt: NeedlePrompt


@dataclass(frozen=True)
class HeadRanking:
    """What :func:`rank_heads` measured.

    Attributes:
        ranking: ``[n_layers, n_kv_heads]`` float64, the mean needle attention (a weight in
            ``[0, 1]`` per query) of each KV head over the calibration needles.
        per_needle: ``[prompts, n_layers, n_kv_heads]`` float64, each needle's attention.
        forms: the needle form of each prompt (:attr:`NeedleForm.name`).
        prompts: number of calibration needles.
        recalled: how many of them the full cache answers (every key token ranked first).
        seconds: wall time of the measurement.
        source: the calibration text's description.
    """

    ranking: np.ndarray
    per_needle: np.ndarray
    forms: tuple
    prompts: int
    recalled: int
    seconds: float
    source: str


def _chat(tokenizer, message: str) -> str:
    if not (getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None)):
        return message + "\n\n"
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def calibration_needles(tokenizer, text: str | None = None) -> list[CalibrationNeedle]:
    """The calibration needles (module doc) on ``text`` (default: the calibration text).

    Raises:
        ValueError: the text is too short for :data:`CONTEXT_TOKENS` tokens after a starting
            point, or a key's tokens do not occur in its prompt.
    """
    if text is None:
        from qfilters_mlx.assets.prompts import calibration_text

        text = calibration_text()[0]
    out = []
    for s in SPANS:
        at = 0 if s == 0 else text.index("\n\n", int(s * len(text))) + 2
        for form in FORMS:
            for depth in DEPTHS:
                key = form.key(f"{s}-{depth}")
                needle = form.needle.format(key=key)
                lines = text[at:].replace("\n", "\n\n")  # the needle goes between lines
                body = needle_body(tokenizer, lines, CONTEXT_TOKENS, depth, needle)
                message = "\n\n".join([INSTRUCTION, "\n".join(body), f"Question: {form.question}"])
                ids = tokenizer.encode(_chat(tokenizer, message), add_special_tokens=False)
                prompt = needle_sequence(tokenizer, ids, form.answer_prefix, key)
                kept = tuple(p for p in body if p != needle)
                out.append(CalibrationNeedle(form.name, depth, key, kept, prompt))
    return out


class _Rows:
    """Stand-in for one layer's cache in a full-cache pass; the routed attention records the
    weights of the query rows ``rows`` on the key columns ``cols`` (summed, per KV head)."""

    def __init__(self, layer: int, rows: list, cols: list):
        self.layer, self.rows, self.cols = layer, rows, cols
        self.offset = 0
        self.mass = None

    def update_and_fetch(self, keys, values):
        self.offset = keys.shape[2]
        return keys, values


def _rows_sdpa(queries, keys, values, cache, scale, mask, sinks):
    refuse_own_mask(cache.layer, mask)
    _, H_q, T, _ = queries.shape
    H = keys.shape[1]
    q = queries[0].astype(mx.float32)[:, mx.array(cache.rows)]  # [H_q, R, D]
    logits = (q * scale) @ mx.repeat(keys[0].astype(mx.float32), H_q // H, axis=0).swapaxes(-1, -2)
    causal = mx.arange(T)[None, :] <= mx.array(cache.rows)[:, None]  # [R, T]
    probs = mx.softmax(mx.where(causal, logits, -mx.inf), axis=-1, precise=True)
    per_q = probs[:, :, mx.array(cache.cols)].sum(axis=(1, 2))  # [H_q]
    cache.mass = np.array(per_q.reshape(H, H_q // H).mean(axis=1)) / len(cache.rows)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal", sinks=sinks)


def needle_pass(model, prompt: NeedlePrompt) -> tuple[np.ndarray, bool]:
    """``(attention [n_layers, H_kv], recalled)`` of one full-cache pass over ``prompt.tokens[:-1]``
    (one sequence): :func:`needle_attention`'s weights, and whether the model ranks every key
    token of the answer first given the tokens before it.

    Raises:
        ValueError: a layer attends with its own mask (a sliding window): not measured.
        RuntimeError: some layer's attention did not go through the routed path.
    """
    n = len(prompt.key_positions)
    rows = [p - 1 for p in prompt.key_positions]
    cols = list(range(prompt.needle_position, prompt.needle_position + n))
    caches = [_Rows(i, rows, cols) for i in range(len(model.layers))]
    with route_attention(_Rows, _rows_sdpa):
        logits = model(mx.array(prompt.tokens[:-1])[None], cache=caches)[0, mx.array(rows)]
        best = mx.argmax(logits, axis=-1)
        mx.eval(best)
    if any(c.mass is None for c in caches):
        raise RuntimeError("needle_attention: some layer's attention did not go through the routed path")
    recalled = best.tolist() == [prompt.tokens[p] for p in prompt.key_positions]
    return np.stack([c.mass for c in caches]), recalled


def needle_attention(model, prompt: NeedlePrompt) -> np.ndarray:
    """``[n_layers, H_kv]``: the attention weight the queries predicting ``prompt``'s answer key
    tokens give the key's tokens in the prompt, per query (mean over those queries and the query
    heads of each KV head)."""
    return needle_pass(model, prompt)[0]


def rank_heads(model, tokenizer) -> HeadRanking:
    """The retrieval-head ranking of ``model`` on the calibration needles (module doc).

    Raises:
        ValueError: what :func:`calibration_needles` and :func:`needle_pass` raise.
    """
    from qfilters_mlx.assets.prompts import calibration_text

    tic = time.perf_counter()
    text, source = calibration_text()
    needles = calibration_needles(tokenizer, text)
    runs, recalled = [], 0
    for needle in needles:
        mass, ok = needle_pass(model, needle.prompt)
        runs.append(mass)
        recalled += ok
    per_needle = np.stack(runs).astype(np.float64)
    return HeadRanking(per_needle.mean(axis=0), per_needle, tuple(n.form for n in needles), len(runs), recalled,
                       time.perf_counter() - tic, source)
