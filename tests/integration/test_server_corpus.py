"""``qfilters-mlx server`` (SmolLM2, a subprocess on 127.0.0.1) against the bad-input corpus of
``tests/helpers/server_corpus.py``: every case gets its expected status (the error naming the field),
the server then answers the good request exactly as before it, the generation loop never
restarts and nothing is logged as a traceback; a ``--filters`` file that is not a filters file
stops the start; CORS allows no origin by default; a completion logs one "request done" line;
stored short conversations hold their rows and the bytes counted are the caches' (``/health``);
after an eviction a follow-up turn reuses the stored conversation and prompts diverging inside
it the system prompt's checkpoint, the same on two fresh servers.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from helpers.server_corpus import CHAT, GOOD_CHAT, TEXT, Case, ServerProcess, answer, cases, get_json, post_json, send

pytestmark = pytest.mark.integration

BUDGET = 64


def _argv(model_path, *extra):
    return [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", "--model", str(model_path),
            "--budget", str(BUDGET), *extra]


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(_argv(model_path, "--decode-concurrency", "2"), log, env=_env(),
                         start_timeout=600)  # (it may calibrate the default filter first)
    yield proc
    proc.stop()


def test_every_bad_request_is_refused_and_the_next_good_one_is_unchanged(server):
    status, first = post_json(server.port, CHAT, GOOD_CHAT)
    assert status == 200, first
    reference = answer(first)
    assert reference and "capital" in reference
    wrong = []
    for case in cases():
        status, raw = send(server.port, case)
        param = None
        if status is not None and status < 500 and raw.startswith(b"{"):
            error = json.loads(raw).get("error", {})
            param = error.get("param") if isinstance(error, dict) else None  # (mlx-lm's: a string)
        if status != case.status or (case.param is not None and param != case.param):
            wrong.append((case.name, status, param, raw[:160]))
        assert server.alive(), f"server died on {case.name}"
        status, reply = post_json(server.port, CHAT, GOOD_CHAT)
        assert status == 200 and answer(reply) == reference, (case.name, status, reply)
    assert not wrong, wrong
    status, health = get_json(server.port, "/health")
    assert status == 200 and health["generation_loop_restarts"] == 0, health
    log = open(server.log_path).read()
    assert "Traceback" not in log and "generation loop failed" not in log


def _settled_count(path, text, at_least=0, timeout=30.0, quiet=2.0):
    """Occurrences of ``text`` in the log once there are ``at_least`` and none came for ``quiet`` s."""
    deadline = time.time() + timeout
    count, since = -1, time.time()
    while time.time() < deadline:
        n = open(path).read().count(text)
        if n != count:
            count, since = n, time.time()
        elif n >= at_least and time.time() - since >= quiet:
            break
        time.sleep(0.2)
    return count


def test_no_cors_origin_and_one_log_line_per_completion(server):
    case = Case("cors", TEXT, json.dumps({"prompt": "The sky is", "max_tokens": 3}).encode(), 200,
                headers={"Origin": "http://evil.example"})
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", case.path, body=case.raw, headers={**case.headers, "Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") is None
    # (the line is logged by the generation loop once the cache is stored, after the reply)
    before = _settled_count(server.log_path, "request done")
    status, _ = post_json(server.port, TEXT, {"prompt": "One two three", "max_tokens": 3})
    assert status == 200
    assert _settled_count(server.log_path, "request done", before + 1) == before + 1


def test_stored_short_conversations_hold_their_rows_and_bytes_are_the_caches(server):
    """Conversations shorter than the budget: each stored cache holds exactly its tokens' rows
    (buffers cut to the live rows at rest), and the bytes reported are the caches' own
    ``nbytes`` sum: rows x (K + V row bytes + float32 score + int64 position) x layers, plus
    each cache's float32 filter ``[H_kv, D]`` (the calibrated default has one from the first
    token); ``/health`` gives the process's MLX active bytes beside them."""
    for i in range(3):
        status, _ = post_json(server.port, TEXT, {"prompt": f"Count to {i + 3}:", "max_tokens": 3})
        assert status == 200
    status, health = get_json(server.port, "/health")
    stored = health["stored"]
    assert stored["sequences"] > 0
    assert stored["rows_per_layer"] <= stored["sequences"] * BUDGET, stored
    layers, kv_heads, head_dim = 30, 3, 64
    row_bytes = kv_heads * (2 * head_dim * 4 + 4 + 8)
    filter_bytes = stored["sequences"] * layers * kv_heads * head_dim * 4
    caches = stored["bytes"] - stored["index_bytes"]  # (the packed token keys and trie besides)
    assert caches == stored["rows_per_layer"] * row_bytes * layers + filter_bytes, stored
    assert stored["index_bytes"] > 0
    assert stored["process"]["active_bytes"] > stored["bytes"]


def test_a_filters_file_that_is_not_one_stops_the_start(model_path, tmp_path):
    with pytest.raises(RuntimeError, match="cannot serve"):
        ServerProcess(_argv(model_path, "--filters", str(model_path / "model.safetensors")),
                      tmp_path / "bad.log", env=_env(), start_timeout=120)


def _template_ids(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


def _shared(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _conversation(port):
    """A conversation longer than the budget, then a follow-up turn, its last message edited,
    another question on the same passage, and a prompt sharing only the passage's first half
    (diverging ~150 tokens before the stored prompt's end, far deeper than the rewind depth
    alone reaches). Returns ``[(messages, answer, cached_tokens)]``."""
    passage = " ".join(f"Entry {i}: the river was {30 + i} cm high and the weather was "
                       f"{['calm', 'windy', 'rainy'][i % 3]}." for i in range(24))
    system = {"role": "system", "content": "Answer briefly."}
    first = [system, {"role": "user", "content": passage + " Which entry had the highest river?"}]
    out = []

    def ask(messages):
        status, reply = post_json(port, CHAT, {"messages": messages, "max_tokens": 6, "temperature": 0})
        assert status == 200, reply
        out.append((messages, answer(reply), reply["usage"]["prompt_tokens_details"]["cached_tokens"]))
        return out[-1][1]

    said = ask(first)
    ask(first + [{"role": "assistant", "content": said}, {"role": "user", "content": "And the lowest?"}])
    ask([system, {"role": "user", "content": passage + " Which entry had the lowest river?"}])
    ask([system, {"role": "user", "content": passage + " Which entries were windy?"}])
    half = passage[: len(passage) // 2]
    ask([system, {"role": "user", "content": half + " That is all. What was measured?"}])
    return out


def test_reuse_after_eviction_is_the_anchors_for_chat_and_the_same_on_two_fresh_servers(model_path, tmp_path):
    """Two fresh servers (default flags, budget 64) get the same conversation: the answers and
    the tokens reused are the same on both. The follow-up turn reuses at least the whole first
    prompt (its stored conversation, answer included, is a prefix), as mlx-lm's full caches
    do; prompts diverging inside the stored prompt (another question on the passage, an edit,
    half the passage) are served from the nearest stored point below the divergence: the
    system prompt's checkpoint (``sys_end`` tokens, where the rendered system-only template
    leaves the prompt), never more than a full cache would reuse."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    runs = []
    for name in ("a", "b"):
        # (the first start may calibrate the default filter for this session's home: slow)
        proc = ServerProcess(_argv(model_path), tmp_path / f"{name}.log", env=_env(), start_timeout=600)
        try:
            runs.append(_conversation(proc.port))
        finally:
            proc.stop()
    assert [(a, r) for _, a, r in runs[0]] == [(a, r) for _, a, r in runs[1]]
    ids = [_template_ids(tok, m) for m, _, _ in runs[0]]
    assert len(ids[0]) > 4 * BUDGET and runs[0][0][2] == 0
    follow = runs[0][1][2]
    assert ids[1][: len(ids[0])] == ids[0] and len(ids[0]) <= follow <= len(ids[1]) - 1
    system = runs[0][0][0][:1]
    sys_end = _shared(_template_ids(tok, system + [{"role": "user", "content": ""}]), ids[0])
    for k in (2, 3, 4):  # (the system prompt's checkpoint is stored once a second request
        c = max(_shared(ids[k], ids[j]) for j in range(k))  # computes it: from k = 3 on)
        want = 0 if k == 2 else sys_end
        assert runs[0][k][2] == want and sys_end <= min(len(ids[k]) - 1, c), (k, runs[0][k][2], sys_end, c)
    assert len(ids[0]) - _shared(ids[4], ids[0]) > 2 * BUDGET  # (the deep case is deep)


def test_every_alias_of_the_served_model_is_served_without_a_reload(server, model_path):
    """mlx-lm keys loaded models by the literal string: the folder name (or the path with a
    trailing ``/``) reloaded the model, or unloaded it when the name is not a path. Every alias
    is served by the loaded model: the same answer, and the model loaded once."""
    status, first = post_json(server.port, CHAT, GOOD_CHAT)
    assert status == 200
    for alias in (model_path.name, str(model_path), str(model_path) + "/", "default_model"):
        status, reply = post_json(server.port, CHAT, {**GOOD_CHAT, "model": alias})
        assert status == 200 and answer(reply) == answer(first), (alias, reply)
    assert open(server.log_path).read().count("attention caches budgeted") == 1
