"""The rows of one RULER sample, built from its one shared prefill.

Compress-once (:func:`compressed_kv`): a row's kept positions are selected from the shared
prefill's keys with the library's own scores and selection (``insertion_scores`` and the
backend's ``select_compact``, exactly what ``QFiltersKVCache.compress`` runs), without a cache
object per row; rows holding as many tokens are stacked into one mlx-lm ``BatchKVCache`` per
layer (:func:`stacked_cache`).

Streaming (:func:`fork_point`, :func:`forked_row`): a streaming cache keeps every token until the
end of the first call after which it holds more than its budget, so up to that call's end (or
the context's last whole chunk, if sooner) its keys and values are the shared prefill's; the row
is given those in one call (its cache evicts them to the budget as the chunked calls would: the
kept set does not depend on chunking) and reads the rest of the prompt itself. Arms whose filter
comes from the context's queries (the online filter) cannot be given keys without queries: they
fork at 0 (read the whole prompt).
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.evaluation.ruler.arms import RulerArm, layer_filters, streaming_row

__all__ = ["compressed_kv", "fork_point", "forked_row", "stacked_cache"]


def compressed_kv(arm: RulerArm, ratio: float, kv: list, *, calibrated=None, online=None, seed: int = 0,
                  backend: str = "auto") -> list:
    """Per layer ``(keys, values)`` ``[1, H_kv, K, D]`` that a compress-once cache of ``arm`` given
    ``kv`` (per layer ``[1, H_kv, T, D]``, positions ``0 .. T-1``) keeps at ``ratio``:
    ``K = max(1, int(T * (1 - ratio)))`` (all ``T`` at ratio 0), sinks ``min(arm.n_sink, K)``,
    StreamingLLM's window ``K - sinks``, no window for scored arms; scores ``sign=+1`` of the
    arm's method (:func:`qfilters_mlx.cache.kv_cache.insertion_scores`, seeded per layer as a
    cache with ``qfilters_seed=seed`` does), selection by ``get_backend(backend).select_compact``.

    Raises:
        ValueError: the arm's filters are missing (:func:`.arms.layer_filters`), or ``ratio`` is
            outside ``[0, 1)``.
    """
    from qfilters_mlx.backends.dispatch import get_backend
    from qfilters_mlx.cache.compression import check_target, keep_count
    from qfilters_mlx.cache.kv_cache import insertion_scores

    check_target(float(ratio), None)
    filters = layer_filters(arm, calibrated, online, len(kv))
    be = get_backend(backend)
    out = []
    for layer, ((k, v), f) in enumerate(zip(kv, filters)):
        B, H, T, _ = k.shape
        K = keep_count(T, float(ratio))
        if K >= T:
            out.append((k, v))
            continue
        sinks = min(arm.n_sink, K)
        recent = K - sinks if arm.method == "streaming_llm" else 0
        pos = mx.broadcast_to(mx.arange(T, dtype=mx.int32), (B, H, T))
        scores = insertion_scores(arm.method, k, pos, filters=f, sign=1, seed=seed, layer=layer, backend=be)
        _, kk, vv = be.select_compact(scores, k, v, K, sinks, recent)
        out.append((kk, vv))
    mx.eval(out)
    return out


def stacked_cache(rows: list[list], offset: int) -> list:
    """One mlx-lm ``BatchKVCache`` per layer holding every row's stored keys/values
    (left-padded to the longest row, the padding masked), with every row's RoPE position
    ``offset`` (the tokens each row has seen, stored or not).

    After a compress-once compression a row only appends (no further eviction), so this
    cache attends exactly as the row's own cache would, and one model call advances every
    row at the cost of one batch.

    Args:
        rows: per row, per layer ``(keys, values)`` ``[1, H_kv, S_row, D]``.
        offset: tokens fed to every row so far.
    """
    from mlx_lm.models.cache import BatchKVCache

    sizes = [r[0][0].shape[2] for r in rows]
    S = max(sizes)
    caches = []
    for layer in range(len(rows[0])):
        def stack(part):
            xs = [r[layer][part] for r in rows]
            return mx.concatenate([mx.pad(x, [(0, 0), (0, 0), (S - x.shape[2], 0), (0, 0)]) for x in xs], axis=0)

        c = BatchKVCache(left_padding=[S - n for n in sizes])
        c.update_and_fetch(stack(0), stack(1))
        c.offset = mx.full((len(rows),), offset, dtype=mx.int32)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def fork_point(budget: int, context_tokens: int, chunk: int, needs_queries: bool = False) -> int:
    """Tokens a streaming row at ``budget`` takes from a prefill of ``context_tokens`` fed in calls
    of ``chunk`` tokens: the end of the first call after which it holds more than ``budget``
    tokens, at most the context's last whole chunk (``chunk * (context_tokens // chunk)``);
    0 when ``needs_queries``. A multiple of ``chunk``, so the row's next calls are the ones a
    row fed from the start would make."""
    if needs_queries:
        return 0
    first = chunk * (budget // chunk + 1)  # end of the first call that leaves more than budget
    return min(first, chunk * (context_tokens // chunk))


def forked_row(arm: RulerArm, ratio: float, kv: list, context_tokens: int, chunk: int, head_dim: int, *,
               calibrated=None, calib_tokens: int = 128, seed: int = 0, backend: str = "auto") -> tuple[list, int]:
    """``(caches, fork)``: the arm's streaming caches at ``budget = int((1 - ratio) *
    context_tokens)`` (:func:`.arms.streaming_row`) after taking the shared prefill's first
    ``fork`` tokens (:func:`fork_point`) in one call; the row reads ``fork ..`` itself.

    Args:
        kv: the shared prefill, per layer ``(keys, values)`` ``[1, H_kv, T, D]``, ``T >= fork``.

    Raises:
        ValueError: as :func:`.arms.streaming_row`.
    """
    n_layers = len(kv)
    row = streaming_row(arm, ratio, context_tokens, head_dim, n_layers, calibrated=calibrated,
                        calib_tokens=calib_tokens, seed=seed, backend=backend)
    budget = int((1 - ratio) * context_tokens)
    fork = fork_point(budget, context_tokens, chunk, needs_queries=arm.filters == "online")
    if fork:
        for c, (k, v) in zip(row, kv):
            c.update_and_fetch(k[:, :, :fork], v[:, :, :fork])
        mx.eval([c.keys for c in row])
    return row, fork
