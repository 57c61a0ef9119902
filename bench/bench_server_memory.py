"""Memory and prompt reuse of ``qfilters-mlx server`` against ``mlx_lm.server``, per conversation.

Both servers run SmolLM2-135M-Instruct (float32) on 127.0.0.1 as subprocesses (OpenBLAS
preloaded for both), ``--prompt-cache-size 64`` (every conversation stays stored). Ours runs
with its defaults and ``--budget B`` (the calibrated query filter of
``bench/results/smollm2_filters.safetensors``, so that no start calibrates); the anchor keeps
mlx-lm's full ``KVCache``.

Per prompt length L (tokens of the whole chat prompt) and server, on one fresh server:

1. **memory**: N distinct conversations (a system prompt, then one user message: a span of
   CPython's documentation, ``pydoc_data``, and "Summarize the text above."), 16 tokens
   answered greedily, sent one after another; after each: the server's RSS and ``/health``
   (ours: stored bytes as held at rest, the process's MLX active bytes).
2. **reuse** (``usage.prompt_tokens_details.cached_tokens``): the first conversation again
   (a regenerated answer), a follow-up turn of it, a new conversation under the same system
   prompt, and the first conversation with its last sentence edited (diverging a few tokens
   before the prompt's end).

The growth per conversation is ``(RSS after N - RSS after 1) / (N - 1)``, and the
least-squares slope of RSS over the N conversations beside it (RSS moves with MLX's buffer
cache by tens of MB between requests). Ours: ``/health`` is read once the answer is stored;
the stored bytes and MLX's active bytes per conversation are their growth from after the
warm-up request to after the last conversation, divided by N. The bound a stored
conversation is checked against: ``budget + 1 + max_rewind`` rows per layer (kept rows, the
decode slot, the rewind journal), twice when the answer is longer than the rewind depth.

Writes ``bench/results/server_memory.json`` and ``.md``. Run from the repository root:
``python bench/bench_server_memory.py`` (``--help`` for the sizes; ``--lengths 2048`` alone
takes a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.server_corpus import CHAT, ServerProcess, answer, get_json, post_json  # noqa: E402

import common  # noqa: E402  (fast BLAS; run metadata)

FILTERS = ROOT / "bench" / "results" / "smollm2_filters.safetensors"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
SYSTEM = "You are a careful assistant. Answer in one or two sentences."
ASK = " Summarize the text above."
MAX_TOKENS = 16
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
MAX_REWIND = 64  # the server's default --max-rewind


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def argv(arm: str, model: Path, budget: int | None) -> list[str]:
    common_flags = ["--model", str(model), "--prompt-cache-size", "64"]
    if arm == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm", "server", *common_flags]
    return [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", *common_flags,
            "--budget", str(budget), "--filters", str(FILTERS)]


def texts(tokenizer, length: int, n: int) -> list[str]:
    """``n`` disjoint spans of CPython's documentation, each making a chat prompt of about
    ``length`` tokens with :data:`SYSTEM` and :data:`ASK`."""
    from qfilters_mlx.assets.prompts import source_text

    ids = tokenizer.encode(source_text(), add_special_tokens=False)
    over = len(_ids(tokenizer, ""))
    span = length - over
    if (n + 1) * span > len(ids):
        raise ValueError(f"{n} spans of {span} tokens need more text than pydoc_data has")
    return [tokenizer.decode(ids[i * span:(i + 1) * span]) for i in range(n + 1)]


def _messages(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text + ASK}]


def _ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(_messages(text), add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


def _ask(port, messages) -> dict:
    status, reply = post_json(port, CHAT, {"messages": messages, "max_tokens": MAX_TOKENS,
                                            "temperature": 0.0}, timeout=1800)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {reply}")
    usage = reply["usage"]
    return {"prompt_tokens": usage["prompt_tokens"], "answer": answer(reply),
            "reused": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def _settled(port, arm, answers, timeout=120.0) -> dict | None:
    """``/health``'s ``stored`` once ``answers`` answers are stored (the generation loop stores
    a finished request's cache right after its reply); ``None`` for the anchor (no such
    field)."""
    if arm == "mlx_lm":
        return None
    deadline = time.time() + timeout
    while True:
        _, h = get_json(port, "/health")
        stored = h.get("stored") or {}
        if stored.get("conversations", -1) >= answers or time.time() > deadline:
            return stored
        time.sleep(0.2)


def run_server(arm, model, budget, spans, log_dir, tag) -> dict:
    server = ServerProcess(argv(arm, model, budget), log_dir / f"{arm}-{tag}.log", env=_env(),
                           start_timeout=600)
    out = {"arm": arm, "budget": budget, "conversations": []}
    try:
        _ask(server.port, [{"role": "user", "content": "Hello."}])  # (warm-up, stored too)
        out["health_start"] = _settled(server.port, arm, 1)
        out["rss_start_mb"] = server.rss_mb()
        first = None
        for i, text in enumerate(spans[:-1]):
            r = _ask(server.port, _messages(text))
            first = first or r
            stored = _settled(server.port, arm, i + 2)
            out["conversations"].append({**r, "rss_mb": server.rss_mb(), "stored": stored})
        msgs = _messages(spans[0])
        reuse = {"regenerated": _ask(server.port, msgs)}
        reuse["follow_up"] = _ask(server.port, msgs + [
            {"role": "assistant", "content": first["answer"]},
            {"role": "user", "content": "Which word of the text above is the longest?"}])
        reuse["same_system_prompt"] = _ask(server.port, _messages(spans[-1]))
        edited = spans[1][: -40] + " (edited)" + spans[1][-40:]
        reuse["edited_message"] = _ask(server.port, _messages(edited))
        out["reuse"] = reuse
        out["rss_end_mb"] = server.rss_mb()
        _, h = get_json(server.port, "/health")
        out["health_end"] = h.get("stored")
    finally:
        server.stop()
    rss = [c["rss_mb"] for c in out["conversations"]]
    n = len(rss)
    out["rss_growth_per_conversation_mb"] = (rss[-1] - rss[0]) / (n - 1) if n > 1 else None
    out["rss_per_conversation_from_start_mb"] = (rss[-1] - out["rss_start_mb"]) / n
    return out


def bound_bytes(budget: int) -> int:
    """Bytes one stored cache of SmolLM2 holds at most at rest: ``budget + 1 + max_rewind``
    rows per layer (K and V float32, a float32 score and an int64 position per row and KV
    head) plus the float32 filter ``[H_kv, D]`` per layer."""
    row = KV_HEADS * (2 * HEAD_DIM * 4 + 4 + 8)
    return LAYERS * ((budget + 1 + MAX_REWIND) * row + KV_HEADS * HEAD_DIM * 4)


def _slope(r) -> float | None:
    """Least-squares slope of RSS (MB) over the conversations stored (``None``: under two)."""
    import numpy as np

    if not r or len(r["conversations"]) < 2:
        return None
    y = np.array([c["rss_mb"] for c in r["conversations"]])
    return float(np.polyfit(np.arange(len(y)), y, 1)[0])


def markdown(res) -> str:
    lines = [f"# `qfilters-mlx server` vs `mlx_lm.server`: memory and reuse per conversation "
             f"(SmolLM2-135M float32)", "",
             f"Machine: {res['meta']['machine']}; runs (load average at start): "
             + "; ".join(f"`{r['command']}` ({r['meta']['loadavg_start'][0]:.1f})"
                         for r in res.get("runs", [res])) + ". "
             f"{MAX_TOKENS} tokens answered per request (greedy). Ours: its defaults "
             f"(`--max-rewind {MAX_REWIND}`, `--prefill-step-size 2048`) and `--budget B`; "
             "the anchor: `mlx_lm.server` (full `KVCache`). Both `--prompt-cache-size 64`.", ""]
    rows = []
    for L, arms in res["lengths"].items():
        anchor = arms.get("mlx_lm", {}).get("rss_growth_per_conversation_mb")
        for key, r in arms.items():
            g = r["rss_growth_per_conversation_mb"]
            st = r.get("health_end") or {}
            per = active = None
            if r["conversations"][-1]["stored"]:
                a, b = r["health_start"], r["conversations"][-1]["stored"]
                n = len(r["conversations"])
                per = (b["bytes"] - a["bytes"]) / n  # (the warm-up's entry left out)
                active = (b["process"]["active_bytes"] - a["process"]["active_bytes"]) / n
            bound = bound_bytes(r["budget"]) if r["budget"] else None
            rss = " / ".join(f"{c['rss_mb']:,.0f}" for c in r["conversations"])
            fit, fit_anchor = _slope(r), _slope(arms.get("mlx_lm"))
            rows.append([L, key, len(r["conversations"]), rss, f"{g:,.1f}" if g is not None else "-",
                         f"{g / anchor:.2f}" if g is not None and anchor else "-",
                         f"{fit:,.1f} ({fit / fit_anchor:.2f})" if fit is not None and fit_anchor else "-",
                         f"{per / 1e6:,.2f}" if per is not None else "-",
                         f"{per / bound:.2f}" if per is not None and bound else "-",
                         f"{active / 1e6:,.2f}" if active is not None else "-"])
    lines += common.md_table(["prompt tokens", "server", "conversations", "RSS after each (MB)",
                              "growth per conversation (MB)", "vs anchor",
                              "least-squares slope (MB; vs anchor)",
                              "/health stored per conversation (MB)", "vs budget + journal bound",
                              "MLX active growth per conversation (MB)"], rows, "rlrlrrrrrr")
    lines += ["", "Reuse (tokens of the prompt served from a stored cache, `cached_tokens`; "
              "prompt tokens in brackets):", ""]
    rows = []
    for L, arms in res["lengths"].items():
        for key, r in arms.items():
            u = r["reuse"]
            rows.append([L, key] + [f"{u[k]['reused']:,} ({u[k]['prompt_tokens']:,})" for k in
                                    ("regenerated", "follow_up", "same_system_prompt", "edited_message")])
    lines += common.md_table(["prompt tokens", "server", "regenerated answer", "follow-up turn",
                              "same system prompt", "edited last message"], rows, "rlrrrr")
    lines += ["", "A regenerated answer, a follow-up turn and a conversation under the same system "
              "prompt reuse what the anchor reuses; an edited message is recomputed from the "
              "nearest stored point below the edit (the system prompt's checkpoint) where the "
              "anchor trims its full cache back to the edit.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=common.int_list, default=[2048, 8000])
    p.add_argument("--budgets", type=common.int_list, default=[64, 256])
    p.add_argument("--conversations", type=int, default=4, help="per length up to 2,048 tokens")
    p.add_argument("--conversations-long", type=int, default=2, help="per longer length")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "server_memory.json")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/qfilters-server-memory"))
    p.add_argument("--resume", action="store_true",
                   help="keep the servers already measured in --out (same budgets and counts), "
                        "run the rest")
    args = p.parse_args()
    from mlx_lm.utils import load_tokenizer

    from qfilters_mlx.assets.prepare_model import prepare_model

    model = prepare_model()
    tokenizer = load_tokenizer(model)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    res = {"meta": common.run_meta(), "command": "python bench/bench_server_memory.py "
           + " ".join(a for a in sys.argv[1:] if a != "--resume"), "lengths": {}}
    if args.resume and args.out.exists():
        old = json.loads(args.out.read_text())
        res["lengths"] = old["lengths"]
        res["runs"] = old.get("runs", [{"command": old["command"], "meta": old["meta"]}])
    res.setdefault("runs", []).append({"command": res["command"], "meta": res["meta"]})
    for L in args.lengths:
        n = args.conversations if L <= 2048 else args.conversations_long
        spans = texts(tokenizer, L, n)
        arms = res["lengths"].setdefault(str(L), {})
        for arm, budget in [("mlx_lm", None)] + [("qfilters", b) for b in args.budgets]:
            key = arm if budget is None else f"qfilters@{budget}"
            if key in arms and len(arms[key]["conversations"]) == n:
                continue  # (--resume: measured before)
            print(f"L={L} {key}: {n} conversations", flush=True)
            arms[key] = run_server(arm, model, budget, spans, args.log_dir, f"{L}-{key}")
            common.write_results(args.out, res, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
