"""Recall beyond the recent window through real greedy generation: ``mlx_lm.generate`` on the real
caches, at about 4x and 8x compression of the prompt.

Prompts: about ``--contexts`` tokens of the evaluation text (CPython's reference documentation,
``source_text()``, whole paragraphs from offsets that the calibration text never touches), a
needle at depth ``--depths`` (a paragraph boundary), then a question, in the model's chat
template. Two needle forms (:data:`FORMS`): a 5-digit pass key, and a secret word (a common
English word). A prompt counts as recalled when the greedy answer (``--max-tokens`` tokens)
contains the needle's value. Shares are counted on the prompts the full cache recalls.

Arms, each at budget ``prompt tokens / ratio`` (rounded down to a multiple of 8) per prompt:

* ``full``: mlx-lm's ``make_prompt_cache`` (plain ``KVCache``);
* ``streaming_llm``: mlx-lm's ``RotatingKVCache(max_size=B, keep=4)`` per layer, built by hand
  (``--max-kv-size`` does nothing for models whose class defines ``make_cache``);
* ``default``: ``KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=B))``;
* ``heads``: the same with ``heads="calibrated"``: the model's retrieval heads (ranked once on
  calibration needles) at 4x the budget, the other heads at the rest (docs/head-groups.md); the
  big heads keep the other heads' recent window and the rest by the filter's score;
* ``heads_window``: the same budgets, the big heads keeping a recent window of their whole budget
  (sinks and ``budget - n_sink - 1`` recent: a bigger window instead of the score).

mlx-lm's ``generate_step`` prefills the prompt but its last token in one call (prompts under
2,048 tokens), evicts, then answers from what was kept. The distance back to the needle (tokens
from its first token to the prompt's end) is reported per prompt.

Usage::

    python bench/bench_recall_generate.py [--model NAME] [--contexts 1024,1536] [--ratios 4,8]

Writes ``bench/results/recall_generate.json`` and ``.md`` (``--out``; resumable).
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

FORMS = ("pass_key", "word")
WORDS = ("harbor", "violet", "lantern", "meadow", "copper", "falcon", "orchid", "glacier",
         "saddle", "thunder", "pepper", "marble")
OFFSETS = (120000, 160000, 200000, 240000)


def _needle(form: str, seed: str) -> tuple[str, str, str]:
    """``(value, sentence, question)`` of one needle."""
    rng = random.Random(seed)
    if form == "pass_key":
        v = str(rng.randint(10000, 99999))
        return v, f"The secret pass key is {v}. Remember it.", "What is the secret pass key?"
    v = rng.choice(WORDS)
    return v, f"The secret word is {v}. Remember it.", "What is the secret word?"


def _paragraphs(text: str, start: int, tokens: int, tokenizer) -> list[str]:
    at = text.index("\n\n", start) + 2
    out, n = [], 0
    while n < tokens:
        end = text.index("\n\n", at)
        para = text[at:end].strip()
        at = end + 2
        if para:
            out.append(para)
            n += len(tokenizer.encode(para, add_special_tokens=False))
    return out


def make_prompt(tokenizer, text, offset, context, depth, form):
    value, sentence, question = _needle(form, f"{offset}-{context}-{depth}-{form}")
    paras = _paragraphs(text, offset, context, tokenizer)
    k = max(1, round(depth * len(paras)))
    body = "\n\n".join(paras[:k] + [sentence] + paras[k:])
    chat = [{"role": "user", "content": "Read the text and remember the secret it holds.\n\n" + body
             + "\n\n" + question}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    at = -1
    for spelled in (value, " " + value, '"' + value):  # (a word is one token with its space)
        needle = tokenizer.encode(spelled, add_special_tokens=False)
        at = max(at, next((i for i in range(len(ids) - len(needle), -1, -1)
                           if ids[i:i + len(needle)] == needle), -1))
    return {"ids": ids, "value": value, "form": form, "depth": depth, "offset": offset,
            "distance": len(ids) - at if at >= 0 else None}


def caches_for(arm, model, tokenizer, budget):
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from qfilters_mlx import KVCacheBuilder, KVCacheConfig

    if arm == "full":
        return make_prompt_cache(model)
    if arm == "streaming_llm":
        return [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    cfg = KVCacheConfig(qfilters_budget=budget)
    if arm == "default":
        return KVCacheBuilder.for_model(model, cfg, tokenizer=tokenizer)
    if arm == "heads":
        return KVCacheBuilder.for_model(model, cfg, tokenizer=tokenizer, heads="calibrated")
    from qfilters_mlx import HeadBudgets
    from qfilters_mlx.filters.head_budgets import head_budgets
    from qfilters_mlx.filters.head_store import resolve_head_ranking

    rule = head_budgets(resolve_head_ranking(model, tokenizer).ranking, budget, cfg.qfilters_n_sink)
    small = min(min(row) for row in rule.budgets)
    windows = [[b - cfg.qfilters_n_sink - 1 if b > small else r for b, r in zip(bs, rs)]
               for bs, rs in zip(rule.budgets, rule.recents)]  # heads_window: big heads keep a window
    return KVCacheBuilder.for_model(model, cfg, tokenizer=tokenizer, heads=HeadBudgets(rule.budgets, windows))


def answer(model, tokenizer, ids, caches, max_tokens) -> str:
    from mlx_lm import generate

    return generate(model, tokenizer, prompt=ids, max_tokens=max_tokens, prompt_cache=caches, verbose=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_arg(p)
    p.add_argument("--contexts", type=common.int_list, default=[1024, 1536])
    p.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.3])
    p.add_argument("--offsets", type=common.int_list, default=list(OFFSETS[:2]))
    p.add_argument("--ratios", type=common.int_list, default=[4, 8])
    p.add_argument("--arms", default="streaming_llm,default,heads")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=common.RESULTS / "recall_generate.json")
    p.add_argument("--report", action="store_true", help="only rewrite the table (and distances)")
    a = p.parse_args()
    from mlx_lm.utils import load

    from qfilters_mlx.assets.prepare_model import prepare_model
    from qfilters_mlx.assets.prompts import source_text

    model, tokenizer = load(str(prepare_model(a.model)))
    res = json.loads(a.out.read_text()) if a.out.exists() else {"model": a.model, "prompts": {}}
    if res.get("model") != a.model:
        raise SystemExit(f"{a.out} holds {res.get('model')}; use another --out")
    if not a.report:
        res.setdefault("runs", []).append({"meta": common.run_meta(),
                                           "args": {k: str(v) for k, v in vars(a).items()}})
    text = source_text()
    arms = a.arms.split(",")
    if a.report:
        for name, row in res["prompts"].items():
            form, offset, context, depth = name.split("/")
            row["distance"] = make_prompt(tokenizer, text, int(offset), int(context), float(depth), form)["distance"]
        a.offsets = []
    for offset in a.offsets:
        for context in a.contexts:
            for depth in a.depths:
                for form in FORMS:
                    name = f"{form}/{offset}/{context}/{depth}"
                    pr = make_prompt(tokenizer, text, offset, context, depth, form)
                    row = res["prompts"].setdefault(name, {k: pr[k] for k in ("value", "form", "depth", "offset",
                                                                             "distance")} | {"tokens": len(pr["ids"]), "arms": {}})
                    if "full" not in row["arms"]:
                        t = time.time()
                        out = answer(model, tokenizer, pr["ids"], caches_for("full", model, tokenizer, 0), a.max_tokens)
                        row["arms"]["full"] = {"answer": out, "ok": pr["value"].lower() in out.lower(),
                                               "s": time.time() - t}
                    if not row["arms"]["full"]["ok"]:
                        print(f"{name}: full misses ({row['arms']['full']['answer']!r})", flush=True)
                        a.out.write_text(json.dumps(res, indent=1))
                        continue
                    for ratio in a.ratios:
                        budget = len(pr["ids"]) // ratio // 8 * 8
                        for arm in arms:
                            key = f"{arm}@{ratio}x"
                            if key in row["arms"]:
                                continue
                            out = answer(model, tokenizer, pr["ids"], caches_for(arm, model, tokenizer, budget),
                                         a.max_tokens)
                            row["arms"][key] = {"budget": budget, "answer": out,
                                                "ok": pr["value"].lower() in out.lower()}
                            print(f"{name} {key} (B={budget}): {row['arms'][key]['ok']}", flush=True)
                    a.out.write_text(json.dumps(res, indent=1))
    a.out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    a.out.with_suffix(".md").write_text(md)
    print(md)


def markdown(res) -> str:
    rows, keys = res["prompts"], []
    for r in rows.values():
        keys += [k for k in r["arms"] if k != "full" and k not in keys]
    answered = [r for r in rows.values() if r["arms"].get("full", {}).get("ok")]
    lines = [f"# Recall beyond the recent window through `mlx_lm.generate` ({res['model']})", "",
             f"Prompts: {len(rows)}; the full cache answers {len(answered)}. Shares over those.", ""]
    table = [[k, f"{sum(r['arms'][k]['ok'] for r in answered if k in r['arms'])} / "
                 f"{sum(k in r['arms'] for r in answered)}"] for k in sorted(keys)]
    lines += common.md_table(["arm @ compression", "recalled"], table, "lr")
    lines += ["", "Per prompt (distance: tokens from the needle to the prompt's end):", ""]
    per = [[name, r["tokens"], r["distance"], *["yes" if r["arms"].get(k, {}).get("ok") else
                                                   ("no" if k in r["arms"] else "-") for k in ["full", *sorted(keys)]]]
           for name, r in rows.items()]
    lines += common.md_table(["prompt", "tokens", "distance", "full", *sorted(keys)], per)
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
