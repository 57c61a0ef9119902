"""Memory and prompt reuse of ``qfilters-mlx server`` against ``mlx_lm.server``, per conversation,
over the shapes chats take.

Both servers run SmolLM2-135M-Instruct (float32) on 127.0.0.1 as subprocesses (OpenBLAS
preloaded for both), ``--prompt-cache-size 64`` (every conversation stays stored). Ours runs
with its defaults (the default budget, 256) and the calibrated query filter of
``bench/results/smollm2_filters.safetensors`` (so that no start calibrates); the anchor keeps
mlx-lm's full ``KVCache``. Every request is greedy with the end-of-turn token banned
(``logit_bias`` -100), so each answer is exactly its ``max_tokens`` long.

**Matrix.** Per prompt length L (tokens of the chat prompt: 2,048 and 7,680, the longest that
leaves room for a 400-token answer in the model's 8,192) and answer length A (16, 100, 400
tokens), one fresh server per arm gets three groups of N conversations, one after another:
no system prompt, one system prompt shared by all, and a system prompt of each conversation's
own. A conversation is one user message (a span of CPython's documentation, ``pydoc_data``,
then "Summarize the text above."). After each: the server's RSS and (ours) ``/health``'s
stored bytes. A group's growth per conversation is (RSS after its last conversation - RSS
before its first) / N. Then reuse (``usage.prompt_tokens_details.cached_tokens``): the shared
group's first conversation again (a regenerated answer), a follow-up turn of it, and it with
its last sentence edited (diverging a few tokens before the prompt's end); reuse probes
answer 16 tokens.

**Shapes.** One more server per arm: N units of two follow-ups of one turn (a 2,048-token
turn answered in 100 tokens, then two different follow-up questions to it, one after the
other: the second's reuse against the anchor's), then N chats of 10 turns (each turn a
200-token span and a question, answered in 100 tokens).

Writes ``bench/results/server_memory.json`` and ``.md``. Run from the repository root:
``python bench/bench_server_memory.py`` (``--help``: lengths, answers, counts, ``--arms``;
``--resume`` keeps the servers already measured in ``--out``).
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
SYSTEMS = ("none", "shared", "own")
PROBE_TOKENS = 16
TURN_TOKENS = 200  # user text per turn of the 10-turn chat
EOT = 2  # SmolLM2's <|im_end|>: banned so that every answer is max_tokens long
RATIO_BAR, STORED_BAR_MB = 1 / 3, 30.0


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def argv(arm: str, model: Path) -> list[str]:
    common_flags = ["--model", str(model), "--prompt-cache-size", "64"]
    if arm == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm", "server", *common_flags]
    return [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", *common_flags,
            "--filters", str(FILTERS)]


def _system(kind: str, i: int) -> list[dict]:
    if kind == "none":
        return []
    own = f"Session {i}. " if kind == "own" else ""
    return [{"role": "system", "content": own + SYSTEM}]


def _messages(kind: str, i: int, text: str) -> list[dict]:
    return _system(kind, i) + [{"role": "user", "content": text + ASK}]


def _ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


class Texts:
    """Disjoint spans of CPython's documentation, handed out in order."""

    def __init__(self, tokenizer):
        from qfilters_mlx.assets.prompts import source_text

        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(source_text(), add_special_tokens=False)
        self.at = 0

    def span(self, tokens: int) -> str:
        if self.at + tokens > len(self.ids):
            raise ValueError("pydoc_data has no more text for these sizes")
        self.at += tokens
        return self.tokenizer.decode(self.ids[self.at - tokens:self.at])

    def prompt_text(self, length: int) -> str:
        """A user text making a chat prompt of about ``length`` tokens with the shared system."""
        over = len(_ids(self.tokenizer, _messages("shared", 0, "")))
        return self.span(length - over)


def _ask(port, messages, max_tokens) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "logit_bias": {str(EOT): -100}}
    status, reply = post_json(port, CHAT, body, timeout=3600)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {reply}")
    usage = reply["usage"]
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "answer": answer(reply), "reused": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def _settled(port, arm, answers, timeout=120.0) -> dict | None:
    """``/health``'s ``stored`` once the caches of at least ``answers`` requests were handed in
    (``requests``: the generation loop stores a finished request's cache right after its reply;
    a follow-up replaces its conversation's entry, so the count of conversations stays);
    ``None`` for the anchor."""
    if arm == "mlx_lm":
        return None
    deadline = time.time() + timeout
    while True:
        _, h = get_json(port, "/health")
        stored = h.get("stored") or {}
        if stored.get("requests", -1) >= answers or time.time() > deadline:
            return stored
        time.sleep(0.2)


class Run:
    """One server and its measurements (``out``): groups of conversations with RSS and stored
    bytes before and after each group."""

    def __init__(self, arm, model, log):
        self.arm = arm
        self.server = ServerProcess(argv(arm, model), log, env=_env(), start_timeout=900)
        self.answers = 0
        self.out = {"arm": arm, "groups": {}}
        self.ask([{"role": "user", "content": "Hello."}], 4)  # (warm-up, stored too)

    def ask(self, messages, max_tokens) -> dict:
        r = _ask(self.server.port, messages, max_tokens)
        self.answers += 1
        self.stored = _settled(self.server.port, self.arm, self.answers)
        return r

    def point(self) -> dict:
        s = self.stored or {}
        return {"rss_mb": self.server.rss_mb(), "stored_bytes": s.get("bytes"),
                "active_bytes": (s.get("process") or {}).get("active_bytes")}

    def group(self, name, units) -> None:
        """``units``: callables, each one conversation (it asks what it asks)."""
        g = {"before": self.point(), "conversations": []}
        for unit in units:
            g["conversations"].append({"requests": unit(), **self.point()})
        g["after"] = g["conversations"][-1]
        self.out["groups"][name] = g

    def stop(self):
        self.server.stop()


def matrix_server(arm, model, tokenizer, L, A, n, log) -> dict:
    texts = Texts(tokenizer)
    run = Run(arm, model, log)
    try:
        first = {}
        for k, kind in enumerate(SYSTEMS):
            units = []
            for j in range(n):
                msgs = _messages(kind, 1000 * k + j, texts.prompt_text(L))
                units.append(lambda msgs=msgs: [run.ask(msgs, A)])
                first.setdefault(kind, msgs)
            run.group(kind, units)
        msgs = first["shared"]
        said = run.out["groups"]["shared"]["conversations"][0]["requests"][0]["answer"]
        reuse = {"regenerated": run.ask(msgs, PROBE_TOKENS),
                 "follow_up": run.ask(msgs + [{"role": "assistant", "content": said},
                                              {"role": "user", "content": "Which word above is the longest?"}],
                                      PROBE_TOKENS)}
        text = msgs[-1]["content"]
        edited = text[:-len(ASK) - 40] + " (edited)" + text[-len(ASK) - 40:]
        reuse["edited_message"] = run.ask(msgs[:-1] + [{"role": "user", "content": edited}], PROBE_TOKENS)
        run.out["reuse"] = reuse
    finally:
        run.stop()
    return run.out


def shapes_server(arm, model, tokenizer, n, log, turn_answer=100) -> dict:
    texts = Texts(tokenizer)
    run = Run(arm, model, log)

    def siblings(i):
        msgs = _messages("shared", 0, texts.prompt_text(2048))
        said = run.ask(msgs, turn_answer)
        turn = msgs + [{"role": "assistant", "content": said["answer"]}]
        a = run.ask(turn + [{"role": "user", "content": "Which word above is the longest?"}], turn_answer)
        b = run.ask(turn + [{"role": "user", "content": "Name three topics of the text above."}], turn_answer)
        return [said, a, b]

    def chat(i):
        msgs, out = _messages("own", 2000 + i, "")[:-1], []
        for t in range(10):
            msgs = msgs + [{"role": "user", "content": texts.span(TURN_TOKENS) + " What is this about?"}]
            out.append(run.ask(msgs, turn_answer))
            msgs = msgs + [{"role": "assistant", "content": out[-1]["answer"]}]
        return out

    try:
        run.group("siblings", [lambda i=i: siblings(i) for i in range(n)])
        run.group("chat10", [lambda i=i: chat(i) for i in range(n)])
    finally:
        run.stop()
    return run.out


# ------------------------------------------------------------------ report
def per_conversation(g, key) -> float | None:
    a, b = g["before"].get(key), g["after"].get(key)
    if a is None or b is None:
        return None
    return (b - a) / len(g["conversations"])


def within_group(g, key) -> float | None:
    """Growth per conversation after a group's first one: (after its last - after its first)
    / (N - 1); leaves out what the first conversation of a group brings (the allocator's pool
    growing for the first long prompt, the first request after another kind)."""
    cs = g["conversations"]
    if len(cs) < 2 or cs[0].get(key) is None or cs[-1].get(key) is None:
        return None
    return (cs[-1][key] - cs[0][key]) / (len(cs) - 1)


def pooled(run, key="rss_mb") -> float | None:
    """Growth per conversation over a whole matrix server after its first conversation (the
    three groups in order: (after the last - after the first) / (conversations - 1))."""
    if not run:
        return None
    cs = [c for name in SYSTEMS if name in run["groups"] for c in run["groups"][name]["conversations"]]
    if len(cs) < 2 or cs[0].get(key) is None or cs[-1].get(key) is None:
        return None
    return (cs[-1][key] - cs[0][key]) / (len(cs) - 1)


def _mb(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _cells(res):
    for key, arms in res["servers"].items():
        if key == "shapes":
            continue
        L, A = key.split("/")
        yield int(L), int(A), arms


def markdown(res) -> str:
    runs = "; ".join(f"`{r['command']}` (load average at start {r['meta']['loadavg_start'][0]:.1f}; code "
                     f"{r['meta'].get('code', {}).get('git_head', '?')})"
                     for r in res["runs"])
    lines = ["# `qfilters-mlx server` vs `mlx_lm.server`: memory and reuse per conversation "
             "(SmolLM2-135M float32)", "",
             f"Machine: {res['runs'][-1]['meta']['machine']}; runs: {runs}. Ours: its defaults "
             "(budget 256, `--max-rewind 64`, `--prefill-step-size 2048`); the anchor: `mlx_lm.server` "
             "(full `KVCache`); both `--prompt-cache-size 64`, greedy, every answer exactly its "
             "length (end of turn banned). Growth per conversation: RSS after a group of N "
             "conversations minus RSS before it, over N; stored: `/health` `stored.bytes`, the same "
             f"difference. Bar: growth at most {RATIO_BAR:.2f} of the anchor's and stored at most "
             f"{STORED_BAR_MB:g} MB per conversation.", ""]
    rows = []
    for L, A, arms in _cells(res):
        anchor, ours = arms.get("mlx_lm"), arms.get("qfilters")
        for kind in SYSTEMS:
            ga = anchor and anchor["groups"].get(kind)
            go = ours and ours["groups"].get(kind)
            a = per_conversation(ga, "rss_mb") if ga else None
            o = per_conversation(go, "rss_mb") if go else None
            wa = within_group(ga, "rss_mb") if ga else None
            wo = within_group(go, "rss_mb") if go else None
            s = per_conversation(go, "stored_bytes") if go else None
            s = None if s is None else s / 1e6
            ratio = o / a if o is not None and a else None
            wratio = wo / wa if wo is not None and wa else None
            ok = "-" if ratio is None or s is None else (
                "yes" if ratio <= RATIO_BAR and s <= STORED_BAR_MB else "no")
            wok = "-" if wratio is None or s is None else (
                "yes" if wratio <= RATIO_BAR and s <= STORED_BAR_MB else "no")
            ns = {len(g["conversations"]) for g in (ga, go) if g}
            n = "/".join(str(len(g["conversations"])) for g in (ga, go) if g) if len(ns) > 1 else min(ns, default=0)
            rows.append([f"{L:,}", A, kind, n, _mb(a), _mb(o), "-" if ratio is None else f"{ratio:.2f}",
                         f"{_mb(wa)} / {_mb(wo)} ({'-' if wratio is None else f'{wratio:.2f}'})",
                         _mb(s), f"{ok} / {wok}"])
        pa, po = pooled(anchor), pooled(ours)
        ps = pooled(ours, "stored_bytes")
        ps = None if ps is None else ps / 1e6
        pr = po / pa if po is not None and pa else None
        pok = "-" if pr is None or ps is None else (
            "yes" if pr <= RATIO_BAR and ps <= STORED_BAR_MB else "no")
        ns = [sum(len(g["conversations"]) for g in r["groups"].values()) - 1 for r in (anchor, ours) if r]
        n = "/".join(map(str, ns)) if len(set(ns)) > 1 else (ns or [0])[0]
        rows.append([f"{L:,}", A, "**all three, after the first**", n, _mb(pa), _mb(po),
                     "-" if pr is None else f"**{pr:.2f}**", "", _mb(ps), pok])
    lines += common.md_table(["prompt tokens", "answer tokens", "system prompt", "N (mlx_lm/ours where they differ)",
                              "mlx_lm growth per conversation (MB)", "ours (MB)", "ours / mlx_lm",
                              "after the group's first: mlx_lm / ours (MB; ratio)",
                              "ours stored per conversation (MB)", "within the bar (both measures)"],
                             rows, "rrlrrrrrrl")
    lines += ["", "Reuse (tokens of the prompt served from a stored cache, `cached_tokens`; prompt "
              "tokens in brackets), on the shared-system-prompt group's first conversation:", ""]
    rows = []
    for L, A, arms in _cells(res):
        for arm in ("mlx_lm", "qfilters"):
            r = arms.get(arm)
            if not r or "reuse" not in r:
                continue
            u = r["reuse"]
            shared = r["groups"]["shared"]["conversations"]
            second = shared[1]["requests"][0] if len(shared) > 1 else None
            rows.append([f"{L:,}", A, arm] + ["-" if x is None else
                                              f"{x['reused']:,} ({x['prompt_tokens']:,})" for x in
                                              (u["regenerated"], u["follow_up"], second, u["edited_message"])])
    lines += common.md_table(["prompt tokens", "answer tokens", "server", "regenerated answer",
                              "follow-up turn", "same system prompt", "edited last message"],
                             rows, "rrlrrrr")
    shapes = res["servers"].get("shapes", {})
    lines += ["", "Two more shapes: two follow-ups of one 2,048-token turn sent one after the other, "
              "and a 10-turn chat (200-token turns); answers of 100 tokens:", ""]
    rows = []
    for name in ("siblings", "chat10"):
        ga = (shapes.get("mlx_lm") or {}).get("groups", {}).get(name)
        go = (shapes.get("qfilters") or {}).get("groups", {}).get(name)
        a = per_conversation(ga, "rss_mb") if ga else None
        o = per_conversation(go, "rss_mb") if go else None
        s = per_conversation(go, "stored_bytes") if go else None
        s = None if s is None else s / 1e6

        def reuse(g):
            if not g:
                return "-"
            last = g["conversations"][-1]["requests"][-1]
            return f"{last['reused']:,} ({last['prompt_tokens']:,})"

        ratio = o / a if o is not None and a else None
        n = len((go or ga or {"conversations": []})["conversations"])
        rows.append([name, n, _mb(a), _mb(o), "-" if ratio is None else f"{ratio:.2f}", _mb(s),
                     reuse(ga), reuse(go)])
    lines += common.md_table(["shape", "N", "mlx_lm growth per conversation (MB)", "ours (MB)",
                              "ours / mlx_lm", "ours stored per conversation (MB)",
                              "last request's reuse, mlx_lm", "ours"], rows, "lrrrrrrr")
    lines += [""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=common.int_list, default=[2048, 7680])
    p.add_argument("--answers", type=common.int_list, default=[16, 100, 400])
    p.add_argument("--conversations", type=int, default=2, help="per group (N)")
    p.add_argument("--arms", default="mlx_lm,qfilters")
    p.add_argument("--matrix", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--shapes", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "server_memory.json")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/qfilters-server-memory"))
    p.add_argument("--resume", action="store_true",
                   help="keep the servers already measured in --out, run the rest")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="only write --out from these results files (runs of other --arms), "
                        "servers and runs joined")
    args = p.parse_args()
    if args.merge:
        res = {"servers": {}, "runs": []}
        for path in args.merge:
            part = json.loads(path.read_text())
            res["runs"] += part["runs"]
            for key, arms in part["servers"].items():
                res["servers"].setdefault(key, {}).update(arms)
        used = {arm["command"] for arms in res["servers"].values() for arm in arms.values()}
        res["runs"] = [r for r in res["runs"] if r["command"] in used]  # (superseded runs left out)
        common.write_results(args.out, res, markdown(res))
        print(markdown(res))
        return
    from mlx_lm.utils import load_tokenizer

    from qfilters_mlx.assets.prepare_model import prepare_model

    model = prepare_model()
    tokenizer = load_tokenizer(model)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    command = "python bench/bench_server_memory.py " + " ".join(a for a in sys.argv[1:] if a != "--resume")
    res = {"servers": {}, "runs": []}
    if args.resume and args.out.exists():
        res = json.loads(args.out.read_text())
    res["runs"].append({"command": command, "meta": common.run_meta()})
    arms = args.arms.split(",")
    jobs = [(f"{L}/{A}", L, A) for L in args.lengths for A in args.answers] if args.matrix else []
    if args.shapes:
        jobs.append(("shapes", None, None))
    for key, L, A in jobs:
        for arm in arms:
            done = res["servers"].setdefault(key, {})
            if arm in done:
                continue  # (--resume: measured before)
            print(f"{key} {arm}: {args.conversations} per group", flush=True)
            log = args.log_dir / f"{arm}-{key.replace('/', '-')}.log"
            if L is None:
                done[arm] = shapes_server(arm, model, tokenizer, args.conversations, log)
            else:
                done[arm] = matrix_server(arm, model, tokenizer, L, A, args.conversations, log)
            done[arm]["command"] = command
            common.write_results(args.out, res, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
