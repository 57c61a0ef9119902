"""``qfilters-mlx server`` (SmolLM2, a subprocess on 127.0.0.1) against the bad-input corpus of
``tests/helpers/server_corpus.py``: every case gets its expected status (the error naming the field),
the server then answers the good request exactly as before it, the generation loop never
restarts and nothing is logged as a traceback; a ``--filters`` file that is not a filters file
stops the start; CORS allows no origin by default; a completion logs one "request done" line;
stored short conversations hold ``budget + 1`` rows per layer each (``/health``).
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
    proc = ServerProcess(_argv(model_path, "--decode-concurrency", "2"), log, env=_env())
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
            param = json.loads(raw).get("error", {}).get("param")
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


def test_stored_short_conversations_hold_budget_plus_one_rows(server):
    """Conversations shorter than the budget: each stored cache holds ``budget + 1`` rows per
    layer (the buffer rule of ``QFiltersKVCache._append``), and the bytes reported are the caches'
    own ``nbytes`` sum: rows x (K + V row bytes + float32 score + int64 position) x layers,
    plus each cache's float32 filter ``[H_kv, D]`` (the calibrated default has one from the
    first token)."""
    for i in range(3):
        status, _ = post_json(server.port, TEXT, {"prompt": f"Count to {i + 3}:", "max_tokens": 3})
        assert status == 200
    status, health = get_json(server.port, "/health")
    stored = health["stored"]
    assert stored["sequences"] > 0
    assert stored["rows_per_layer"] == stored["sequences"] * (BUDGET + 1), stored
    layers, kv_heads, head_dim = 30, 3, 64
    row_bytes = kv_heads * (2 * head_dim * 4 + 4 + 8)
    filter_bytes = stored["sequences"] * layers * kv_heads * head_dim * 4
    assert stored["bytes"] == stored["rows_per_layer"] * row_bytes * layers + filter_bytes, stored


def test_a_filters_file_that_is_not_one_stops_the_start(model_path, tmp_path):
    with pytest.raises(RuntimeError, match="cannot serve"):
        ServerProcess(_argv(model_path, "--filters", str(model_path / "model.safetensors")),
                      tmp_path / "bad.log", env=_env(), start_timeout=120)


def test_after_an_eviction_an_edited_tail_reuses_the_stored_prompt_up_to_the_edit(server, model_path):
    """A conversation longer than the budget (evicted), then the same one with its last words
    edited: the stored prompt is rewound to the shared prefix (within --max-rewind 16), so the
    tokens reused are mlx-lm's own rule, ``min(len(prompt) - 1, common prefix)``, computed here
    from the chat template's tokens; a prompt diverging deeper falls back to a stored prefix."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    passage = " ".join(f"Entry {i}: the river was {30 + i} cm high and calm." for i in range(25))
    system = {"role": "system", "content": "Answer briefly."}
    first = [system, {"role": "user", "content": passage + " Which entry had the highest river?"}]
    edited = [system, {"role": "user", "content": passage + " Which entry had the lowest river?"}]
    status, reply = post_json(server.port, CHAT, {"messages": first, "max_tokens": 4})
    assert status == 200 and reply["usage"]["prompt_tokens"] > 2 * BUDGET
    status, reply = post_json(server.port, CHAT, {"messages": edited, "max_tokens": 4})
    a, b = (tok.apply_chat_template(m, add_generation_prompt=True) for m in (first, edited))
    a, b = (x if isinstance(x, list) else x["input_ids"] for x in (a, b))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert len(a) - 1 - common <= 16  # (the edit is within the rewind depth of the stored prompt)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == min(len(b) - 1, common)
