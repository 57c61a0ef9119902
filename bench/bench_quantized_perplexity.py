"""Eviction and quantized storage together: streaming perplexity and KV bytes.

The protocol of ``qfilters-mlx eval`` (docs/evaluation.md): SmolLM2-135M-Instruct float32,
the first ``prefix + scored`` tokens of CPython's reference documentation (default 128 +
2,048; the committed run: 1,024 + 512, to fit the shared machine), the prefix prefilled in
one call, then every token predicted token by token through the evicted cache. Arms: the
best Q-Filters arm of that evaluation (the offline calibrated query filter,
``bench/results/smollm2_filters.safetensors``, recent budget/2) and StreamingLLM (4 sinks),
at budgets 128/256/512, each with ``kv_bits`` None / 8 / 4 (group size 64); references: the
full cache (mlx-lm ``KVCache``) and mlx-lm's ``QuantizedKVCache`` at the same bits (full
length, chunked teacher forcing). All arms of one ``kv_bits`` run as rows of one batch
(``batch_caches``). KV bytes: the kept K/V rows as stored, summed over the 30 layers
(packed words + scales + biases when quantized; scores and filter listed apart).

Writes ``bench/results/quantized_perplexity.json`` and ``.md``. Usage (resumable from its JSON)::

    PYTHONPATH=python python bench/bench_quantized_perplexity.py [--scored 2048] [--budgets 128,256,512]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (fast BLAS before MLX)
import mlx.core as mx
from common import RESULTS, int_list, load_model, md_table, run_meta, write_results

FILTERS = RESULTS / "smollm2_filters.safetensors"
OUT = RESULTS / "quantized_perplexity.json"
PREFIX = 128  # default prefix (qfilters-mlx eval's)


def bits_list(text: str) -> list:
    return [None if x == "none" else int(x) for x in text.split(",")]


def label(bits) -> str:
    return "none" if bits is None else str(bits)


def full_nll(model, tokens, bits, prefix: int, chunk: int = 512) -> tuple[list[float], int]:
    """NLLs of ``tokens[PREFIX:]`` with a full cache (``KVCache``, or mlx-lm's
    ``QuantizedKVCache(64, bits)``), chunked teacher forcing; and the bytes of the
    K/V it holds (rows up to its offset, without the buffer's slack)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    caches = make_prompt_cache(model) if bits is None else [
        QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    toks, out = mx.array(tokens), []
    for s in range(0, len(tokens) - 1, chunk):
        e = min(s + chunk, len(tokens) - 1)
        lp = model(toks[None, s:e], cache=caches)[0].astype(mx.float32)
        nll = mx.logsumexp(lp, axis=-1) - mx.take_along_axis(lp, toks[s + 1 : e + 1, None], axis=-1)[:, 0]
        out.extend(nll.tolist())
    held = sum(x.nbytes * c.offset // x.shape[2] for c in caches for _, x in tree_flatten((c.keys, c.values)))
    return out[prefix - 1 :], held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scored", type=int, default=2048, help="tokens scored (default 2048)")
    p.add_argument("--prefix", type=int, default=PREFIX,
                   help="tokens prefilled in one call before scoring (default 128, as qfilters-mlx eval)")
    p.add_argument("--budgets", type=int_list, default=[128, 256, 512])
    p.add_argument("--bits", type=bits_list, default=[None, 8, 4], help="e.g. none,8,4")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()

    import mlx_lm  # noqa: F401  (first: importing filters.calibration before mlx_lm hits an import cycle)

    from qfilters_mlx.assets.prompts import source_text
    from qfilters_mlx.evaluation.arms import default_arms, query_arms
    from qfilters_mlx.evaluation.perplexity import batched_streaming_nll, perplexity
    from qfilters_mlx.filters.calibration import load_filters
    from qfilters_mlx.model_info import model_head_dim

    import json
    from pathlib import Path

    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    settings = {"prefix": args.prefix, "scored": args.scored, "kv_group_size": 64, "n_sink": 4}
    if res.get("settings") not in (None, settings):
        raise SystemExit(f"{out} was written with other settings {res['settings']}; use --out")
    res["settings"] = settings
    res.setdefault("cells", {})
    model, tok = load_model()
    tokens = tok.encode(source_text(), add_special_tokens=False)[: args.prefix + args.scored]
    filters, _ = load_filters(str(FILTERS), model)
    hd, n_layers = model_head_dim(model), len(model.layers)
    arms = [a for a in query_arms(filters) if a.family == "qfilters-calibrated"]
    arms += [a for a in default_arms() if a.method == "streaming_llm"]

    def save():
        res["meta"] = run_meta(note="2 cores shared with 5 other jobs: timings are not measured here")
        write_results(out, res, markdown(res))

    for bits in args.bits:
        key = f"full@kv{label(bits)}"
        if key not in res["cells"]:
            nll, nbytes = full_nll(model, tokens, bits, args.prefix)
            res["cells"][key] = {"arm": "full", "kv_bits": bits, "budget": None, "ppl": perplexity(nll),
                                 "kv_bytes": nbytes, "tokens_kept": len(tokens) - 1}
            save()
    for bits in args.bits:
        todo = [(a, b) for b in args.budgets for a in arms
                if f"{a.name}@{b}@kv{label(bits)}" not in res["cells"]]
        if not todo:
            continue
        rows = []
        for a, b in todo:
            cfg = a.config(b).with_head_dim(hd)
            rows.append([a.make_cache(cfg, layer, bits=bits) for layer in range(n_layers)])
        tic = time.perf_counter()
        nlls = batched_streaming_nll(model, tokens, rows, args.prefix)
        seconds = time.perf_counter() - tic
        for (a, b), nll, row in zip(todo, nlls, rows):
            res["cells"][f"{a.name}@{b}@kv{label(bits)}"] = {
                "arm": a.name, "kv_bits": bits, "budget": b, "ppl": perplexity(nll),
                "kv_bytes": sum(c.kept_kv_bytes for c in row),
                "method_bytes": sum(c.qfilters_kept_bytes for c in row),
                "tokens_kept": row[0].size(), "batch_seconds": seconds}
        save()
        print(f"kv_bits={label(bits)}: {len(todo)} arms in {seconds:.0f} s", flush=True)
    print(markdown(res))


def markdown(res: dict) -> str:
    cells = res["cells"]
    full = cells.get("full@kvnone", {}).get("ppl")
    lines = ["# Eviction + quantized K/V storage (SmolLM2-135M-Instruct, float32)", "",
             f"Streaming perplexity over {res['settings']['scored']} tokens after a "
             f"{res['settings']['prefix']}-token prefix prefilled in one call (`qfilters-mlx eval`'s protocol, "
             "docs/evaluation.md, which scores 2,048 tokens after 128, shortened to fit a shared "
             "2-core machine: every scored token is predicted from an evicted cache at every budget); "
             "token by token through the cache, the first tokens of CPython's reference documentation; "
             "arms of one kv_bits in one batch; group size 64. "
             "KV bytes: kept K/V as stored, all 30 layers (quantized: packed + scales + biases; the "
             "float32 scores and filter of the Q-Filters arm are extra). In brackets: gap to the "
             "unquantized full cache.", ""]
    header = ["arm", "budget", "kv_bits", "perplexity", "KV bytes", "vs full float32"]
    rows = []
    full_bytes = cells.get("full@kvnone", {}).get("kv_bytes")
    order = sorted(cells.values(), key=lambda c: (c["arm"] != "full", c["arm"], c["budget"] or 0,
                                                   -(c["kv_bits"] or 99)))
    for c in order:
        gap = "" if full is None else f" ({c['ppl'] - full:+.2f})"
        ratio = "" if not full_bytes else f"1/{full_bytes / c['kv_bytes']:.1f}"
        rows.append([c["arm"], c["budget"] or "all", label(c["kv_bits"]), f"{c['ppl']:.2f}{gap}",
                     f"{c['kv_bytes'] / 2**20:.2f} MiB", ratio])
    return "\n".join(lines + md_table(header, rows, "lrrrrr")) + "\n"


if __name__ == "__main__":
    main()
