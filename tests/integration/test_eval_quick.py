"""``qfilters-mlx eval --quick`` on SmolLM2 (CI): the sanity checks hold against independent references.

* the full-cache perplexity equals one plain mlx-lm forward pass (no cache) over the same tokens;
* with budget >= length every arm equals the full cache;
* the random arm is seeded: rerun alone it gives the same NLLs;
* every cell of the quick protocol is present, the table and plot are written.
"""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from qfilters_mlx.assets.prepare_model import prepare_model

    try:
        prepare_model()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 not available: {err}")
    from qfilters_mlx.commands.cli import main

    out = tmp_path_factory.mktemp("eval") / "eval_quick.json"
    status = main(["eval", "--quick", "--no-progress", "--out", str(out)])
    return status, out, json.loads(out.read_text())


def test_quick_checks_pass(quick_run):
    status, out, res = quick_run
    assert status == 0
    assert res["checks"]["full_matches_kvcache_streaming"]
    assert res["checks"]["budget_covers_length_equals_full"]
    assert res["checks"]["random_reproducible"]
    assert out.with_suffix(".md").read_text().startswith("Command: `qfilters-mlx eval --quick")
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_quick_flags_rechecked_from_the_saved_numbers(quick_run):
    """Each flag the product asserts, recomputed here from the numbers it saved (a flag made
    always-true must not pass): the random arm's rerun alone, the covering budget, the
    kvcache-streaming perplexity."""
    _, _, res = quick_run
    s, p, checks = res["settings"], res["perplexity"], res["checks"]
    reruns = {k: c for k, c in p.items() if "nll_rerun_alone" in c}
    assert len(reruns) == 1
    ((name, cell),) = reruns.items()
    assert name.startswith("random@") and int(name.rsplit("@", 1)[1]) in s["budgets"]
    assert len(cell["nll_rerun_alone"]) == len(cell["nll"]) == s["ppl_scored"]
    assert max(abs(a - b) for a, b in zip(cell["nll"], cell["nll_rerun_alone"])) <= 1e-4
    assert max(abs(a - b) for a, b in zip(cell["nll"], p["full"]["nll"])) > 1e-2  # it evicted
    full = p["full"]["ppl"]
    cover = [c for k, c in p.items() if k.endswith(f"@{s['check_budget']}")]
    assert len(cover) >= 13 and all(abs(c["ppl"] - full) <= 1e-3 * full for c in cover)
    assert abs(checks["kvcache_streaming_ppl"] - full) <= 1e-3 * full
    assert checks["random_reproducible"] and checks["budget_covers_length_equals_full"]


def test_full_cache_equals_one_plain_forward_pass(quick_run):
    import mlx.core as mx
    from mlx_lm import load

    from qfilters_mlx.assets.prepare_model import prepare_model
    from qfilters_mlx.assets.prompts import source_text

    _, _, res = quick_run
    s = res["settings"]
    model, tokenizer = load(str(prepare_model()))
    n = s["ppl_prefix"] + s["ppl_scored"]
    toks = tokenizer.encode(source_text(), add_special_tokens=False)[:n]
    assert res["text_tokens"]["perplexity"] == [0, n]
    logits = model(mx.array(toks[:-1])[None])[0].astype(mx.float32)  # no cache at all
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, mx.array(toks[1:])[:, None], axis=-1)[:, 0]
    want = math.exp(mx.mean(nll[s["ppl_prefix"] - 1 :]).item())
    assert res["perplexity"]["full"]["ppl"] == pytest.approx(want, rel=1e-3)
    assert res["checks"]["kvcache_streaming_ppl"] == pytest.approx(want, rel=1e-3)
    # real English prose on a 135M model: a sane range, not a degenerate one
    assert 3 < want < 60


def test_cells_and_budget_covering_length(quick_run):
    from qfilters_mlx.evaluation.arms import default_arms

    _, _, res = quick_run
    s = res["settings"]
    p = res["perplexity"]
    full = p["full"]
    names = [a.name for a in default_arms()]
    for b in [*s["budgets"], s["check_budget"]]:
        for name in names:
            cell = p[f"{name}@{b}"]
            assert cell["n_scored"] == s["ppl_scored"]
    for name in names:
        cover = p[f"{name}@{s['check_budget']}"]
        assert cover["ppl"] == pytest.approx(full["ppl"], rel=1e-3)
        assert max(abs(a - b) for a, b in zip(cover["nll"], full["nll"])) < 1e-3
    # at the evicting budget, recent=0 Q-Filters differs from the full cache (eviction happened)
    assert p[f"qfilters-keys+1@r0@{s['budgets'][0]}"]["ppl"] > 1.2 * full["ppl"]
    r = res["retrieval"]
    from qfilters_mlx.evaluation.arms import query_arms, retrieval_arms

    per_budget = len(retrieval_arms(default_arms() + query_arms()))  # no --filters in quick mode
    assert any(k.startswith("full@") for k in r) and len(r) == 1 + per_budget * len(s["budgets"])
    assert all(len(c["key"]) == 5 and c["correct"] == (c["key"] in c["answer"]) for c in r.values())
    sq = res["score_quality"][str(s["sq_cached"][0])]
    assert len(sq) == 30 and all(len(v["l2norm"]) == 3 for v in sq.values())
    for layer in sq.values():  # the two signs of one filter rank tokens in exactly opposite orders
        for a, b in zip(layer["qfilters-keys+1"], layer["qfilters-keys-1"]):
            assert a == pytest.approx(-b, abs=1e-9) or (math.isnan(a) and math.isnan(b))
