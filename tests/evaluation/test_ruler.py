"""RULER suite: generators, fitting, scorer, leaderboard and the runner's exactness on a tiny model.

References are independent of the code under test: RULER's ``string_match_all`` written out,
``collections.Counter`` for the word tasks, a chain walk for variable tracking, mlx-lm's own
``generate_step`` for the full cache and the library's compress-once caches fed row by row
for the compressed arms.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from helpers.ruler_helpers import EOS, ByteTokenizer, tiny_model
from qfilters_mlx import CompressOnce
from qfilters_mlx.assets.prompts import source_text
from qfilters_mlx.evaluation.ruler.haystack import HAYSTACK_OFFSET, essay_sentences
from qfilters_mlx.evaluation.ruler.leaderboard import bootstrap_average, leaderboard
from qfilters_mlx.evaluation.ruler.prompt import DoesNotFit, fit, sample_tokens
from qfilters_mlx.evaluation.ruler.runner import RulerSettings, run_ruler
from qfilters_mlx.evaluation.ruler.scoring import string_match_all
from qfilters_mlx.evaluation.ruler.tasks import TASKS, Sources, quick_tasks

SOURCES = Sources(tuple(essay_sentences(source_text())))


# ------------------------------------------------------------------------------ scorer
def ruler_string_match_all(preds, refs):
    """RULER's scripts/eval/synthetic/constants.py, written out."""
    return sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                for pred, ref in zip(preds, refs)]) / len(preds) * 100


@pytest.mark.parametrize("preds, refs", [
    (["The numbers are 123 and 456."], [["123", "456"]]),
    (["ABC-def 12"], [["abc-DEF", "13", "12"]]),
    (["nothing", "7 8 9", "x"], [["1"], ["7", "9"], ["X"]]),
    (["  uuid 1d50E96C-ea86  "], [["1d50e96c-EA86"]]),
])
def test_scorer_is_rulers_rule(preds, refs):
    assert string_match_all(preds, refs) == pytest.approx(ruler_string_match_all(preds, refs))


def test_scorer_random_cases_match_rulers_rule():
    rng = random.Random(0)
    words = ["alpha", "Beta", "gamma", "1234567", "DELTA"]
    for _ in range(200):
        refs = [[rng.choice(words) for _ in range(rng.randint(1, 4))] for _ in range(3)]
        preds = [" ".join(rng.choice(words).swapcase() if rng.random() < 0.3 else rng.choice(words)
                          for _ in range(rng.randint(0, 5))) for _ in range(3)]
        assert string_match_all(preds, refs) == pytest.approx(ruler_string_match_all(preds, refs))


def test_scorer_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="predictions"):
        string_match_all(["a"], [["a"], ["b"]])


# -------------------------------------------------------------------------- generators
def _chain_vars(context: str, value: str) -> set[str]:
    """Variables assigned ``value`` through the ``VAR X = ...`` lines (walked independently)."""
    assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", context))
    def resolve(v):
        while v.startswith("VAR "):
            v = assign[v[4:]]
        return v
    return {k for k, v in assign.items() if resolve(v) == value}


@pytest.mark.parametrize("task", list(TASKS))
def test_generator_is_deterministic_and_answers_are_in_its_context(task):
    gen = TASKS[task]
    for n in (0, 7, 40) if task != "fwe" else (40, 90, 400):
        a, b = gen(SOURCES, "s-1", n), gen(SOURCES, "s-1", n)
        assert a == b
        assert a.outputs and all(o in a.context for o in a.outputs)
    assert gen(SOURCES, "s-2", 40) != gen(SOURCES, "s-1", 40)
    # the answers do not depend on the haystack size (fit searches n)
    assert gen(SOURCES, "s-1", 40).outputs == gen(SOURCES, "s-1", 400).outputs


def test_fwe_refuses_sizes_that_do_not_rank_its_answers():
    from qfilters_mlx.evaluation.ruler.tasks import TooFewUnits

    with pytest.raises(TooFewUnits, match="do not rank"):
        TASKS["fwe"](SOURCES, "s", 7)


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_niah_answers_are_the_queried_needles(task):
    s = TASKS[task](SOURCES, "s-3", 30)
    keys = re.findall(r"for (.+) mentioned", s.question)[0]
    keys = [k.strip() for k in re.split(r", and |, ", keys)]
    found = [v for k in keys for v in re.findall(rf"for {re.escape(k)} is: ([\w-]+)\.", s.context)]
    assert sorted(found) == sorted(s.outputs)


def test_vt_answer_is_the_chain_of_the_value():
    s = TASKS["vt"](SOURCES, "s-4", 30)
    value = re.findall(r"the value (\d+)", s.question)[0]
    assert _chain_vars(s.context, value) == set(s.outputs) and len(s.outputs) == 5


@pytest.mark.parametrize("gen, k", [(TASKS["cwe"], 10), (quick_tasks()["cwe"], 3)])
def test_cwe_answer_is_the_most_common_words(gen, k):
    s = gen(SOURCES, "s-5", 50)
    items = re.findall(r"\d+\. (\S+)", s.context.split("\n")[1])
    counts = Counter(items).most_common()
    assert {w for w, _ in counts[:k]} == set(s.outputs) and counts[k - 1][1] > counts[k][1]


def test_fwe_answer_is_the_three_most_frequent_coded_words():
    s = TASKS["fwe"](SOURCES, "s-6", 800)
    words = s.context.split("coded words. ", 1)[1].split()
    counts = Counter(w for w in words if w != "...").most_common()
    assert [w for w, _ in counts[:3]] == list(s.outputs) and counts[2][1] > counts[3][1]


def test_haystack_prose_is_disjoint_from_calibration_and_retrieval_text():
    from qfilters_mlx.assets.prompts import CALIBRATION_CHARS, CALIBRATION_OFFSET, SOURCE_OFFSET, SPAN_CHARS

    assert HAYSTACK_OFFSET >= CALIBRATION_OFFSET + CALIBRATION_CHARS + 2000  # calibration ends at a paragraph
    assert HAYSTACK_OFFSET > SOURCE_OFFSET + SPAN_CHARS
    text = source_text()
    assert SOURCES.sentences[0] in " ".join(text[HAYSTACK_OFFSET:].split())


def test_fit_takes_the_largest_haystack_that_fits():
    tok = ByteTokenizer()
    for task in ("niah_single_2", "vt", "fwe"):
        build = lambda m, t=task: quick_tasks()[t](SOURCES, "s-7", m)  # noqa: E731
        s, n = fit(build, tok, 1500)
        size = lambda x: sum(map(len, sample_tokens(tok, x))) + x.max_new_tokens  # noqa: E731
        assert size(s) <= 1500 < size(build(n + 1))
    with pytest.raises(DoesNotFit, match="exceed the length"):
        fit(lambda m: TASKS["niah_multikey_3"](SOURCES, "s", m), tok, 100)


def test_question_tokens_follow_the_context_as_in_the_chat_prompt():
    tok = ByteTokenizer()
    s = TASKS["niah_single_1"](SOURCES, "s-8", 5)
    c, q = sample_tokens(tok, s)
    chat = tok.apply_chat_template([{"role": "user", "content": s.context + s.question}])
    assert c + q == tok.encode(chat + s.answer_prefix)
    assert tok.decode(q).startswith(s.question)


# -------------------------------------------------------------------------- leaderboard
def test_bootstrap_average_point_and_interval():
    per_task = [np.array([0.0, 100.0, 100.0]), np.array([50.0, 50.0])]
    avg, lo, hi = bootstrap_average(per_task)
    assert avg == pytest.approx((200 / 3 + 50) / 2)
    assert lo < avg < hi and lo >= 0 and hi <= 100
    assert bootstrap_average([np.array([40.0] * 4)]) == (40.0, 40.0, 40.0)
    # one sample per task: the pooled samples are resampled (a spread remains)
    avg, lo, hi = bootstrap_average([np.array([0.0]), np.array([100.0]), np.array([100.0])])
    assert avg == pytest.approx(200 / 3) and lo < avg < hi
    d = bootstrap_average([np.array([[10.0, 20.0], [10.0, 20.0]])])
    assert d == (0.0, 0.0, 0.0)
    # few samples per task: tasks whose samples agree still leave a spread between tasks
    avg, lo, hi = bootstrap_average([np.array([100.0, 100.0]), np.array([0.0, 0.0])])
    assert avg == 50.0 and lo < 50.0 < hi
    # from MIN_STRATIFIED samples per task on: stratified (constant tasks, no spread)
    assert bootstrap_average([np.full(5, 40.0), np.full(6, 60.0)]) == (50.0, 50.0, 50.0)


def test_pooled_bootstrap_is_the_rule_written_out():
    """Pooled draws, each resample's statistic the mean over the tasks it drew of their means
    (a plain loop over the same random draws)."""
    per_task = [np.array([0.0, 100.0, 30.0]), np.array([50.0, 10.0]), np.array([70.0])]
    vals = [v for x in per_task for v in x]
    task = [i for i, x in enumerate(per_task) for _ in x]
    idx = np.random.default_rng(3).integers(0, len(vals), size=(200, len(vals)))
    stats = []
    for row in idx:
        by = {}
        for j in row:
            by.setdefault(task[j], []).append(vals[j])
        stats.append(sum(sum(v) / len(v) for v in by.values()) / len(by))
    lo, hi = np.quantile(stats, [0.025, 0.975])
    avg, got_lo, got_hi = bootstrap_average(per_task, n_boot=200, seed=3)
    assert avg == pytest.approx((130 / 3 + 30 + 70) / 3)
    assert (got_lo, got_hi) == (pytest.approx(lo), pytest.approx(hi))


def _rec(task, i, full, knorm, stream, greedy_knorm=None):
    f = lambda m, ll=-2.0: {"match": m, "loglik": ll, "tokens": 4}  # noqa: E731
    scores = {"full": full} if greedy_knorm is None else {"full": full, "compress_once/knorm@0.5": greedy_knorm}
    return {"task": task, "length": 1024, "index": i, "seconds": {"total": 1.0, "prefill": 0.5},
            "validation": greedy_knorm is not None, "scores": scores,
            "forced": {"full": f(full), "compress_once/knorm@0.5": f(knorm, -4.0 * (i + 1)),
                       "compress_once/streaming_llm@0.5": f(stream)}}


def test_leaderboard_rows_have_kvpress_shape_per_metric_and_subset():
    recs = [_rec("a", 0, 1.0, 1.0, 0.0, greedy_knorm=1.0), _rec("a", 1, 0.0, 0.5, 0.0),
            _rec("b", 0, 1.0, 0.0, 0.0, greedy_knorm=0.5), _rec("b", 1, 1.0, 1.0, 1.0)]
    board = leaderboard(recs, {"model": "m"})
    row = next(r for r in board["rows"] if r["method"] == "knorm" and r["metric"] == "forced_match"
               and r["subset"] == "all")
    assert {k: row[k] for k in ("dataset", "data_dir", "model", "method", "compression_ratio")} == {
        "dataset": "ruler", "data_dir": "1024", "model": "m", "method": "knorm", "compression_ratio": 0.5}
    assert row["scores"] == {"a": 75.0, "b": 50.0} and row["average"] == 62.5
    # the samples the full cache answers correctly: a/0, b/0, b/1
    row = next(r for r in board["rows"] if r["method"] == "knorm" and r["metric"] == "forced_match"
               and r["subset"] == "full_correct")
    assert row["scores"] == {"a": 100.0, "b": 50.0} and row["n_samples"] == {"a": 1, "b": 2}
    ll = next(r for r in board["rows"] if r["method"] == "knorm" and r["metric"] == "loglik" and r["subset"] == "all")
    assert ll["scores"] == {"a": (-1.0 - 2.0) / 2, "b": (-1.0 - 2.0) / 2}  # loglik / tokens, mean over samples
    p = next(p for p in board["paired"] if p["metric"] == "forced_match" and p["subset"] == "all")
    assert (p["a"], p["b"], p["difference"]) == ("knorm", "streaming_llm", 62.5 - (0.0 + 50.0) / 2)
    assert p["n_samples"] == 4 and p["separated"] is None  # too few samples to judge
    many = leaderboard([_rec(t, i, 1.0, 1.0, 0.0) for t in ("a", "b") for i in range(5)])
    p = next(p for p in many["paired"] if p["metric"] == "forced_match" and p["subset"] == "all")
    assert p["difference"] == 100.0 and p["ci95"] == [100.0, 100.0] and p["separated"] is True
    assert board["meta"]["compute_seconds"] == {"1024": {"total": 4.0, "prefill": 2.0}}
    assert board["meta"]["samples"] == {"1024": {"samples": 4, "full_correct": 3, "validation": 2}}
    # greedy and forced on the same rows: full x4 (equal x4), knorm on a/0 (equal) and b/0 (0.5 vs 0)
    assert board["agreement"]["total"] == {"rows": 6, "equal": 5, "both_right": 4, "greedy_only": 0,
                                           "forced_only": 0, "both_wrong": 2}


# --------------------------------------------------------------- runner on a tiny model
TINY_TASKS = ("niah_single_2", "vt", "fwe")


@pytest.fixture(scope="module")
def tiny_run():
    model, tok = tiny_model(), ByteTokenizer()
    filters = mx.random.normal((2, 2, 16), key=mx.random.key(3))
    filters = filters / mx.linalg.norm(filters, axis=-1, keepdims=True)
    s = RulerSettings(lengths=(900,), samples=1, tasks=TINY_TASKS, ratios=(0.0, 0.5), chunk=64,
                      calib_tokens=16, protocols=("compress_once",))
    recs = {}
    run_ruler(model, tok, SOURCES, s, tasks=quick_tasks(), calibrated=filters,
              save=lambda k, r: recs.__setitem__(k, r))
    return model, tok, filters, s, recs


def _sample(tok, rec):
    return fit(lambda m: quick_tasks()[rec["task"]](SOURCES, rec["seed"], m), tok, rec["length"])[0]


def _greedy(model, logits, caches, max_new_tokens: int) -> list[int]:
    """Greedy token ids from ``logits`` on, one token per forward pass, stopping at EOS."""
    ids = []
    for _ in range(max_new_tokens):
        t = int(mx.argmax(logits).item())
        if t == EOS:
            break
        ids.append(t)
        logits = model(mx.array([[t]]), cache=caches)[0, -1]
    return ids


def _greedy_mlx_lm(model, prompt, n):
    ids = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        if int(t) == EOS:
            break
        ids.append(int(t))
    return ids


def test_full_cache_answers_as_plain_mlx_lm(tiny_run):
    model, tok, _, _, recs = tiny_run
    assert len(recs) == len(TINY_TASKS)
    for rec in recs.values():
        s = _sample(tok, rec)
        c, q = sample_tokens(tok, s)
        assert rec["context_tokens"] == len(c) and len(c) + len(q) + s.max_new_tokens <= 900
        ref = tok.decode(_greedy_mlx_lm(model, c + q, s.max_new_tokens))
        ans = rec["answers"]["full"]  # (decoding stops once every expected string is written)
        assert ans == ref or (rec["scores"]["full"] == 1.0 and ref.startswith(ans))


def test_ratio_zero_answers_as_the_full_cache_for_every_arm(tiny_run):
    _, _, _, s, recs = tiny_run
    for rec in recs.values():
        zero = {k: v for k, v in rec["answers"].items() if k.endswith("@0")}
        assert len(zero) == len(s.compress_arms)
        assert all(v == rec["answers"]["full"] for v in zero.values())
        assert all(rec["kept"][k] == rec["context_tokens"] for k in zero)


@pytest.mark.parametrize("arm, method, n_sink", [("knorm", "l2norm", 0), ("qfilters", "qfilters", 0),
                                                 ("streaming_llm", "streaming_llm", 4)])
def test_compressed_arm_answers_as_the_library_compress_once_cache(tiny_run, arm, method, n_sink):
    """The batched, stacked decoding equals one row with the library's own compress-once caches."""
    from qfilters_mlx.cache.compression import compress_caches
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import KVCacheConfig

    model, tok, filters, _, recs = tiny_run
    for rec in recs.values():
        c, q = sample_tokens(tok, _sample(tok, rec))
        cfg = KVCacheConfig(method=method, mode=CompressOnce(ratio=0.5, at="manual"), qfilters_n_sink=n_sink,
                            qfilters_recent=0, qfilters_filter_source="keys", qfilters_sign=1)
        caches = [QFiltersKVCache(cfg, layer_idx=i, filters=filters[i] if method == "qfilters" else None)
                  for i in range(2)]
        for i in range(0, len(c), 64):  # the run's prefill chunks (BLAS results depend on shapes)
            model(mx.array(c[i:i + 64])[None], cache=caches)
        assert compress_caches(caches) == [int(len(c) * 0.5)] * 2
        logits = model(mx.array(q)[None], cache=caches)[0, -1]
        ids = _greedy(model, logits, caches, rec["max_new_tokens"])
        assert rec["answers"][f"compress_once/{arm}@0.5"] == tok.decode(ids), rec["task"]


def test_resumed_run_skips_finished_samples_and_refuses_other_settings(tiny_run):
    model, tok, filters, s, recs = tiny_run
    ran = run_ruler(model, tok, SOURCES, s, tasks=quick_tasks(), calibrated=filters, load=recs.get)
    assert ran == 0
    from dataclasses import replace

    with pytest.raises(ValueError, match="use another output folder"):
        run_ruler(model, tok, SOURCES, replace(s, chunk=32), tasks=quick_tasks(), calibrated=filters,
                  load=recs.get)


def test_a_sample_that_does_not_fit_is_recorded_and_reported_and_the_run_goes_on():
    """A task whose smallest haystack exceeds the length gets a record naming why, the other
    tasks run, a resumed run skips it, and the leaderboard and page list it apart."""
    from qfilters_mlx.evaluation.ruler.report import markdown

    model, tok = tiny_model(), ByteTokenizer()
    tasks = {"niah_single_2": quick_tasks()["niah_single_2"],
             "huge": lambda src, seed, m: quick_tasks()["niah_single_2"](src, seed, m + 600)}
    s = RulerSettings(lengths=(900,), samples=1, tasks=("huge", "niah_single_2"), ratios=(0.5,), chunk=64,
                      calib_tokens=16, protocols=("compress_once",), compress_arms=("knorm",))
    recs = {}
    assert run_ruler(model, tok, SOURCES, s, tasks=tasks, save=lambda k, r: recs.__setitem__(k, r)) == 1
    assert "exceed the length 900" in recs["900/huge/0"]["does_not_fit"]
    assert "answers" not in recs["900/huge/0"] and "compress_once/knorm@0.5" in recs["900/niah_single_2/0"]["forced"]
    assert run_ruler(model, tok, SOURCES, s, tasks=tasks, load=recs.get) == 0
    board = leaderboard(list(recs.values()), {"model": "tiny"})
    assert board["meta"]["does_not_fit"] == {"900": ["huge/0"]}
    assert board["meta"]["samples"]["900"]["samples"] == 1
    assert all(set(r["n_samples"]) == {"niah_single_2"} for r in board["rows"])
    assert "1 sample did not fit this length even with the smallest haystack and was left out: huge/0." in \
        markdown(board)


def test_cli_quick_runs_its_checks_and_writes_the_leaderboard(tmp_path, capsys):
    import mlx_lm

    from qfilters_mlx.commands.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    out = tmp_path / "r"
    with mock.patch.object(mlx_lm, "load", lambda p: (tiny_model(), ByteTokenizer())):
        rc = main(["eval", "ruler", "--quick", "--model", str(tmp_path / "m"), "--lengths", "900",
                   "--tasks", "niah_single_1", "vt", "--arms", "qfilters_online", "knorm",
                   "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and text.count(": ok") == 4
    board = json.loads(out.with_suffix(".json").read_text())
    assert {r["method"] for r in board["rows"]} == {"full", "qfilters_online", "knorm"}
    assert out.with_suffix(".png").exists() and "| compress_once | knorm |" in out.with_suffix(".md").read_text()
    assert len(list((tmp_path / "r_samples" / "900").glob("*.json"))) == 2


def test_cli_refuses_the_qfilters_arm_without_filters(tmp_path, capsys):
    import mlx_lm

    from qfilters_mlx.commands.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with mock.patch.object(mlx_lm, "load", lambda p: (tiny_model(), ByteTokenizer())), \
            pytest.raises(SystemExit) as e:
        main(["eval", "ruler", "--quick", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "needs --filters" in capsys.readouterr().err


@pytest.mark.parametrize("arm, method", [("streaming_llm", "streaming_llm"), ("knorm", "l2norm")])
def test_streaming_arm_answers_as_the_library_streaming_cache(arm, method):
    """A streaming row equals the library's streaming caches at budget
    int((1 - ratio) * context tokens), fed the prompt in the run's chunks. (One arm per run:
    rows batched together agree up to float rounding, which a random tiny model can turn into
    another greedy token; the batching itself is checked in test_evaluation.)"""
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache
    from qfilters_mlx.config import KVCacheConfig

    model, tok = tiny_model(), ByteTokenizer()
    s = RulerSettings(lengths=(700,), samples=1, tasks=("niah_single_1",), ratios=(0.5,), chunk=64,
                      calib_tokens=16, protocols=("streaming",), compress_arms=(), streaming_arms=(arm,),
                      streaming_samples="all")
    recs = {}
    run_ruler(model, tok, SOURCES, s, tasks=quick_tasks(), save=lambda k, r: recs.__setitem__(k, r))
    rec = recs["700/niah_single_1/0"]
    c, q = sample_tokens(tok, _sample(tok, rec))
    prompt = c + q
    cfg = KVCacheConfig(method=method, qfilters_budget=int(0.5 * len(c)), qfilters_sign=1,
                        qfilters_filter_source="keys")
    caches = [QFiltersKVCache(cfg, layer_idx=i) for i in range(2)]
    for i in range(0, len(prompt), 64):
        logits = model(mx.array(prompt[i:i + 64])[None], cache=caches)[0, -1]
    ids = _greedy(model, logits, caches, rec["max_new_tokens"])
    assert rec["answers"][f"streaming/{arm}@0.5"] == tok.decode(ids)
    assert rec["kept"][f"streaming/{arm}@0.5"] == int(0.5 * len(c))
