"""``qfilters-mlx server`` against ``mlx_lm.server``: bad inputs, memory of stored conversations,
reuse after eviction, a soak with client disconnects, and the rewind journal's decode cost.

Both servers run SmolLM2-135M-Instruct (float32) on 127.0.0.1 as subprocesses (OpenBLAS
preloaded for both). Ours: ``--budget 64 --filters bench/results/smollm2_filters.safetensors``
(the calibrated query filter, eviction from the first call) with its defaults otherwise
(``--max-rewind 64``); the anchor: ``mlx_lm.server``
defaults. Phases, each on fresh servers:

1. **corpus**: every case of ``tests/helpers/server_corpus.py``, then the good request; per case the
   status, whether the good request still gets the reference answer, and whether the server
   crashed (process gone) or its generation thread died (``/health`` 503). A crashed or
   dead server is restarted for the next case.
2. **memory**: ``--conversations`` short distinct chat conversations stored (``--prompt-cache-size``
   large enough to keep them all); RSS before/after, and ours' ``/health`` stored bytes and rows
   per layer against ``conversations x (budget + chunk)``.
3. **reuse**: conversations longer than the budget, then (a) a follow-up turn, (b) the last
   message edited at its tail, (c) a new prompt sharing a long prefix (the same passage, another
   question), (d) one sharing only the passage's first half (diverging ~200 tokens before the
   stored end, deeper than the rewind depth); tokens reused = ``usage.prompt_tokens_details.cached_tokens``. Ours runs on two
   fresh servers: answers and reuse must be identical. Then RSS of both, and ours' stored bytes
   (``/health``: conversations and checkpoints). The memory per conversation at 2k and 8k tokens:
   ``bench/bench_server_memory.py``.
4. **soak**: ``--soak`` mixed requests (chat, text, streaming), every fifth a stream the client
   drops after the first chunk; errors and RSS before/after.
5. **decode**: decode tokens/s with the server's caches at ``max_rewind`` 0, 16 and 64
   (the server's default), in process, alternating (the rewind journal's cost).

Writes ``bench/results/server_soak.json`` and ``.md``. Run:
``PYTHONPATH=python python bench/bench_server_soak.py`` (``--help`` for the sizes).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.server_corpus import CHAT, GOOD_CHAT, TEXT, ServerProcess, answer, cases, get_json, post_json, send  # noqa: E402

import common  # noqa: E402  (fast BLAS; run metadata)

BUDGET = 64
FILTERS = ROOT / "bench" / "results" / "smollm2_filters.safetensors"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def argv(arm: str, model: Path, *extra) -> list[str]:
    if arm == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), *extra]
    return [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", "--model", str(model),
            "--budget", str(BUDGET), "--filters", str(FILTERS), *extra]


def start(arm, model, log_dir, tag, *extra) -> ServerProcess:
    return ServerProcess(argv(arm, model, *extra), log_dir / f"{arm}-{tag}.log", env=_env())


# ------------------------------------------------------------------ phases
def corpus(arm, model, log_dir) -> dict:
    server = start(arm, model, log_dir, "corpus")
    _, ref = post_json(server.port, CHAT, GOOD_CHAT)
    reference = answer(ref)
    rows, crashes, deaths, stalls = [], 0, 0, 0
    try:
        for case in cases():
            status, raw = send(server.port, case, timeout=15)
            crashed = not server.alive()
            died = stalled = good = False
            if not crashed:
                h, _ = get_json(server.port, "/health")
                died = h != 200
                if not died:
                    gs, reply = post_json(server.port, CHAT, GOOD_CHAT)
                    good = gs == 200 and answer(reply) == reference
                    stalled = gs is None  # (no answer in time: still busy with the case)
            crashes += crashed
            deaths += died
            stalls += stalled
            rows.append({"case": case.name, "expected": case.status, "status": status,
                         "crashed": crashed, "thread_died": died, "stalled": stalled,
                         "next_good_ok": good, "answer": raw[:160].decode(errors="replace")})
            if crashed or died or stalled:
                server.stop()
                server = start(arm, model, log_dir, f"corpus-{len(rows)}")
    finally:
        server.stop()
    return {"reference": reference, "cases": rows, "crashes": crashes, "thread_deaths": deaths,
            "stalls": stalls, "as_expected": sum(r["status"] == r["expected"] for r in rows),
            "next_good_ok": sum(r["next_good_ok"] for r in rows), "n": len(rows),
            "command": " ".join(sys.argv[1:]), "git_head": common.run_meta()["code"]["git_head"]}


def memory(arm, model, log_dir, n) -> dict:
    server = start(arm, model, log_dir, "memory", "--prompt-cache-size", str(4 * n))
    try:
        post_json(server.port, CHAT, GOOD_CHAT)
        rss0 = server.rss_mb()
        longest = 0
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"Give me one fact about the number {i}."}],
                    "max_tokens": 8, "temperature": 0.0}
            status, reply = post_json(server.port, CHAT, body)
            assert status == 200, reply
            longest = max(longest, reply["usage"]["prompt_tokens"])
        rss1 = server.rss_mb()
        _, health = get_json(server.port, "/health")
    finally:
        server.stop()
    out = {"conversations": n, "rss_before_mb": rss0, "rss_after_mb": rss1,
           "rss_per_conversation_mb": (rss1 - rss0) / n, "longest_prompt": longest}
    stored = health.get("stored")
    if stored:
        out.update(stored=stored, bound_rows=n * (BUDGET + longest))
    return out


PASSAGE = ("The otter colony on the northern river had a secret code name, ZEPHYR, which the "
           "rangers used in their radio messages. ") + " ".join(
    f"Ranger log entry {i}: the water level was {40 + i % 7} centimetres, the weather was "
    f"{['clear', 'cloudy', 'windy', 'rainy'][i % 4]}, and {i % 5 + 2} otters were seen near the "
    f"old mill." for i in range(14))


def _chat(messages, max_tokens=16):
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}


def reuse(arm, model, log_dir, tag) -> dict:
    server = start(arm, model, log_dir, f"reuse-{tag}")
    system = {"role": "system", "content": "You are a careful assistant who answers briefly."}
    out = {}
    try:
        def ask(messages):
            status, reply = post_json(server.port, CHAT, _chat(messages))
            assert status == 200, reply
            u = reply["usage"]
            return {"prompt_tokens": u["prompt_tokens"],
                    "reused": u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                    "answer": answer(reply)}

        first = [system, {"role": "user", "content": PASSAGE + " What is the code name of the otter colony?"}]
        a = ask(first)
        follow = first + [{"role": "assistant", "content": a["answer"]},
                          {"role": "user", "content": "How many otters were seen in entry 3?"}]
        out["first"] = a
        out["follow_up"] = ask(follow)
        edited = first[:-1] + [{"role": "user", "content": PASSAGE + " What is the code name of the colony?"}]
        out["edited_last_message"] = ask(edited)
        other = [system, {"role": "user", "content": PASSAGE + " What was the weather in entry 5?"}]
        out["shared_prefix"] = ask(other)
        half = PASSAGE[: len(PASSAGE) // 2]
        deep = [system, {"role": "user", "content": half + " That is all. Which river is this about?"}]
        out["deep_shared_prefix"] = ask(deep)
        out["rss_mb"] = server.rss_mb()
        _, health = get_json(server.port, "/health")
        if health.get("stored"):
            out["stored"] = health["stored"]
    finally:
        server.stop()
    return out


REUSE_CASES = ("first", "follow_up", "edited_last_message", "shared_prefix", "deep_shared_prefix")


def soak(arm, model, log_dir, n) -> dict:
    server = start(arm, model, log_dir, "soak")
    errors, dropped = 0, 0
    try:
        post_json(server.port, CHAT, GOOD_CHAT)
        rss0 = server.rss_mb()
        for i in range(n):
            if i % 5 == 4:  # a streaming client that leaves after the first chunk
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                body = json.dumps({**_chat([{"role": "user", "content": f"Write a long story number {i}."}],
                                            64), "stream": True})
                conn.request("POST", CHAT, body=body, headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read(64)
                conn.close()
                dropped += 1
                continue
            if i % 2:
                status, _ = post_json(server.port, TEXT, {"prompt": f"Item {i}: the river", "max_tokens": 8})
            else:
                status, _ = post_json(server.port, CHAT, _chat([{"role": "user", "content": f"Say {i}."}], 8))
            errors += status != 200
        status, _ = post_json(server.port, CHAT, GOOD_CHAT)
        errors += status != 200
        rss1 = server.rss_mb()
        health, h = get_json(server.port, "/health")
    finally:
        server.stop()
    return {"requests": n, "disconnects": dropped, "errors": errors, "health": health,
            "rss_before_mb": rss0, "rss_after_mb": rss1, "health_body": h}


DEPTHS = (0, 16, 64)


def _server_config():
    from qfilters_mlx import KVCacheConfig

    return KVCacheConfig(method="qfilters", qfilters_budget=BUDGET, qfilters_filters=str(FILTERS))


def decode(tokens, reps, prompt_len=512) -> dict:
    """Decode tokens/s of SmolLM2 through ``mlx_lm.stream_generate`` with the server's caches
    (budget 64, the calibrated filters file) at each ``max_rewind`` of :data:`DEPTHS`,
    alternating within each rep (in process: HTTP and prefill time would hide a per-step
    difference); ratios against depth 0 are taken within a rep."""
    import mlx_lm

    from qfilters_mlx.cache.builder import KVCacheBuilder

    model, tok = common.load_model()
    prompt = list(common.prompts(tok, [prompt_len]).values())[0]
    out = {f"max_rewind_{d}": [] for d in DEPTHS}
    held = {}
    for _ in range(reps):
        for d in DEPTHS:
            caches = KVCacheBuilder.for_model(model, _server_config(), backend="auto", max_rewind=d)
            last = None
            for last in mlx_lm.stream_generate(model, tok, prompt, max_tokens=tokens, prompt_cache=caches):
                pass
            out[f"max_rewind_{d}"].append(last.generation_tps)
            held[d] = sum(c.nbytes for c in caches)
    for d in DEPTHS[1:]:
        out[f"ratio_{d}_vs_0"] = [a / b for a, b in zip(out[f"max_rewind_{d}"], out["max_rewind_0"])]
    out["cache_bytes_after"] = {str(d): held[d] for d in DEPTHS}
    out["prompt_tokens"], out["generated"], out["depths"] = prompt_len, tokens, list(DEPTHS)
    return out


def _spread(xs) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return (f"median {statistics.median(xs):.2f} (quartiles {q[0]:.2f}-{q[2]:.2f}, range "
            f"{min(xs):.2f}-{max(xs):.2f}, n = {len(xs)})")


# ------------------------------------------------------------------ report
def markdown(res) -> str:
    L = [f"# qfilters-mlx server vs mlx_lm.server: bad inputs, memory, reuse, soak "
         f"(SmolLM2-135M float32, budget {BUDGET})", "",
         f"Machine: {res['meta']['machine']}, load average at start {res['meta']['loadavg_start'][0]:.1f}. "
         f"Ours: `--budget {BUDGET} --filters bench/results/smollm2_filters.safetensors` (defaults "
         f"otherwise, as of the code measured: git {res['meta']['code']['git_head']}); "
         "the anchor: `mlx_lm.server` defaults. Memory per conversation and reuse against "
         "`mlx_lm.server` at 2k and 8k tokens: `server_memory.md`.", ""]
    if "corpus" in res:
        L += ["## Bad-input corpus (`tests/helpers/server_corpus.py`)", ""]
        L += common.md_table(["server", "cases", "status as expected (ours)", "next good request correct",
                              "crashes", "generation-thread deaths", "stalled (restarted)", "code"],
                             [[a, c["n"], c["as_expected"], c["next_good_ok"], c["crashes"], c["thread_deaths"],
                               c.get("stalls", "-"), c.get("git_head", "-")]
                              for a, c in res["corpus"].items()], "lrrrrrrl")
        L += ["", "Per case (status; C = process crashed, D = generation thread died, S = no answer to "
              "the next good request in 120 s (server restarted), x = next good request wrong; - = "
              "not in that server's run):", ""]
        arms = list(res["corpus"])
        by_name = {a: {r["case"]: r for r in res["corpus"][a]["cases"]} for a in arms}
        names = list(dict.fromkeys(r["case"] for a in arms for r in res["corpus"][a]["cases"]))
        expected = {r["case"]: r["expected"] for a in arms for r in res["corpus"][a]["cases"]}
        rows = []
        for name in names:
            cells = []
            for a in arms:
                r = by_name[a].get(name)
                if r is None:
                    cells.append("-")
                    continue
                mark = ("C" if r["crashed"] else "D" if r["thread_died"] else "S" if r.get("stalled")
                        else "" if r["next_good_ok"] else "x")
                cells.append(f"{r['status']}{(' ' + mark) if mark else ''}")
            rows.append([f"`{name}`", expected[name], *cells])
        L += common.md_table(["case", "expected", *arms], rows, "lr" + "r" * len(arms))
    if "memory" in res:
        L += ["", "## Stored short conversations", ""]
        rows = []
        for a, m in res["memory"].items():
            st = m.get("stored") or {}
            rows.append([a, m["conversations"], f"{m['rss_before_mb']:.0f} -> {m['rss_after_mb']:.0f}",
                         f"{m['rss_per_conversation_mb']:.2f}", st.get("sequences", "-"),
                         f"{st['bytes'] / 1e6:.1f}" if st else "-", st.get("rows_per_layer", "-"),
                         m.get("bound_rows", "-")])
        L += common.md_table(["server", "conversations", "RSS MB", "RSS MB per conversation", "stored entries",
                              "stored MB (nbytes)", "stored rows per layer", f"bound n x ({BUDGET} + chunk)"],
                             rows, "lrrrrrrr")
    if "reuse" in res:
        L += ["", "## Reuse after eviction (tokens reused = `cached_tokens`)", ""]
        rows = []
        for kind in REUSE_CASES:
            rows.append([kind] + [f"{r[kind]['reused']} / {r[kind]['prompt_tokens']}"
                                  for r in res["reuse"].values()])
        rows.append(["RSS MB after"] + [f"{r['rss_mb']:.0f}" if "rss_mb" in r else "-"
                                        for r in res["reuse"].values()])
        L += common.md_table(["request", *res["reuse"]], rows, "l" + "r" * len(res["reuse"]))
        st = res["reuse"]["qfilters"].get("stored")
        if st:
            L += ["", f"Ours holds {st['bytes'] / 1e6:.1f} MB after these requests (`/health`, the caches' "
                  f"`nbytes`): {st['conversations']} conversations, {st['checkpoints']} checkpoints "
                  f"({st['checkpoint_bytes'] / 1e6:.1f} MB of it), {st['rows_per_layer']} rows per layer."]
        L += ["", f"Two fresh qfilters servers gave identical answers and reuse: {res['reuse_deterministic']}."]
    if "soak" in res:
        L += ["", "## Soak with client disconnects", ""]
        L += common.md_table(["server", "requests", "dropped streams", "errors", "health after", "RSS MB"],
                             [[a, s["requests"], s["disconnects"], s["errors"], s["health"],
                               f"{s['rss_before_mb']:.0f} -> {s['rss_after_mb']:.0f}"]
                              for a, s in res["soak"].items()], "lrrrrr")
    if "decode" in res:
        d = res["decode"]
        L += ["", "## Rewind journal cost (ours, decode tokens/s in process, alternating)", "",
              f"{d['prompt_tokens']}-token prompt, {d['generated']} generated, budget {BUDGET}, "
              f"the depths alternating within each rep:", ""]
        rows = [[str(k), ", ".join(f"{t:.1f}" for t in d[f"max_rewind_{k}"]),
                 _spread(d[f"ratio_{k}_vs_0"]) if k else "-", f"{d['cache_bytes_after'][str(k)] / 1e6:.2f}"]
                for k in d["depths"]]
        L += common.md_table(["--max-rewind", "decode tok/s", "ratio to 0 (paired)", "cache MB after"],
                             rows, "rlll")
    L += ["", "Runs: " + "; ".join(f"{phase}: `{r['command']}` (load {r['loadavg_start'][0]:.1f})"
                                   for phase, r in res.get("runs", {}).items()) + ".", ""]
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", default="corpus,memory,reuse,soak,decode")
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--soak", type=int, default=40)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-reps", type=int, default=10)
    ap.add_argument("--out", default=str(common.RESULTS / "server_soak.json"))
    ap.add_argument("--arms", default="qfilters,mlx_lm",
                    help="servers of the corpus and soak phases (the others' results are kept)")
    args = ap.parse_args()
    from qfilters_mlx.assets.prepare_model import prepare_model

    model = prepare_model()
    log_dir = Path(args.out).with_suffix("")
    log_dir = Path("/tmp") / f"{log_dir.name}-logs"
    log_dir.mkdir(exist_ok=True)
    phases = args.phases.split(",")
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    command = "PYTHONPATH=python python bench/bench_server_soak.py " + " ".join(sys.argv[1:])
    res["meta"] = common.run_meta(command=command)
    for phase in phases:  # (phases may come from separate runs: each keeps its command and load)
        res.setdefault("runs", {})[phase] = {"command": command, "loadavg_start": res["meta"]["loadavg_start"]}
    arms = args.arms.split(",")

    def save():
        common.write_results(out, res, markdown(res))

    if "corpus" in phases:
        res["corpus"] = {**res.get("corpus", {}), **{a: corpus(a, model, log_dir) for a in arms}}
        save()
    if "memory" in phases:
        res["memory"] = {a: memory(a, model, log_dir, args.conversations) for a in arms}
        save()
    if "reuse" in phases:
        runs = {"qfilters": reuse("qfilters", model, log_dir, "a"), "mlx_lm": reuse("mlx_lm", model, log_dir, "a")}
        again = reuse("qfilters", model, log_dir, "b")
        res["reuse"] = runs
        res["reuse_deterministic"] = all(again[k] == runs["qfilters"][k] for k in REUSE_CASES)
        save()
    if "soak" in phases:
        res["soak"] = {**res.get("soak", {}), **{a: soak(a, model, log_dir, args.soak) for a in arms}}
        save()
    if "decode" in phases:
        res["decode"] = decode(args.decode_tokens, args.decode_reps)
        save()
    print(markdown(res))


if __name__ == "__main__":
    main()
