"""Pass-key retrieval in the two protocols of KV-cache compression, at fractions kept.

* **streaming** (this package's default mode): the whole prompt (context, then the
  question) is fed in ``chunk``-token calls and each row's cache evicts down to
  ``budget = int(prompt_tokens * kept)`` after every call (n_sink 4, recent budget/2,
  the library's defaults; StreamingLLM 4 sinks + the rest recent); the question and the
  answer go through eviction.
* **compress_once** (kvpress's pipeline, the paper's experiments): the context is
  prefilled once with a full cache, then each row's cache is compressed once to
  ``int(context_tokens * kept)`` tokens (``compression_ratio = 1 - kept``; kvpress's
  settings: no sinks or window for the scored presses, 4 sinks for StreamingLLM),
  then the question and the answer are appended without eviction.

The context/question split is that of kvpress: the chat text is cut before
``"Question: "`` and both protocols feed the same tokens (context ++ question). The
full cache answers once (plain mlx-lm ``KVCache``); its answer stands for both.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable

import mlx.core as mx

from qfilters_mlx.evaluation.multi_arm import batch_caches
from qfilters_mlx.evaluation.retrieval import batched_greedy, greedy_tokens, pass_key, retrieval_chat

__all__ = ["ProtocolSettings", "protocol_arms", "protocols_markdown", "run_protocols", "split_chat"]


@dataclass(frozen=True)
class ProtocolSettings:
    """Sizes of the two-protocol retrieval run."""

    contexts: tuple = (1024,)
    depths: tuple = (0.1, 0.5, 0.9)
    kept: tuple = (0.25, 0.125)
    answer_tokens: int = 16
    chunk: int = 128
    text_offset: int = 200_000
    seed: int = 0
    backend: str = "auto"

    @classmethod
    def quick(cls) -> "ProtocolSettings":
        return cls(contexts=(256,), depths=(0.5,), kept=(0.25,), answer_tokens=12, chunk=32)

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))


def split_chat(tokenizer, chat: str) -> tuple[list[int], list[int]]:
    """``(context tokens, question tokens)``: ``chat`` cut before its last ``"Question: "``."""
    cut = chat.rindex("Question: ")
    return (tokenizer.encode(chat[:cut], add_special_tokens=False),
            tokenizer.encode(chat[cut:], add_special_tokens=False))


def protocol_arms(filters=None) -> list[tuple[str, str, object]]:
    """``(name, method, per-layer filters or None)``: Q-Filters (the calibrated filters, when
    given), L2Norm, StreamingLLM."""
    arms = [("l2norm", "l2norm", None), ("streaming_llm", "streaming_llm", None)]
    if filters is not None:
        arms.insert(0, ("qfilters-calibrated", "qfilters", filters))
    return arms


def _config(method: str, protocol: str, kept: float, tokens: int, head_dim: int):
    from qfilters_mlx.config import CompressOnce, KVCacheConfig

    if protocol == "streaming":
        return KVCacheConfig(method=method, head_dim=head_dim, qfilters_budget=max(8, int(tokens * kept)),
                             qfilters_filter_source="keys", qfilters_sign=1)
    return KVCacheConfig(method=method, head_dim=head_dim,
                         mode=CompressOnce(ratio=1.0 - kept, at="manual"),
                         qfilters_n_sink=4 if method == "streaming_llm" else 0,
                         qfilters_filter_source="keys", qfilters_sign=1)


def _row(method, filters, config, n_layers, backend: str):
    from qfilters_mlx.cache.kv_cache import QFiltersKVCache

    return [QFiltersKVCache(config, layer_idx=i, filters=None if filters is None else filters[i],
                            backend=backend) for i in range(n_layers)]


def _continue_greedy(model, caches, tokens: list[int], rows: int, max_tokens: int) -> list[list[int]]:
    """Feed ``tokens`` to every row in one call, then ``max_tokens`` greedy tokens per row."""
    logits = model(mx.broadcast_to(mx.array(tokens)[None], (rows, len(tokens))), cache=caches)[:, -1]
    return greedy_tokens(model, caches, logits, max_tokens)


def run_protocols(model, tokenizer, text: str, settings: ProtocolSettings, results: dict, filters=None,
                  save: Callable[[dict], None] = lambda r: None,
                  progress: Callable[[str], None] = lambda d: None) -> dict:
    """Fill ``results["protocols"]`` (resumable: finished prompts are skipped).

    Cells: ``"{protocol}/{arm}@{kept}@{context}@{depth}"`` and ``"full@{context}@{depth}"``,
    each with the answer and whether it holds the key.

    Raises:
        ValueError: ``results["protocols"]`` was produced with other settings.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from qfilters_mlx.cache.compression import compress_caches
    from qfilters_mlx.model_info import model_head_dim

    s = settings
    out = results.setdefault("protocols", {})
    if out.get("settings") not in (None, s.to_json()):
        raise ValueError("protocol results were produced with different settings; use a new file")
    out["settings"] = s.to_json()
    cells = out.setdefault("cells", {})
    n_layers, hd = len(model.layers), model_head_dim(model)
    arms = protocol_arms(filters)
    r_text = text[s.text_offset:]
    for ctx in s.contexts:
        for depth in s.depths:
            if f"full@{ctx}@{depth}" in cells:
                continue
            key = pass_key(s.seed, ctx, depth)
            context, question = split_chat(tokenizer, retrieval_chat(tokenizer, r_text, ctx, depth, key))
            prompt = context + question
            base = {"context": ctx, "depth": depth, "key": key, "context_tokens": len(context),
                    "question_tokens": len(question)}

            def record(name, extra, ids):
                answer = tokenizer.decode(ids)
                cells[name] = {**extra, **base, "answer": answer, "correct": key in answer}

            # compress-once: one full prefill of the context, shared by every row
            progress(f"compress_once {ctx}@{depth}")
            full = make_prompt_cache(model)
            for i in range(0, len(context), s.chunk):
                model(mx.array(context[i:i + s.chunk])[None], cache=full)
                mx.eval([(c.keys, c.values) for c in full])
            kv = [(c.keys[:, :, :c.offset], c.values[:, :, :c.offset]) for c in full]
            mx.eval(kv)
            rows, names = [], []
            for name, method, f in arms:
                for kept in s.kept:
                    row = _row(method, f, _config(method, "compress_once", kept, len(context), hd),
                               n_layers, s.backend)
                    for c, (k, v) in zip(row, kv):
                        c.update_and_fetch(k, v)
                    compress_caches(row)
                    rows.append(row)
                    names.append((name, method, kept, row[0].size()))
            answers = _continue_greedy(model, batch_caches(rows), question, len(rows), s.answer_tokens)
            for (name, method, kept, size), ids in zip(names, answers):
                record(f"compress_once/{name}@{kept}@{ctx}@{depth}",
                       {"protocol": "compress_once", "arm": name, "method": method, "kept": kept,
                        "cache_after_compression": size}, ids)
            ids = _continue_greedy(model, full, question, 1, s.answer_tokens)[0]
            # streaming: every row evicts after each call of the whole prompt
            progress(f"streaming {ctx}@{depth}")
            rows, names = [], []
            for name, method, f in arms:
                for kept in s.kept:
                    cfg = _config(method, "streaming", kept, len(prompt), hd)
                    rows.append(_row(method, f, cfg, n_layers, s.backend))
                    names.append((name, method, kept, cfg.qfilters_budget))
            answers = batched_greedy(model, prompt, rows, s.answer_tokens, s.chunk)
            for (name, method, kept, budget), a in zip(names, answers):
                record(f"streaming/{name}@{kept}@{ctx}@{depth}",
                       {"protocol": "streaming", "arm": name, "method": method, "kept": kept,
                        "budget": budget}, a)
            record(f"full@{ctx}@{depth}", {"protocol": "both", "arm": "full", "method": "full"}, ids)
            save(results)
    return results


def protocols_markdown(results: dict) -> str:
    """The two-protocol retrieval table (correct / prompts per protocol, arm and fraction kept)."""
    p = results.get("protocols", {})
    cells, s = p.get("cells", {}), p.get("settings")
    if not cells or s is None:
        return ""
    n = sum(1 for c in cells.values() if c["arm"] == "full")
    lines = [f"### Pass-key retrieval in two protocols ({n} prompts: contexts {s['contexts']} tokens, "
             f"depths {s['depths']}; greedy {s['answer_tokens']} tokens)", "",
             "streaming: the prompt (context + question) fed in "
             f"{s['chunk']}-token calls, each row evicting to int(prompt tokens x kept) after every "
             "call (n_sink 4, recent budget/2; StreamingLLM 4 sinks + recent). compress_once: the "
             "context prefilled, compressed once to int(context tokens x kept) (kvpress's rule, "
             "compression_ratio = 1 - kept; no sinks/window, StreamingLLM 4 sinks), the question "
             "and answer appended. Cells: correct / prompts.", ""]
    full = [c for c in cells.values() if c["arm"] == "full"]
    head = [f"{proto} {100 * k:g}% kept" for proto in ("streaming", "compress_once") for k in s["kept"]]
    lines += ["| arm | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    ok = f"{sum(c['correct'] for c in full)}/{len(full)}"
    lines.append("| full | " + " | ".join([ok] * len(head)) + " |")
    arms = []
    for c in cells.values():
        if c["arm"] != "full" and c["arm"] not in arms:
            arms.append(c["arm"])
    for a in arms:
        row = []
        for proto in ("streaming", "compress_once"):
            for k in s["kept"]:
                cs = [c for c in cells.values() if c["arm"] == a and c.get("protocol") == proto
                      and c["kept"] == k]
                row.append(f"{sum(c['correct'] for c in cs)}/{len(cs)}" if cs else "n/a")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines + [""])
