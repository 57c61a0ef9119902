"""Answers scored without the greedy loop: the teacher-forced log-likelihood of the gold answer.

A sample's gold continuation is its expected strings joined as an answer is written after the
task's answer prefix: ``" o1, o2, ..., on."`` (:func:`gold_answer`). After the question it is fed
in the same call as the question (teacher forcing); the LM head runs only on the positions that
predict a gold token (:func:`forced_scores`). Per row this gives

* ``loglik``: the sum over the gold tokens of ``log p(token | everything before it)`` (nats);
* ``tokens``: the number of gold tokens;
* ``match``: the share (0 to 1) of expected strings whose every token, space included, is the
  argmax of its position: the strings greedy decoding would write if it had started the answer
  as the gold continuation does. It plays the role of RULER's ``string_match_all`` share.

Greedy decoding (:mod:`.decode`) stays for the full cache and the validation subset; how often
``match`` and the greedy score agree is reported by :mod:`.leaderboard`.

The model's forward is split into its transformer body (hidden states) and its LM head
(:func:`split_model`), so that no LM head runs on context chunks and only the scored positions
get logits.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

__all__ = ["ForwardSplit", "forced_scores", "gold_answer", "split_model", "summarize"]


class ForwardSplit:
    """``body(tokens [B, L] int, cache) -> hidden [B, L, hidden]`` and ``head(hidden) -> logits
    [..., vocab]`` of an mlx-lm model whose ``__call__`` is ``head(body(...))``.

    Supported: models with ``model.model`` (the body) and either tied embeddings
    (``args.tie_word_embeddings``: ``model.model.embed_tokens.as_linear``) or ``model.lm_head``;
    :func:`split_model` checks the split against ``model(...)`` before it is used.
    """

    def __init__(self, body: Callable, head: Callable):
        self.body, self.head = body, head


def split_model(model, check_tokens: int = 4) -> ForwardSplit:
    """The body/head split of ``model``, checked: ``head(body(x))`` must equal ``model(x)``
    (``allclose``, rtol 1e-4, atol 1e-4 in float32) on ``check_tokens`` tokens without a cache.

    Raises:
        ValueError: the model has no ``model`` body or no LM head this function knows, or the
            split does not reproduce the model's logits (e.g. an architecture that scales or caps
            its logits after the head).
    """
    body = getattr(model, "model", None)
    args = getattr(model, "args", None)
    if body is None or not callable(body):
        raise ValueError(f"{type(model).__name__}: no transformer body at model.model; the RULER runner "
                         "needs an mlx-lm model whose logits are head(model.model(...))")
    if getattr(args, "tie_word_embeddings", False) and hasattr(getattr(body, "embed_tokens", None), "as_linear"):
        head = body.embed_tokens.as_linear
    elif callable(getattr(model, "lm_head", None)):
        head = model.lm_head
    else:
        raise ValueError(f"{type(model).__name__}: neither tied embeddings nor an lm_head")
    x = mx.arange(check_tokens)[None]
    ref, got = model(x), head(body(x))
    if ref.shape != got.shape or not mx.allclose(ref.astype(mx.float32), got.astype(mx.float32),
                                                 rtol=1e-4, atol=1e-4).item():
        raise ValueError(f"{type(model).__name__}: head(model.model(x)) differs from model(x); this "
                         "architecture transforms its logits after the head, which the runner does not know")
    return ForwardSplit(body, head)


def gold_answer(tokenizer, outputs) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``" o1, o2, ..., on."`` and each expected string's span ``[start, end)`` in them.

    Each piece (``" o_i"``, ``","``, ``"."``) is encoded on its own (``add_special_tokens=False``),
    so the spans are exact whatever the tokenizer; for a byte-level BPE that pre-splits at spaces
    and punctuation (SmolLM2's) this is also the tokenization of the joined string. A span leaves
    out a leading token that decodes to whitespace only (SmolLM2 splits the space from a number or
    a UUID), so that the match judges the string, not whether the model starts its answer with a
    space (it may write ``":\n\n- "`` first); where the space is part of the string's first token
    (``" apple"``) that token is judged.

    Raises:
        ValueError: no expected strings, or one that encodes to no tokens.
    """
    outputs = list(outputs)
    if not outputs:
        raise ValueError("a sample needs at least one expected string")
    enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    ids: list[int] = []
    spans = []
    for i, o in enumerate(outputs):
        if i:
            ids += enc(",")
        piece = enc(" " + o)
        if not piece:
            raise ValueError(f"expected string {o!r} encodes to no tokens")
        lead = int(len(piece) > 1 and not tokenizer.decode(piece[:1]).strip())
        spans.append((len(ids) + lead, len(ids) + len(piece)))
        ids += piece
    return ids + enc("."), spans


def forced_scores(head: Callable, hidden: mx.array, answer: list[int]) -> tuple[mx.array, mx.array]:
    """Gold log-probabilities and argmax hits of ``answer`` from the hidden states that predict it.

    Args:
        head: the LM head (:class:`ForwardSplit`).
        hidden: ``[R, La, hidden]``: position ``i`` is the hidden state after the token before
            ``answer[i]`` (the question's last token for ``i = 0``).
        answer: ``La`` gold token ids.

    Returns:
        ``(logp, hit)``: ``[R, La]`` float32 ``log softmax(logits)[answer[i]]`` and ``[R, La]`` bool
        ``argmax(logits) == answer[i]`` (a tie with the gold token counts as a hit only when the
        gold token is the first maximum, as ``mx.argmax`` returns).

    Raises:
        ValueError: ``hidden`` does not have ``La`` positions.
    """
    if hidden.ndim != 3 or hidden.shape[1] != len(answer):
        raise ValueError(f"hidden must be [R, {len(answer)}, hidden], got {tuple(hidden.shape)}")
    logits = head(hidden).astype(mx.float32)
    gold = mx.array(answer)[None, :, None]
    logp = mx.take_along_axis(logits, gold, axis=-1)[..., 0] - mx.logsumexp(logits, axis=-1)
    hit = mx.argmax(logits, axis=-1) == gold[..., 0]
    mx.eval(logp, hit)
    return logp, hit


def summarize(logp: mx.array, hit: mx.array, spans: list[tuple[int, int]]) -> list[dict]:
    """Per row ``{"loglik", "tokens", "match", "hits"}`` (module doc) from :func:`forced_scores`;
    ``hits`` is a string with one ``"1"`` / ``"0"`` per gold token (the argmax hit), so that a match
    over other spans can be recomputed from a record."""
    lp, h = logp.tolist(), hit.tolist()
    out = []
    for row_lp, row_h in zip(lp, h):
        found = sum(all(row_h[a:b]) for a, b in spans)
        out.append({"loglik": float(sum(row_lp)), "tokens": len(row_lp), "match": found / len(spans),
                    "hits": "".join("1" if x else "0" for x in row_h)})
    return out
