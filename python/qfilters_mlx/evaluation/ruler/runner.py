"""One RULER sample through every arm, and the resumable run over tasks, lengths and samples.

One shared prefill per sample: the context is fed once, in ``chunk``-token calls of the model's
body (no LM head on context chunks; the online filter's queries observed only when that arm
runs). Compress-once rows select their kept positions from it (:func:`.rows.compressed_kv`);
streaming rows take it up to their first eviction and read the rest of the prompt themselves
(:func:`.rows.forked_row`).

Every row is scored by teacher forcing (:mod:`.forced`): the question and the gold answer in one
call, the LM head on the answer's positions only (compress-once rows holding as many tokens
share one batch). Greedy decoding with RULER's ``string_match_all`` runs for the full cache on
every sample (so every record says whether the full cache answers correctly) and for every row
on the validation subset (sample indices below ``validation_samples``). Streaming rows run on the
samples the full cache answers correctly (``streaming_samples="full_correct"``) or on all.

Teacher forcing in the streaming protocol feeds the answer in one call after the prompt's last
chunk, so the cache does not evict between answer tokens as it does between decoded tokens:
a difference of at most ``len(answer) - 1`` kept tokens, measured by the validation subset.

Every attention call of a sample runs with the softmax in C (:mod:`.attention`: MLX's bits,
several times faster on a CPU), where a C compiler is found.

No I/O: the caller loads and saves the per-sample records (``load(key)`` / ``save(key, record)``).
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx

from qfilters_mlx.evaluation.ruler.arms import DEFAULT_COMPRESS_ARMS, STREAMING_ARMS, arm_by_name
from qfilters_mlx.evaluation.ruler.attention import fast_attention
from qfilters_mlx.evaluation.ruler.decode import greedy, greedy_from
from qfilters_mlx.evaluation.ruler.forced import forced_scores, gold_answer, split_model, summarize
from qfilters_mlx.evaluation.ruler.prompt import DoesNotFit, fit, sample_tokens
from qfilters_mlx.evaluation.ruler.rows import compressed_kv, forked_row, stacked_cache
from qfilters_mlx.evaluation.ruler.scoring import sample_score
from qfilters_mlx.evaluation.ruler.tasks import TASKS, Sources

__all__ = ["SCORING", "RulerSettings", "answer_key", "run_ruler", "run_sample", "sample_key"]

SCORING = "forced+greedy-2"
"""The records' scoring (in the fingerprint: records of the greedy-only runner are refused)."""


@dataclass(frozen=True)
class RulerSettings:
    """What one RULER run covers. ``fingerprint()`` is what a resumed run must share.

    ``validation_samples``: samples with an index below it are decoded greedily in every row
    (the others in the full-cache row only). ``streaming_samples``: ``"full_correct"`` (streaming
    rows only where the full cache's greedy answer scores 1) or ``"all"``. ``streaming_ratios``:
    the streaming protocol's ratios (``None``: ``ratios``).
    """

    lengths: tuple = (2048, 4096)
    ratios: tuple = (0.25, 0.5, 0.75, 0.875)
    samples: int = 10
    tasks: tuple = tuple(TASKS)
    protocols: tuple = ("compress_once",)
    compress_arms: tuple = DEFAULT_COMPRESS_ARMS
    streaming_arms: tuple = STREAMING_ARMS
    seed: int = 0
    chunk: int = 512
    calib_tokens: int = 128
    backend: str = "auto"
    validation_samples: int = 1
    streaming_samples: str = "full_correct"
    streaming_ratios: tuple | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.streaming_samples not in ("full_correct", "all"):
            raise ValueError(f"streaming_samples must be 'full_correct' or 'all', got {self.streaming_samples!r}")
        if self.validation_samples < 0:
            raise ValueError(f"validation_samples must be >= 0, got {self.validation_samples}")

    def fingerprint(self) -> dict:
        """Settings every record of a results folder shares (the rest only selects records)."""
        d = asdict(self)
        return {"scoring": SCORING, **{k: d[k] for k in ("seed", "chunk", "calib_tokens", "validation_samples",
                                                         "extra")}}


def sample_key(length: int, task: str, index: int) -> str:
    return f"{length}/{task}/{index}"


def answer_key(protocol: str, arm: str, ratio: float | None = None) -> str:
    """``"full"`` or ``"{protocol}/{arm}@{ratio}"``."""
    return "full" if arm == "full" else f"{protocol}/{arm}@{ratio:g}"


def _split_key(key: str) -> tuple[str, float]:
    name, ratio = key.split("/")[1].split("@")
    return name, float(ratio)


def _todo(record: dict, s: RulerSettings) -> dict[str, list[str]]:
    """The answer keys ``record`` lacks: ``forced`` / ``greedy`` (compress-once and the full
    cache), ``streaming`` (teacher-forced, and greedy on validation samples); streaming only once
    the full cache's greedy answer is known and, with ``"full_correct"``, scores 1."""
    forced, answers = record.get("forced", {}), record.get("answers", {})
    validation = record.get("index", 0) < s.validation_samples
    co = ["full"]
    if "compress_once" in s.protocols:
        co += [answer_key("compress_once", a, r) for a in s.compress_arms for r in s.ratios]
    out = {"forced": [k for k in co if k not in forced],
           "greedy": [k for k in (co if validation else ["full"]) if k not in answers], "streaming": []}
    if "streaming" in s.protocols:
        full = record.get("scores", {}).get("full")
        if full is None or s.streaming_samples == "all" or full == 1.0:
            ratios = s.ratios if s.streaming_ratios is None else s.streaming_ratios
            st = [answer_key("streaming", a, r) for a in s.streaming_arms for r in ratios]
            out["streaming"] = [k for k in st if k not in forced or (validation and k not in answers)]
    return out


def _eos(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eid = getattr(tokenizer, "eos_token_id", None)
        ids = [] if eid is None else [eid]
    return set(ids)


def _prefill(split, model, context: list[int], chunk: int, head_dim: int, calib_tokens: int, backend: str,
             online: bool):
    """The context's keys/values per layer (``[1, H_kv, T, D]``) and, with ``online``, the online
    query filter per layer (else ``None``), from ``chunk``-token calls of the model's body (only
    the caches are evaluated: no LM head, no final norm, no last-layer MLP)."""
    from mlx_lm.models.cache import KVCache

    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import CompressOnce, KVCacheConfig
    from qfilters_mlx.filters.observe import observe_queries

    n_layers = len(model.layers)
    if online:
        cfg = KVCacheConfig(method="qfilters", head_dim=head_dim, mode=CompressOnce(at="manual"),
                            qfilters_filter_source="queries", qfilters_calib_tokens=calib_tokens)
        caches = [QFiltersKVCache(cfg, layer_idx=i, backend=backend) for i in range(n_layers)]
        with observe_queries(model, caches):
            for i in range(0, len(context), chunk):
                split.body(mx.array(context[i:i + chunk])[None], cache=caches)
                mx.eval([c.keys for c in caches])
        kv = [(c.keys[:, :, :c.size()], c.values[:, :, :c.size()]) for c in caches]
        filters = [c.filter for c in caches]
    else:
        caches = [KVCache() for _ in range(n_layers)]
        for i in range(0, len(context), chunk):
            split.body(mx.array(context[i:i + chunk])[None], cache=caches)
            mx.eval([(c.keys, c.values) for c in caches])  # the caches only: no head, no last MLP
        kv = [(c.keys[:, :, :c.offset], c.values[:, :, :c.offset]) for c in caches]
        filters = None
    mx.eval(kv)
    return kv, filters


def _rows(x: list[int], n: int) -> mx.array:
    return mx.broadcast_to(mx.array(x)[None], (n, len(x)))


@fast_attention()
def run_sample(model, tokenizer, record: dict, context: list[int], question: list[int], outputs,
               max_new_tokens: int, s: RulerSettings, calibrated=None, split=None) -> dict:
    """Fill ``record`` with the answers of ``s`` it lacks (:func:`_todo`); returns ``record``.

    ``record["forced"][key]``: ``{"loglik", "tokens", "match", "hits"}`` (:mod:`.forced`);
    ``record["gold"]``: the gold answer's token ids and the expected strings' spans in them;
    ``record["answers"]`` / ``["scores"]``: greedy answers and their ``string_match_all`` share
    (decoding of a row stops at end-of-sequence, ``max_new_tokens`` or once every expected string
    is in its answer);
    ``record["full_correct"]``: the full cache's greedy share is 1; ``record["kept"]``: tokens a
    row holds after compression (streaming: its budget); ``record["seconds"]``: per stage
    (``prefill``, ``select`` (the compress-once rows' kept keys/values), ``forced``, ``greedy``,
    ``streaming``), wall clock, summed over resumes.

    Args:
        record: needs ``"index"`` (the sample index: below ``s.validation_samples`` every row is
            decoded greedily too).
        split: the model's body/head split (:func:`.forced.split_model`; made if ``None``).
    """
    from qfilters_mlx.evaluation.multi_arm import batch_caches
    from qfilters_mlx.filters.observe import observe_queries
    from qfilters_mlx.model_info import model_head_dim

    split = split_model(model) if split is None else split
    answers, scores = record.setdefault("answers", {}), record.setdefault("scores", {})
    forced, kept = record.setdefault("forced", {}), record.setdefault("kept", {})
    seconds = record.setdefault("seconds", {})
    add = lambda k, t0: seconds.__setitem__(k, seconds.get(k, 0.0) + time.perf_counter() - t0)  # noqa: E731
    validation = record.get("index", 0) < s.validation_samples
    record["validation"] = validation
    eos, hd = _eos(tokenizer), model_head_dim(model)
    answer, spans = gold_answer(tokenizer, outputs)
    record["gold"] = {"ids": answer, "spans": [list(x) for x in spans]}
    T = len(context)

    def put(key, ids):
        answers[key] = tokenizer.decode(ids)
        scores[key] = sample_score(answers[key], outputs)

    def found_all(ids):  # the score cannot change once every expected string is written
        return sample_score(tokenizer.decode(ids), outputs) == 1.0

    todo = _todo(record, s)
    if not any(todo.values()):
        return record
    t0 = time.perf_counter()
    online = any(arm_by_name(_split_key(k)[0]).filters == "online" for k in todo["forced"] + todo["greedy"]
                 if k != "full")
    kv, online_filters = _prefill(split, model, context, s.chunk, hd, s.calib_tokens, s.backend, online)
    add("prefill", t0)

    t0 = time.perf_counter()
    stored = {}
    for key in dict.fromkeys(todo["forced"] + todo["greedy"]):
        if key == "full":
            stored[key] = kv
        else:
            name, ratio = _split_key(key)
            stored[key] = compressed_kv(arm_by_name(name), ratio, kv, calibrated=calibrated, online=online_filters,
                                        seed=s.seed, backend=s.backend)
        kept[key] = stored[key][0][0].shape[2]
    add("select", t0)
    if todo["forced"]:
        t0 = time.perf_counter()
        groups = defaultdict(list)  # rows holding as many tokens share a batch (no padding)
        for key in todo["forced"]:
            groups[kept[key]].append(key)
        for keys in groups.values():
            caches = stacked_cache([stored[k] for k in keys], T)
            hidden = split.body(_rows(question + answer[:-1], len(keys)), cache=caches)[:, len(question) - 1:]
            for key, r in zip(keys, summarize(*forced_scores(split.head, hidden, answer), spans)):
                forced[key] = r
        add("forced", t0)
    if todo["greedy"]:
        t0 = time.perf_counter()
        keys = todo["greedy"]
        caches = stacked_cache([stored[k] for k in keys], T)
        for key, ids in zip(keys, greedy(split, caches, question, len(keys), max_new_tokens, eos, found_all)):
            put(key, ids)
        add("greedy", t0)
    del stored
    record["full_correct"] = scores["full"] == 1.0

    todo = _todo(record, s)
    if todo["streaming"]:
        t0 = time.perf_counter()
        prompt = context + question
        groups = defaultdict(list)
        for key in todo["streaming"]:
            name, ratio = _split_key(key)
            row, fork = forked_row(arm_by_name(name), ratio, kv, T, s.chunk, hd, calibrated=calibrated,
                                   calib_tokens=s.calib_tokens, seed=s.seed, backend=s.backend)
            kept[key] = int((1 - ratio) * T)
            groups[fork].append((key, row))
        for fork, items in sorted(groups.items()):
            keys, rows = [k for k, _ in items], [r for _, r in items]
            caches = batch_caches(rows)
            with observe_queries(model, caches):
                for i in range(fork, len(prompt), s.chunk):
                    last = split.body(_rows(prompt[i:i + s.chunk], len(rows)), cache=caches)[:, -1:]
                    mx.eval(last)
                saved = copy.deepcopy(rows) if validation else None
                hidden = last
                if len(answer) > 1:
                    hidden = mx.concatenate([last, split.body(_rows(answer[:-1], len(rows)), cache=caches)], axis=1)
                for key, r in zip(keys, summarize(*forced_scores(split.head, hidden, answer), spans)):
                    forced[key] = r
                if saved is not None:
                    ids = greedy_from(split, batch_caches(saved), split.head(last)[:, -1], max_new_tokens, eos,
                                      found_all)
                    for key, a in zip(keys, ids):
                        put(key, a)
        add("streaming", t0)
    return record


def run_ruler(model, tokenizer, sources: Sources, s: RulerSettings, *, tasks: dict | None = None,
              calibrated=None, load: Callable[[str], dict | None] = lambda k: None,
              save: Callable[[str, dict], None] = lambda k, r: None,
              progress: Callable[[str], None] = lambda d: None) -> int:
    """Run (or resume) every (length, sample index, task) of ``s``; returns the samples run.

    Samples go index-major (every task's sample 0 first), so a stopped run holds about
    as many samples of each task. A sample whose record (``load``) holds every answer ``s``
    asks for is skipped; one that lacks some answers runs only those. A sample whose smallest
    haystack does not fit its length (:class:`.prompt.DoesNotFit`) is saved as a record with
    ``"does_not_fit"`` (the reason) and no answers, and the run goes on.

    Raises:
        ValueError: a record was produced with another ``s.fingerprint()``, or a task is unknown.
    """
    tasks = TASKS if tasks is None else tasks
    unknown = [t for t in s.tasks if t not in tasks]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; tasks: {list(tasks)}")
    split = split_model(model)
    ran = 0
    for length in s.lengths:
        for index in range(s.samples):
            for task in s.tasks:
                key = sample_key(length, task, index)
                record = load(key)
                if record is not None and record.get("settings") != s.fingerprint():
                    raise ValueError(f"{key}: stored with settings {record.get('settings')}, this run has "
                                     f"{s.fingerprint()}; use another output folder")
                if record is not None and "does_not_fit" in record:
                    progress(f"{key} (does not fit)")
                    continue
                if record is not None and not any(_todo(record, s).values()):
                    progress(f"{key} (done)")
                    continue
                seed = f"{s.seed}-{task}-{length}-{index}"
                try:
                    sample, n = fit(lambda m: tasks[task](sources, seed, m), tokenizer, length)
                except DoesNotFit as err:  # recorded and reported; the run goes on
                    save(key, {"settings": s.fingerprint(), "task": task, "length": length, "index": index,
                               "seed": seed, "does_not_fit": str(err)})
                    progress(f"{key} (does not fit)")
                    continue
                context, question = sample_tokens(tokenizer, sample)
                if record is None:
                    record = {"settings": s.fingerprint(), "task": task, "length": length, "index": index,
                              "seed": seed, "units": n, "context_tokens": len(context),
                              "question_tokens": len(question), "max_new_tokens": sample.max_new_tokens,
                              "outputs": list(sample.outputs)}
                t0 = time.perf_counter()
                run_sample(model, tokenizer, record, context, question, sample.outputs,
                           sample.max_new_tokens, s, calibrated=calibrated, split=split)
                record["seconds"]["total"] = record["seconds"].get("total", 0.0) + time.perf_counter() - t0
                save(key, record)
                ran += 1
                progress(key)
    return ran
