"""One RULER sample through every arm, and the resumable run over tasks, lengths and samples.

Compress-once: the context is prefilled once (``chunk``-token calls) into caches that keep
every token and observe the context's queries (the online filter's estimate); each
(arm, ratio) row receives those keys/values and is compressed (:func:`.arms.compress_row`);
the full cache and every row then take the question in one batched call (the rows' stored
keys/values stacked in mlx-lm's ``BatchKVCache``, :func:`stacked_cache`) and decode greedily
until every row has produced an end-of-sequence token or ``max_new_tokens``. Streaming: every
(arm, ratio) row is fed the whole prompt in ``chunk``-token calls
(:func:`~qfilters_mlx.evaluation.retrieval.batched_greedy`). No I/O: the caller loads and
saves the per-sample records (``load(key)`` / ``save(key, record)``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx

from qfilters_mlx.evaluation.ruler.arms import COMPRESS_ARMS, STREAMING_ARMS, arm_by_name, compress_row, streaming_row
from qfilters_mlx.evaluation.ruler.prompt import fit, sample_tokens
from qfilters_mlx.evaluation.ruler.scoring import sample_score
from qfilters_mlx.evaluation.ruler.tasks import TASKS, Sources

__all__ = ["RulerSettings", "answer_key", "run_ruler", "run_sample", "sample_key"]


@dataclass(frozen=True)
class RulerSettings:
    """What one RULER run covers. ``fingerprint()`` is what a resumed run must share."""

    lengths: tuple = (2048, 4096)
    ratios: tuple = (0.25, 0.5, 0.75, 0.875)
    samples: int = 10
    tasks: tuple = tuple(TASKS)
    protocols: tuple = ("compress_once",)
    compress_arms: tuple = tuple(a.name for a in COMPRESS_ARMS)
    streaming_arms: tuple = STREAMING_ARMS
    seed: int = 0
    chunk: int = 512
    calib_tokens: int = 128
    backend: str = "auto"
    extra: dict = field(default_factory=dict)

    def fingerprint(self) -> dict:
        """Settings every record of a results folder shares (the rest only selects records)."""
        d = asdict(self)
        return {k: d[k] for k in ("seed", "chunk", "calib_tokens", "extra")}


def sample_key(length: int, task: str, index: int) -> str:
    return f"{length}/{task}/{index}"


def answer_key(protocol: str, arm: str, ratio: float | None = None) -> str:
    """``"full"`` or ``"{protocol}/{arm}@{ratio}"``."""
    return "full" if arm == "full" else f"{protocol}/{arm}@{ratio:g}"


def _wanted(s: RulerSettings) -> dict[str, list[str]]:
    out = {"compress_once": ["full"], "streaming": []}
    if "compress_once" in s.protocols:
        out["compress_once"] += [answer_key("compress_once", a, r) for a in s.compress_arms for r in s.ratios]
    if "streaming" in s.protocols:
        out["streaming"] = [answer_key("streaming", a, r) for a in s.streaming_arms for r in s.ratios]
    return out


def _eos(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eid = getattr(tokenizer, "eos_token_id", None)
        ids = [] if eid is None else [eid]
    return set(ids)


def _cut(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def stacked_cache(rows: list[list], offset: int) -> list:
    """One mlx-lm ``BatchKVCache`` per layer holding every row's stored keys/values
    (left-padded to the longest row, the padding masked), with every row's RoPE position
    ``offset`` (the tokens each row has seen, stored or not).

    After a compress-once compression a row only appends (no further eviction), so this
    cache attends exactly as the row's own cache would, and one model call advances every
    row at the cost of one batch (no per-row cache work per token).

    Args:
        rows: per row, per layer ``(keys, values)`` ``[1, H_kv, S_row, D]``.
        offset: tokens fed to every row so far.
    """
    from mlx_lm.models.cache import BatchKVCache

    n_layers = len(rows[0])
    sizes = [r[0][0].shape[2] for r in rows]
    S = max(sizes)
    caches = []
    for layer in range(n_layers):
        def stack(part):
            xs = [r[layer][part] for r in rows]
            return mx.concatenate([mx.pad(x, [(0, 0), (0, 0), (S - x.shape[2], 0), (0, 0)]) for x in xs], axis=0)

        c = BatchKVCache(left_padding=[S - n for n in sizes])
        c.update_and_fetch(stack(0), stack(1))
        c.offset = mx.full((len(rows),), offset, dtype=mx.int32)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def greedy_until_eos(model, caches, tokens: list[int], rows: int, max_tokens: int, eos: set[int]) -> list[list[int]]:
    """Feed ``tokens`` to every row in one call, then up to ``max_tokens`` greedy tokens per
    row, stopping when every row has produced a token of ``eos`` (returned ids stop before it)."""
    logits = model(mx.broadcast_to(mx.array(tokens)[None], (rows, len(tokens))), cache=caches)[:, -1]
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(max_tokens):
        nxt = mx.argmax(logits, axis=-1)
        ids = nxt.tolist()
        for i, t in enumerate(ids):
            if not done[i]:
                out[i].append(t)
                done[i] = t in eos
        if all(done) or step + 1 == max_tokens:
            break
        logits = model(nxt[:, None], cache=caches)[:, -1]
    return [_cut(o, eos) for o in out]


def _prefill(model, context: list[int], chunk: int, head_dim: int, calib_tokens: int, backend: str):
    """The context's keys/values per layer and the online query filter per layer."""
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import BuildOptions, CompressOnce, KVCacheConfig
    from qfilters_mlx.filters.observe import observe_queries

    cfg = KVCacheConfig(method="qfilters", head_dim=head_dim, mode=CompressOnce(at="manual"),
                        qfilters_filter_source="queries", qfilters_calib_tokens=calib_tokens,
                        ).with_build_options(BuildOptions(backend=backend))
    caches = [QFiltersKVCache(cfg, layer_idx=i) for i in range(len(model.layers))]
    with observe_queries(model, caches):
        for i in range(0, len(context), chunk):
            model(mx.array(context[i:i + chunk])[None], cache=caches)
            mx.eval([c.keys for c in caches])
    kv = [(c.keys[:, :, :c.size()], c.values[:, :, :c.size()]) for c in caches]
    mx.eval(kv)
    return kv, [c.filter for c in caches]


def run_sample(model, tokenizer, record: dict, context: list[int], question: list[int], outputs,
               max_new_tokens: int, s: RulerSettings, calibrated=None) -> dict:
    """Fill ``record["answers"]`` / ``["scores"]`` / ``["seconds"]`` for the (protocol, arm,
    ratio) answers of ``s`` it lacks; returns ``record``."""
    from qfilters_mlx.evaluation.retrieval import batched_greedy
    from qfilters_mlx.model_info import model_head_dim

    answers, scores = record.setdefault("answers", {}), record.setdefault("scores", {})
    seconds, kept = record.setdefault("seconds", {}), record.setdefault("kept", {})
    want = _wanted(s)
    eos, hd, n_layers = _eos(tokenizer), model_head_dim(model), len(model.layers)

    def put(key, ids):
        answers[key] = tokenizer.decode(ids)
        scores[key] = sample_score(answers[key], outputs)

    todo = [k for k in want["compress_once"] if k not in answers]
    if todo:
        t0 = time.perf_counter()
        kv, online = _prefill(model, context, s.chunk, hd, s.calib_tokens, s.backend)
        seconds["prefill"] = time.perf_counter() - t0
        rows, keys = [], []
        for key in todo:
            if key == "full":
                stored = kv
            else:
                name, ratio = key.split("/")[1].split("@")
                row = compress_row(arm_by_name(name), float(ratio), kv, hd, calibrated=calibrated,
                                   online=online, seed=s.seed, backend=s.backend)
                stored = [(c.keys[:, :, :c.size()], c.values[:, :, :c.size()]) for c in row]
                kept[key] = row[0].size()
            mx.eval(stored)
            rows.append(stored)
            keys.append(key)
        caches = stacked_cache(rows, len(context))
        for key, ids in zip(keys, greedy_until_eos(model, caches, question, len(rows), max_new_tokens, eos)):
            put(key, ids)
        seconds["compress_once"] = time.perf_counter() - t0
    todo = [k for k in want["streaming"] if k not in answers]
    if todo:
        t0 = time.perf_counter()
        rows = []
        for key in todo:
            name, ratio = key.split("/")[1].split("@")
            rows.append(streaming_row(arm_by_name(name), float(ratio), len(context), hd, n_layers,
                                      calibrated=calibrated, calib_tokens=s.calib_tokens, seed=s.seed,
                                      backend=s.backend))
            kept[key] = int((1 - float(ratio)) * len(context))
        out = batched_greedy(model, context + question, rows, max_new_tokens, s.chunk)
        for key, ids in zip(todo, out):
            put(key, _cut(ids, eos))
        seconds["streaming"] = seconds.get("streaming", 0.0) + time.perf_counter() - t0
    return record


def run_ruler(model, tokenizer, sources: Sources, s: RulerSettings, *, tasks: dict | None = None,
              calibrated=None, load: Callable[[str], dict | None] = lambda k: None,
              save: Callable[[str, dict], None] = lambda k, r: None,
              progress: Callable[[str], None] = lambda d: None) -> int:
    """Run (or resume) every (length, sample index, task) of ``s``; returns the samples run.

    Samples go index-major (every task's sample 0 first), so a stopped run holds about
    as many samples of each task. A sample whose record (``load``) holds every answer ``s``
    asks for is skipped; one that lacks some answers runs only those.

    Raises:
        ValueError: a record was produced with another ``s.fingerprint()``, a task is unknown
            or a task does not fit a length.
    """
    tasks = TASKS if tasks is None else tasks
    unknown = [t for t in s.tasks if t not in tasks]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; tasks: {list(tasks)}")
    want = [k for ks in _wanted(s).values() for k in ks]
    ran = 0
    for length in s.lengths:
        for index in range(s.samples):
            for task in s.tasks:
                key = sample_key(length, task, index)
                record = load(key)
                if record is not None and record.get("settings") != s.fingerprint():
                    raise ValueError(f"{key}: stored with settings {record.get('settings')}, this run has "
                                     f"{s.fingerprint()}; use another output folder")
                if record is not None and all(k in record.get("answers", {}) for k in want):
                    progress(f"{key} (done)")
                    continue
                seed = f"{s.seed}-{task}-{length}-{index}"
                sample, n = fit(lambda m: tasks[task](sources, seed, m), tokenizer, length)
                context, question = sample_tokens(tokenizer, sample)
                if record is None:
                    record = {"settings": s.fingerprint(), "task": task, "length": length, "index": index,
                              "seed": seed, "units": n, "context_tokens": len(context),
                              "question_tokens": len(question), "max_new_tokens": sample.max_new_tokens,
                              "outputs": list(sample.outputs)}
                t0 = time.perf_counter()
                run_sample(model, tokenizer, record, context, question, sample.outputs,
                           sample.max_new_tokens, s, calibrated=calibrated)
                record["seconds"]["total"] = record["seconds"].get("total", 0.0) + time.perf_counter() - t0
                save(key, record)
                ran += 1
                progress(key)
    return ran
