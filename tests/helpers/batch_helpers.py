"""Shared helpers of the batching tests: a tiny llama and single-sequence reference runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama

from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.config import KVCacheConfig

VOCAB = 96


def tiny_llama(seed: int = 0, vocab_size: int = VOCAB, head_dim: int = 16, intermediate_size: int = 128):
    """A 2-layer float32 llama with random weights (head_dim 16 by default, 2 KV heads), scaled
    by 3 so that its greedy tokens vary (at mlx's default init they repeat one token)."""
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=intermediate_size, num_attention_heads=4,
                           num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab_size,
                           head_dim=head_dim, tie_word_embeddings=True)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 3, model.parameters()))
    mx.eval(model.parameters())
    return model


def config(**kw) -> KVCacheConfig:
    base = dict(method="qfilters", qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4,
                qfilters_calib_tokens=8, qfilters_filter_source="keys")
    base.update(kw)
    return KVCacheConfig(**base)


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    mx.random.seed(seed)
    return [mx.random.randint(0, VOCAB, (n,)).tolist() for n in lengths]


def alone(model, prompt, cfg, n_tokens, **build):
    """Greedy tokens of ``prompt`` alone (its own per-sequence caches), fed exactly like
    ``BatchGenerator`` feeds a row: ``prompt[:-1]`` in one call, then one token per step,
    and finally the last generated token (a finished row's cache has seen it); ``build``:
    build options of the caches (``KVCacheBuilder.for_model``'s keywords).

    Returns ``(tokens, caches, logprobs per step)``."""
    caches = KVCacheBuilder.for_model(model, cfg, **build) if cfg is not None else None
    if caches is None:
        from mlx_lm.models.cache import make_prompt_cache
        caches = make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array([prompt[:-1]]), cache=caches)
    y, out, lps = prompt[-1], [], []
    for _ in range(n_tokens):
        logits = model(mx.array([[y]]), cache=caches)[0, -1]
        lps.append(logits - mx.logsumexp(logits))
        y = int(mx.argmax(logits).item())
        out.append(y)
    model(mx.array([[y]]), cache=caches)
    mx.eval([c.state for c in caches])
    return out, caches, lps


def batched(model, rows, n_tokens, joins=(), **gen_kw):
    """Greedy tokens of ``rows`` through ``BatchGenerator`` (the model's ``make_cache``);
    ``joins``: ``(step, prompt)`` pairs inserted after that many ``next()`` calls.

    Returns ``({prompt index: tokens}, {prompt index: extracted caches}, {index: logprobs})``."""
    gen = BatchGenerator(model, max_tokens=n_tokens, **gen_kw)
    uids = {u: i for i, u in enumerate(gen.insert(rows))}
    toks, caches, lps = {}, {}, {}
    pending = sorted(joins, key=lambda j: j[0])
    step, k = 0, len(rows)
    while True:
        while pending and pending[0][0] <= step:
            uid = gen.insert([pending.pop(0)[1]])[0]
            uids[uid] = k
            k += 1
        responses = gen.next_generated()
        step += 1
        if not responses and not pending:
            break
        for r in responses:
            i = uids[r.uid]
            toks.setdefault(i, []).append(r.token)
            lps.setdefault(i, []).append(r.logprobs)
            if r.finish_reason is not None:
                caches[i] = r.prompt_cache
    gen.close()
    return toks, caches, lps


LOGPROB_ATOL = 1e-4
LOGPROB_RTOL = 2e-5  # logits reach ~40 (weights x3): float32 summation order
LENGTHS = [5, 12, 64, 70, 3]  # budget 16: below it, near it, 4x above it


def _same_row(test_caches, ref_caches):
    for layer, (c, r) in enumerate(zip(test_caches, ref_caches)):
        assert c.tokens_seen == r.tokens_seen, layer
        assert c.size() == r.size() and c.nbytes == r.nbytes, layer
        np.testing.assert_array_equal(np.array(c.kept_positions()), np.array(r.kept_positions()))


def _check_against_alone(model, cfg, rows, toks, caches, lps, n):
    for i, p in enumerate(rows):
        ref_toks, ref_caches, ref_lps = alone(model, p, cfg, n)
        assert toks[i] == ref_toks, i
        np.testing.assert_allclose(np.stack([np.array(x) for x in lps[i]]),
                                   np.stack([np.array(x) for x in ref_lps]), atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
        _same_row(caches[i], ref_caches)
