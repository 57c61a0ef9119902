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

How the passes are computed (the same quantity, to float32 rounding; tested against numpy from
the queries and keys of mlx-lm's own full-cache pass): the attention of every layer is routed
through :func:`attend_rows` (matrix products in MLX, the softmax in numpy, causal blocks of
:data:`BLOCK` queries; MLX's CPU exponential is scalar, and the softmax was most of a pass);
the tokens before the first answer query run through the model's backbone only (no logits: the
output head of a large vocabulary costs as much as many layers), and a needle's first tokens
that an earlier needle of the last six shares (the instruction and the text before the needle)
reuse that pass's keys and values instead of being computed again.

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

__all__ = ["BLOCK", "CONTEXT_TOKENS", "DEPTHS", "FORMS", "SPANS", "CalibrationNeedle", "HeadRanking",
           "NeedleForm", "attend_rows", "calibration_needles", "needle_attention", "needle_pass", "rank_heads"]


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
        computed: tokens that went through the model (the prompts' other tokens reused an
            earlier needle's keys and values).
    """

    ranking: np.ndarray
    per_needle: np.ndarray
    forms: tuple
    prompts: int
    recalled: int
    seconds: float
    source: str
    computed: int


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


BLOCK = 128
"""Queries per block of the ranking pass's attention (the causal part beyond a block's last
query is never computed)."""


class _Rows:
    """Stand-in for one layer's cache in a full-cache pass: holds the layer's keys and values
    (``prefix``: those of the first tokens, from an earlier pass over the same tokens), and the
    routed attention records the weights of the query rows ``rows`` (positions in the sequence)
    on the key columns ``cols`` (per KV head: summed over them, averaged over the rows and the
    KV head's query heads)."""

    def __init__(self, layer: int, rows: list, cols: list, prefix: tuple | None = None):
        self.layer, self.rows, self.cols = layer, rows, cols
        self.keys, self.values = prefix if prefix is not None else (None, None)
        self.offset = 0 if self.keys is None else self.keys.shape[2]
        self.mass = None

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]
        return keys, values


def attend_rows(q: mx.array, k: mx.array, v: mx.array, scale: float, rows: list, cols: list,
                sinks: mx.array | None = None) -> tuple[mx.array, np.ndarray | None]:
    """Causal grouped-query attention of the last ``T`` of ``S`` positions, and the weight some
    of those queries give some keys.

    Args:
        q: ``[H_q, T, D]`` queries (after RoPE) of positions ``S - T .. S - 1``.
        k, v: ``[H, S, D]`` and ``[H, S, D_v]`` keys and values; query head ``i`` reads KV head
            ``i // (H_q // H)``.
        scale: the logits' scale.
        rows: positions of the queries whose weights are recorded: all in ``S - T .. S - 1``,
            or none (then no weights are recorded).
        cols: key positions summed over.
        sinks: ``[H_q]`` attention-sink logits (an extra key with a zero value), or ``None``.

    Returns:
        ``(out [H_q, T, D_v] float32, mass [H] float64 or None)``:
        ``out[i, t] = sum_j p[i, t, j] v[j]`` with ``p = softmax(scale * q k^T)`` over the keys
        ``j <= S - T + t`` (what ``mx.fast.scaled_dot_product_attention`` computes with
        ``mask="causal"``, to float32 rounding), and ``mass[h]`` the mean over ``rows`` and the
        query heads of KV head ``h`` of ``sum_{j in cols} p`` (``None`` when no row is queried
        here). The products run in MLX, the softmax in numpy (MLX's CPU exponential is scalar),
        in blocks of :data:`BLOCK` queries, so the causal part after a block's last query is
        never computed.

    Raises:
        ValueError: some rows queried here and some not.
    """
    H_q, T, D = q.shape
    H, S, _ = k.shape
    G, start = H_q // H, S - T
    inside = [start <= r < S for r in rows]
    if any(inside) != all(inside):
        raise ValueError(f"rows {rows} partly in the queried positions {start}..{S - 1}")
    q = (q.astype(mx.float32) * scale).reshape(H, G, T, D)
    k, v = k.astype(mx.float32), v.astype(mx.float32)
    sink = None if sinks is None else np.array(sinks.astype(mx.float32)).reshape(H, G, 1, 1)
    outs, mass = [], np.zeros(H)
    for a in range(0, T, BLOCK):
        b = min(a + BLOCK, T)
        m, n = b - a, start + b
        logits = np.array(q[:, :, a:b].reshape(H, G * m, D) @ k[:, :n].swapaxes(1, 2)).reshape(H, G, m, n)
        logits[..., start + a:][..., np.triu(np.ones((m, m), bool), 1)] = -np.inf
        top = logits.max(axis=-1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink)
        p = np.exp(logits - top)
        denom = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            denom += np.exp(sink - top)
        p /= denom
        outs.append((mx.array(p.reshape(H, G * m, n)) @ v[:, :n]).reshape(H, G, m, -1))
        for r in rows:
            if a <= r - start < b:
                mass += p[:, :, r - start - a, cols].sum(axis=(1, 2))
    return mx.concatenate(outs, axis=2).reshape(H_q, T, -1), mass / (G * len(rows)) if all(inside) else None


def _rows_sdpa(queries, keys, values, cache, scale, mask, sinks):
    refuse_own_mask(cache.layer, mask)
    out, mass = attend_rows(queries[0], keys[0], values[0], scale, cache.rows, cache.cols, sinks)
    if mass is not None:
        cache.mass = mass
    return out[None].astype(queries.dtype)


def needle_pass(model, prompt: NeedlePrompt) -> tuple[np.ndarray, bool]:
    """``(attention [n_layers, H_kv], recalled)`` of one full-cache pass over ``prompt.tokens[:-1]``
    (one sequence): :func:`needle_attention`'s weights, and whether the model ranks every key
    token of the answer first given the tokens before it.

    Raises:
        ValueError: a layer attends with its own mask (a sliding window): not measured.
        RuntimeError: some layer's attention did not go through the routed path.
    """
    mass, recalled, _ = _needle_pass(model, prompt, 0, None)
    return mass, recalled


def _needle_pass(model, prompt: NeedlePrompt, shared: int, prefix: list | None):
    """:func:`needle_pass` with the first ``shared`` tokens' keys and values of every layer
    given (``prefix``: ``(keys, values)`` per layer, ``[1, H, >= shared, D]``, from a pass over
    the same first tokens); also returns every layer's ``(keys, values)`` of the whole pass."""
    n = len(prompt.key_positions)
    rows = [p - 1 for p in prompt.key_positions]
    cols = list(range(prompt.needle_position, prompt.needle_position + n))
    caches = [_Rows(i, rows, cols, None if not shared else (k[:, :, :shared], v[:, :, :shared]))
              for i, (k, v) in enumerate(prefix or [(None, None)] * len(model.layers))]
    body = getattr(model, "model", None)  # the backbone, when it owns the layers the caches serve
    split = rows[0] if getattr(body, "layers", None) is model.layers else shared
    with route_attention(_Rows, _rows_sdpa):
        if split > shared:  # the tokens before the first row through the backbone only (no logits)
            body(mx.array(prompt.tokens[shared:split])[None], cache=caches)
        logits = model(mx.array(prompt.tokens[split:-1])[None], cache=caches)[0, mx.array(rows) - split]
        best = mx.argmax(logits, axis=-1)
        mx.eval(best)
    if any(c.mass is None for c in caches):
        raise RuntimeError("needle_attention: some layer's attention did not go through the routed path")
    recalled = best.tolist() == [prompt.tokens[p] for p in prompt.key_positions]
    return np.stack([c.mass for c in caches]), recalled, [(c.keys, c.values) for c in caches]


def _shared_tokens(a: list, b: list) -> int:
    """Length of the common start of two token lists."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


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
    runs, recalled, computed, done = [], 0, 0, []  # done: (tokens, keys and values) of the last passes
    for needle in needles:
        tokens = needle.prompt.tokens
        shared, prefix = 0, None
        for earlier, kv in done:  # the longest start shared with an earlier needle is not recomputed
            n = min(_shared_tokens(earlier, tokens), len(earlier) - 1, needle.prompt.key_positions[0] - 1)
            if n > shared:
                shared, prefix = n, kv
        mass, ok, kv = _needle_pass(model, needle.prompt, shared, prefix)
        done = [*done, (tokens, kv)][-len(FORMS) * len(DEPTHS):]
        computed += len(tokens) - 1 - shared
        runs.append(mass)
        recalled += ok
    per_needle = np.stack(runs).astype(np.float64)
    return HeadRanking(per_needle.mean(axis=0), per_needle, tuple(n.form for n in needles), len(runs), recalled,
                       time.perf_counter() - tic, source, computed)
