"""How many calibration tokens the default (calibrated query) filters need, and which tokens.

Measured on SmolLM2-135M-Instruct (the project's real model):

* **cosine** per (layer, KV head) between filters from the first ``n`` calibration tokens
  and reference filters from a larger sample: ``--reference-file`` (default
  ``bench/results/smollm2_filters.safetensors``, ``qfilters-mlx calibrate``'s default run: 4,096
  tokens of the same text in 1,024-token chunks), else ``--reference`` tokens captured here;
  or, with ``--reference-disjoint N``, ``N`` tokens (16,384 by the results committed) of the
  same source text from the first paragraph after character :data:`DISJOINT_OFFSET`, a span
  that no calibration, evaluation segment, shipped prompt or RULER haystack uses (the
  4,096-token file then is one more arm); the prefixes are nested prefixes of one run (queries at positions ``< n`` of a causal model do
  not depend on later tokens, so the prefix of one capture is exactly a calibration on ``n``
  tokens with the same chunking);
* the same cosine for token ids had without a tokenizer: uniform random ids over the
  vocabulary, and text the model samples itself (temperature 1) from a random start token;
* **streaming perplexity** at budget 256 (4 sinks, recent 128, prefix 128, 2,048 scored
  tokens of the evaluation text, :mod:`qfilters_mlx.evaluation`) with each set of filters,
  all arms batched in one pass.

Calibration text: :func:`qfilters_mlx.assets.prompts.calibration_text` (disjoint from the
evaluation text). Writes ``bench/results/calibration_tokens.json`` and ``.md``.

    python bench/bench_calibration_tokens.py [--reference-disjoint 16384] [--skip-ppl]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PREFIXES = (64, 128, 256, 512, 1024, 2048, 4096)
PPL_PREFIXES = (128, 256, 512, 1024, 2048)
DISJOINT_OFFSET = 220_000
"""Start of the disjoint reference span: after the shipped prompt (``SOURCE_OFFSET`` + two
spans), before the calibration text (``CALIBRATION_OFFSET``)."""


def capture_queries(model, chunks):
    """Per budgeted layer, the post-RoPE queries ``[H_q, N, D]`` of every chunk, in order."""
    import mlx.core as mx

    from qfilters_mlx.filters.capture import capture_attention
    from qfilters_mlx.model_info import budgeted_slots, default_caches, walk

    paths = [s.path for s in budgeted_slots(model)]
    per_layer = [[] for _ in paths]
    seconds = []
    for chunk in chunks:
        tic = time.perf_counter()
        caches = default_caches(model)
        slot = dict(walk(caches))
        with capture_attention(model, lambda i, q, _k: per_layer[i].append(q[0].astype(mx.float32)),
                               caches=[slot[p] for p in paths]):
            model(mx.array(chunk)[None], cache=caches)
        mx.eval(per_layer)
        seconds.append(time.perf_counter() - tic)
    return [mx.concatenate(q, axis=1) for q in per_layer], seconds


def filters_from(queries, n: int, n_kv: int):
    """``[n_layers, H_kv, D]`` filters from the first ``n`` query rows of every layer."""
    import mlx.core as mx

    from qfilters_mlx.backends import reference

    return mx.stack([reference.estimate_filter_from_queries(q[None, :, :n], n_kv) for q in queries])


def cosines(a, b) -> dict:
    import numpy as np

    c = (np.array(a) * np.array(b)).sum(-1).ravel()
    return {"mean": float(c.mean()), "median": float(np.median(c)), "min": float(c.min()),
            "share_above_0.95": float((c > 0.95).mean())}


def sampled_ids(model, n: int, vocab: int, seed: int) -> list[int]:
    """``n`` tokens the model samples itself (temperature 1) from a random start token."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(seed)
    cache = make_prompt_cache(model)
    tok = mx.random.randint(0, vocab, (1, 1))
    out = [int(tok.item())]
    while len(out) < n:
        logits = model(tok, cache=cache)[:, -1]
        tok = mx.random.categorical(logits)[None]
        out.append(int(tok.item()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", type=int, default=8192,
                    help="tokens of the reference filters when --reference-file is ''")
    ap.add_argument("--reference-file", default=str(RESULTS / "smollm2_filters.safetensors"))
    ap.add_argument("--reference-disjoint", type=int, default=0,
                    help="reference filters from this many tokens of a disjoint span (the file "
                         "becomes an arm)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens captured for the prefixes")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--other", type=int, default=512, help="tokens of the tokenizer-free arms")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--scored", type=int, default=2048)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "calibration_tokens"))
    args = ap.parse_args()

    from qfilters_mlx.blas import enable_fast_blas

    enable_fast_blas()
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from qfilters_mlx.assets.prepare_model import prepare_model
    from qfilters_mlx.assets.prompts import calibration_text, source_text
    from qfilters_mlx.commands.calibrate import encode_quietly
    from qfilters_mlx.model_info import model_dims

    model, tokenizer = load(str(prepare_model()))
    n_layers, n_kv, _ = model_dims(model)
    text, source = calibration_text()
    ref_meta = None
    file_arm = None
    if args.reference_disjoint:
        from qfilters_mlx.assets.prompts import CALIBRATION_OFFSET
        from qfilters_mlx.filters.calibration import load_filters

        full = source_text()
        start = full.index("\n\n", DISJOINT_OFFSET) + 2
        ref_ids = encode_quietly(tokenizer, full[start:CALIBRATION_OFFSET])[: args.reference_disjoint]
        assert len(ref_ids) == args.reference_disjoint, f"the span has {len(ref_ids)} tokens"
        ref_q, ref_seconds = capture_queries(model, [ref_ids[i:i + args.chunk]
                                                     for i in range(0, len(ref_ids), args.chunk)])
        ref = filters_from(ref_q, len(ref_ids), n_kv)
        mx.eval(ref)
        del ref_q
        if args.reference_file:
            file_ref, file_meta = load_filters(args.reference_file, model)
            file_arm = (f"file {int(file_meta['calibration_tokens'])}", file_ref)
        args.reference_file = ""
        ref_source = f"pydoc_data.topics (sorted, joined) chars {start}.. (disjoint span)"
    elif args.reference_file:
        from qfilters_mlx.filters.calibration import load_filters

        ref, ref_meta = load_filters(args.reference_file, model)
        assert ref_meta["calibration_text"] == source, "the reference is from another text"
    nested = not (ref_meta or args.reference_disjoint)
    ids = encode_quietly(tokenizer, text)[: args.reference if nested else args.tokens]
    results = {"model": "SmolLM2-135M-Instruct", "calibration_text": source, "chunk": args.chunk,
               "reference_tokens": (int(ref_meta["calibration_tokens"]) if ref_meta else
                                    args.reference_disjoint or len(ids)),
               "reference_file": args.reference_file or None,
               "reference_text": ref_source if args.reference_disjoint else source}
    if args.reference_disjoint:
        results["reference_forward_seconds"] = ref_seconds
    out = Path(args.out)

    def save():
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))

    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    queries, seconds = capture_queries(model, chunks)
    results["forward_seconds_per_chunk"] = seconds
    if nested:
        ref = filters_from(queries, len(ids), n_kv)
    arms = {}
    for n in PREFIXES:
        if n <= len(ids):
            tic = time.perf_counter()
            arms[f"text {n}"] = filters_from(queries, n, n_kv)
            mx.eval(arms[f"text {n}"])
            results.setdefault("svd_seconds", {})[str(n)] = time.perf_counter() - tic
    del queries
    vocab = model.model.embed_tokens.weight.shape[0] if hasattr(model, "model") else None
    rng = np.random.default_rng(0)
    others = {f"random ids {args.other}": rng.integers(0, vocab, args.other).tolist()}
    tic = time.perf_counter()
    others[f"self-sampled {args.other}"] = sampled_ids(model, args.other, vocab, 0)
    results["self_sampling_seconds"] = time.perf_counter() - tic
    for name, toks in others.items():
        q, _ = capture_queries(model, [toks])
        arms[name] = filters_from(q, len(toks), n_kv)
    if file_arm is not None:
        arms[file_arm[0]] = file_arm[1]
    results["cosine_to_reference"] = {k: cosines(f, ref) for k, f in arms.items()}
    save()
    print(json.dumps(results["cosine_to_reference"], indent=1), flush=True)
    if not args.skip_ppl:
        from qfilters_mlx.cache.kv_cache import QFiltersKVCache
        from qfilters_mlx.config import KVCacheConfig
        from qfilters_mlx.evaluation.perplexity import batched_streaming_nll, perplexity

        eval_ids = tokenizer.encode(source_text(), add_special_tokens=False)[:128 + args.scored]
        ref_name = f"reference {results['reference_tokens']}"
        arms[ref_name] = ref
        names = [k for k in arms if not k.startswith("text ") or int(k.split()[1]) in PPL_PREFIXES]
        cfg = KVCacheConfig(qfilters_budget=args.budget, qfilters_filter_source="keys",
                            qfilters_sign=1, head_dim=64)
        rows = [[QFiltersKVCache(cfg, layer_idx=i, filters=arms[k][i]) for i in range(n_layers)]
                for k in names]
        tic = time.perf_counter()
        nll = batched_streaming_nll(model, eval_ids, rows, prefix=128)
        results["ppl_seconds"] = time.perf_counter() - tic
        results["perplexity"] = {"budget": args.budget, "n_sink": 4, "recent": cfg.qfilters_recent,
                                 "prefix": 128, "scored": args.scored,
                                 "arms": {k: perplexity(v) for k, v in zip(names, nll)}}
        save()
    lines = ["| filters from | cosine mean | median | min | share > 0.95 |" +
             (" ppl @256 |" if "perplexity" in results else ""), "|---|---|---|---|---|" +
             ("---|" if "perplexity" in results else "")]
    for k, c in results["cosine_to_reference"].items():
        p = results.get("perplexity", {}).get("arms", {}).get(k)
        lines.append(f"| {k} | {c['mean']:.4f} | {c['median']:.4f} | {c['min']:.4f} | "
                     f"{c['share_above_0.95']:.2f} |" + (f" {p:.3f} |" if p is not None else
                                                        (" |" if "perplexity" in results else "")))
    if "perplexity" in results:
        k = f"reference {results['reference_tokens']}"
        lines.append(f"| {k} | 1 | 1 | 1 | 1.00 | {results['perplexity']['arms'][k]:.3f} |")
    head = (f"# Calibration tokens (SmolLM2-135M-Instruct)\n\nCosine per (layer, KV head) to filters "
            f"from {results['reference_tokens']} tokens of {results['reference_text']} (chunks of "
            f"{args.chunk}; {args.reference_file or 'captured here'}); prefixes from {source}; perplexity: streaming, "
            f"budget {args.budget}, 4 sinks, recent {args.budget // 2}, {args.scored} scored tokens "
            f"of the evaluation text. Forward seconds per {args.chunk}-token chunk: "
            f"{', '.join(f'{s:.1f}' for s in seconds)}; filters (QR + SVD per layer) seconds: "
            f"{json.dumps({k: round(v, 3) for k, v in results['svd_seconds'].items()})}.\n\n"
            f"`python bench/bench_calibration_tokens.py"
            f"{f' --reference-disjoint {args.reference_disjoint}' if args.reference_disjoint else ''}`\n\n")
    out.with_suffix(".md").write_text(head + "\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
