"""Conversations across a restart: ``qfilters-mlx server --prompt-cache-dir`` against computing
again (ours without the folder, and ``mlx_lm.server``, which keeps no prompt cache across a
restart).

Servers run SmolLM2-135M-Instruct (float32) on 127.0.0.1 as subprocesses (OpenBLAS preloaded for
all). Ours: its defaults (budget 256) with the calibrated query filter of
``bench/results/smollm2_filters.safetensors``; the anchor: ``mlx_lm.server``'s defaults (full
``KVCache``). Requests are greedy, the end-of-turn token banned (each answer is exactly its
``max_tokens``).

**Restart.** Per prompt length L (2,048 and 7,680 tokens: SmolLM2's context is 8,192, so no
32k) and arm, ``--reps`` times: a fresh server (a fresh folder for ``disk``) answers a turn (a
span of CPython's documentation, ``pydoc_data``, then a question; 16 tokens), the server is
stopped (SIGTERM, or SIGKILL with ``--kill``) and started again, answers a short unrelated
request (so that every arm has paid its first request's costs), and a follow-up turn (the turn,
its answer and a new question) is sent, streamed: time to first token (first content chunk),
``cached_tokens``, and the answer (16 tokens). Arms: ``disk`` (ours with a folder), ``ram``
(ours with a folder, follow-up without the restart: the answer a restart must not change),
``recompute`` (ours without a folder) and ``mlx_lm``. Per ``disk`` run the folder's bytes after
the turn, against the bytes of the budget's K/V rows (``budget x layers x KV heads x head_dim x
2 x 4`` bytes) and of a full cache of the same tokens.

**Soak** (``--soak N``): one folder, ``N`` short conversations (a ~150-token question, 8-token
answers, ``--prompt-cache-size 8`` so that most leave memory), the server restarted every
``--soak-every`` conversations; after each restart a follow-up of ``--probes`` earlier
conversations (spread over all so far) must reuse its stored conversation (``cached_tokens`` at
least the turn's prompt: a prompt checkpoint holds one token less, so only the stored answer
reaches it), ``/health``'s usable files must equal the conversations, and the
files' bytes must stay within ``--prompt-cache-disk-bytes`` (checked after every restart with
``du`` of the folder). Then one more server with a bound of a fifth of what the files take: bytes
within it after every request of another ``--soak-every`` conversations.

Writes ``bench/results/server_restart.json`` and ``.md``. Run from the repository root:
``python bench/bench_server_restart.py`` (``--help`` for the sizes).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_server_memory import EOT, FILTERS, Texts, _env, _ids  # noqa: E402
from helpers.server_corpus import CHAT, ServerProcess, get_json  # noqa: E402

import common  # noqa: E402  (fast BLAS; run metadata)

ARMS = ("disk", "ram", "recompute", "mlx_lm")
ANSWER = 16
QUESTION = " Summarize the text above."
FOLLOW = "Which module does the text describe first? Answer in one sentence."


def argv(arm: str, model: Path, folder: Path | None, *extra) -> list[str]:
    if arm == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), *extra]
    flags = ["--prompt-cache-dir", str(folder)] if folder is not None else []
    return [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", "--model", str(model),
            "--filters", str(FILTERS), *flags, *extra]


def stream(port, messages, max_tokens) -> dict:
    """A streamed greedy chat request: ``ttft_s`` (first content chunk), ``answer``, ``reused``
    (``cached_tokens``), ``prompt_tokens``."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {str(EOT): -100}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    start = time.perf_counter()
    conn.request("POST", CHAT, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, text, usage = None, [], None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(piece)
    conn.close()
    usage = usage or {}
    return {"ttft_s": ttft, "answer": "".join(text), "prompt_tokens": usage.get("prompt_tokens"),
            "reused": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _cache_bytes(model_path: Path, tokens: int) -> int:
    """Bytes of ``tokens`` K/V rows over all layers (float32)."""
    cfg = json.loads((model_path / "config.json").read_text())
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return tokens * cfg["num_hidden_layers"] * kv * d * 2 * 4


def restart_run(arm, model, text, log_dir, tag, kill) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="qf-restart-")) / "conversations" if arm in ("disk", "ram") else None
    start = lambda t: ServerProcess(argv(arm, model, folder), log_dir / f"{arm}-{tag}-{t}.log",  # noqa: E731
                                    env=_env(), start_timeout=600)
    first = [{"role": "user", "content": text + QUESTION}]
    server = start("a")
    try:
        turn = stream(server.port, first, ANSWER)
        out = {"prompt_tokens": turn["prompt_tokens"], "first_answer": turn["answer"]}
        if folder is not None:
            time.sleep(1.0)  # (the answer's file is written right after its reply)
            out["disk_bytes"] = _du(folder)
        if arm != "ram":
            if kill:
                server.proc.kill()
            server.stop()
            server = start("b")
        stream(server.port, [{"role": "user", "content": "Hello."}], 2)  # (first-request costs)
        follow = first + [{"role": "assistant", "content": turn["answer"]},
                          {"role": "user", "content": FOLLOW}]
        out.update({f"follow_{k}": v for k, v in stream(server.port, follow, ANSWER).items()})
        if folder is not None:
            _, h = get_json(server.port, "/health")
            out["disk"] = ((h.get("stored") or {}).get("disk"))
    finally:
        server.stop()
        if folder is not None:
            shutil.rmtree(folder.parent, ignore_errors=True)
    return out


SOAK_TOKENS = 140


def _soak_messages(texts, i) -> list[dict]:
    """Conversation ``i``'s question: a span of the text, taken in turn and around again when the
    text runs out (its number first, so no two conversations share more than a few tokens)."""
    ids = texts.ids
    at = (i * SOAK_TOKENS) % (len(ids) - SOAK_TOKENS)
    span = texts.tokenizer.decode(ids[at:at + SOAK_TOKENS])
    return [{"role": "user", "content": f"Note {i}. " + span + " What is this about?"}]


def _ask(port, messages, max_tokens=8) -> dict:
    return stream(port, messages, max_tokens)


def soak(model, texts, n, every, probes, log_dir, kill) -> dict:
    """The soak of the module docstring; returns its checks per restart."""
    folder = Path(tempfile.mkdtemp(prefix="qf-soak-")) / "conversations"
    limit = 40 * 10**9
    extra = ("--prompt-cache-size", "8", "--prompt-cache-disk-bytes", str(limit))
    start = lambda t, *x: ServerProcess(argv("disk", model, folder, *(x or extra)),  # noqa: E731
                                        log_dir / f"soak-{t}.log", env=_env(), start_timeout=600)
    convs, rounds, errors = [], [], 0
    t0 = time.perf_counter()
    server = None
    try:
        server = start(0)
        for i in range(n):
            msgs = _soak_messages(texts, i)
            try:
                r = _ask(server.port, msgs)
                convs.append((msgs, r["answer"], r["prompt_tokens"]))
            except RuntimeError:
                errors += 1
            if (i + 1) % every == 0 or i + 1 == n:
                time.sleep(0.5)
                if kill and (i + 1) // every % 2:
                    server.proc.kill()  # (every other restart a crash)
                server.stop()
                server = start(i + 1)
                _, h = get_json(server.port, "/health")
                disk = (h.get("stored") or {}).get("disk") or {}
                picks = sorted({round(k * (len(convs) - 1) / max(probes - 1, 1)) for k in range(probes)})
                ok = 0
                for k in picks:
                    msgs, ans, ptoks = convs[k]
                    follow = msgs + [{"role": "assistant", "content": ans},
                                     {"role": "user", "content": "And in one word?"}]
                    f = _ask(server.port, follow, 4)
                    ok += f["reused"] >= ptoks  # (the turn's prompt at least: its answer too, below)
                    convs[k] = (follow, f["answer"], f["prompt_tokens"])
                rounds.append({"conversations": i + 1, "usable_files": disk.get("usable"),
                               "files": disk.get("files"), "bytes": _du(folder), "limit": limit,
                               "probes": len(picks), "probes_reused": ok,
                               "elapsed_s": round(time.perf_counter() - t0, 1)})
                print(f"soak: {rounds[-1]}", flush=True)
        server.stop()
        total = _du(folder)
        small = max(total // 5, 1)
        server = start("bounded", "--prompt-cache-size", "8", "--prompt-cache-disk-bytes", str(small))
        over = 0
        for i in range(every):
            _ask(server.port, _soak_messages(texts, n + i))
            time.sleep(0.2)
            over += _du(folder) > small
        _, h = get_json(server.port, "/health")
        d = (h.get("stored") or {}).get("disk") or {}
        write_s = round(d["write_s"] / d["writes"], 4) if d.get("writes") else None
        bounded = {"limit": small, "bytes": _du(folder), "checks": every, "over_limit": over,
                   "disk": (h.get("stored") or {}).get("disk")}
        server.stop()
    finally:
        if server is not None:
            server.stop()  # (also when a request failed: no server outlives the benchmark)
        shutil.rmtree(folder.parent, ignore_errors=True)
    return {"conversations": n, "every": every, "errors": errors, "rounds": rounds, "bounded": bounded,
            "write_s_per_file": write_s}


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def markdown(res) -> str:
    lines = ["# Conversations across a restart: `--prompt-cache-dir`", "",
             f"{res['meta']['machine']}; code {res['meta']['code']['git_head']} (sources {res['meta']['code']['package_sources_sha1']}). "
             f"Command: `{res['command']}`. Median of {res['reps']} runs per cell; "
             f"restart by {'SIGKILL' if res['kill'] else 'SIGTERM'}.", ""]
    hdr = ["prompt", "arm", "TTFT of the follow-up (s)", "vs mlx_lm", "cached tokens",
           "answer as without restart", "disk bytes", "/ budget rows", "/ full cache"]
    rows = []
    for L, cell in res["restart"].items():
        ref = _median([r["follow_ttft_s"] for r in cell.get("mlx_lm", [])])
        same_as = [r["follow_answer"] for r in cell.get("ram", [])]
        for arm in ARMS:
            runs = cell.get(arm, [])
            if not runs:
                continue
            t = _median([r["follow_ttft_s"] for r in runs])
            disk = _median([r.get("disk_bytes") for r in runs])
            same = (sum(r["follow_answer"] == a for r, a in zip(runs, same_as))  # (rep by rep:
                    if len(same_as) == len(runs) else None)  # each repetition has its own text)
            rows.append([L, arm, f"{t:.3f}", f"{t / ref:.3f}" if ref else "",
                         "/".join(str(r["follow_reused"]) for r in runs),
                         f"{same}/{len(runs)}" if same is not None and arm != "mlx_lm" else "",
                         f"{disk / 1e6:.2f} MB" if disk else "",
                         f"{disk / res['budget_bytes']:.2f}" if disk else "",
                         f"{disk / common_full(res, runs):.3f}" if disk else ""])
    lines += common.md_table(hdr, rows)
    if res.get("soak"):
        s = res["soak"]
        how = " (every other one by SIGKILL)" if s.get("kill", res["kill"]) else ""
        lines += ["", f"## Soak: {s['conversations']} conversations, a restart every {s['every']}{how}", "",
                  f"Command: `{res.get('soak_command', res['command'])}`. Errors: {s['errors']}. Seconds per "
                  f"file written (the last server's): {s.get('write_s_per_file', '?')}.", ""]
        lines += common.md_table(["after conversations", "usable files", "every one on disk", "files", "bytes",
                                  "limit", "follow-ups reusing their conversation"],
                                 [[r["conversations"], r["usable_files"],
                                   "yes" if r["usable_files"] == r["conversations"] else "no", r["files"],
                                   r["bytes"], r["limit"], f"{r['probes_reused']}/{r['probes']}"]
                                  for r in s["rounds"]])
        b = s["bounded"]
        lines += ["", f"Bounded to {b['limit']} bytes: {b['bytes']} bytes at the end, over the bound "
                      f"after {b['over_limit']} of {b['checks']} requests."]
    return "\n".join(lines) + "\n"


def common_full(res, runs) -> float:
    return _cache_bytes(Path(res["model_path"]), _median([r["prompt_tokens"] + ANSWER for r in runs]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=common.int_list, default=[2048, 7680])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kill", action="store_true", help="restart by SIGKILL (a crash)")
    ap.add_argument("--soak", type=int, default=0, metavar="N")
    ap.add_argument("--soak-every", type=int, default=100)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--merge", type=Path, nargs=2, default=None, metavar="JSON",
                   help="only write --out: the restart runs of the first file, the soak of the second")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "server_restart.json")
    args = ap.parse_args()
    if args.merge:
        res = json.loads(args.merge[0].read_text())
        soaked = json.loads(args.merge[1].read_text())
        res["soak"], res["soak_command"] = soaked["soak"], soaked["command"]
        res["soak"]["kill"] = soaked["kill"]
        for p in common.write_results(args.out, res, markdown(res)):
            print("wrote", p)
        return
    from mlx_lm.utils import load_tokenizer

    from qfilters_mlx.assets.prepare_model import prepare_model

    model = prepare_model()
    tokenizer = load_tokenizer(model)
    texts = Texts(tokenizer)
    log_dir = Path(tempfile.mkdtemp(prefix="qf-restart-logs-"))
    arms = [a for a in args.arms.split(",") if a]
    res = {"meta": common.run_meta(), "command": "python bench/bench_server_restart.py " + " ".join(sys.argv[1:]),
           "reps": args.reps, "kill": args.kill, "model_path": str(model), "restart": {}}
    cfg = json.loads((model / "config.json").read_text())
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    res["budget_bytes"] = 256 * cfg["num_hidden_layers"] * kv * d * 2 * 4
    for L in args.lengths if args.restart else []:
        cell = res["restart"].setdefault(str(L), {})
        for rep in range(args.reps):
            text = texts.prompt_text(L)  # (one prompt per repetition, the same for every arm)
            for arm in arms:  # (interleaved: the machine's load falls on every arm alike)
                r = restart_run(arm, model, text, log_dir, f"{L}-{rep}", args.kill)
                cell.setdefault(arm, []).append(r)
                print(f"{L} {arm} rep {rep}: ttft {r['follow_ttft_s']:.3f} s, reused "
                      f"{r['follow_reused']}/{r['follow_prompt_tokens']}", flush=True)
    if args.soak:
        res["soak"] = soak(model, texts, args.soak, args.soak_every, args.probes, log_dir, args.kill)
    for p in common.write_results(args.out, res, markdown(res)):
        print("wrote", p)
    print("logs in", log_dir)


if __name__ == "__main__":
    main()
