"""``qfilters-mlx server`` (SmolLM2, a subprocess on 127.0.0.1): what stored conversations hold,
and answers equal to the library's.

* per conversation: ``/health``'s stored bytes stay within the budget plus the rewind journal
  (``budget + 1 + max_rewind`` rows per layer; the answers here are shorter than the rewind
  depth, so one entry per conversation besides the shared system prompt), and the process's
  MLX active memory grows by what ``/health`` counts, not more (no view of a larger buffer
  kept alive);
* the greedy answer to a prompt longer than the budget and than the prefill step equals
  ``qfilters-mlx generate``'s with the same configuration and prefill step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.server_corpus import CHAT, ServerProcess, answer, get_json, post_json

pytestmark = pytest.mark.integration

BUDGET, REWIND = 64, 64
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
BOUND = LAYERS * ((BUDGET + 1 + REWIND) * KV_HEADS * (2 * HEAD_DIM * 4 + 12) + KV_HEADS * HEAD_DIM * 4)
"""Bytes one stored cache of SmolLM2 holds at most at rest (rows: K, V float32, score, position)."""


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def _server(model_path, log, *extra):
    argv = [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", "--model", str(model_path),
            "--budget", str(BUDGET), *extra]
    return ServerProcess(argv, log, env=_env(), start_timeout=600)


def _spans(n, chars=2400):
    from qfilters_mlx.assets.prompts import source_text

    text = source_text()
    return [text[i * chars:(i + 1) * chars] for i in range(n)]


def _settled(port, conversations, timeout=60.0):
    """``/health``'s ``stored`` once ``conversations`` answers are stored (the generation loop
    stores a finished request's cache right after its reply) and the checkpoint of the answer's
    prompt is dropped (the system prompt's is stored from the second conversation on, which
    repeats it)."""
    deadline = time.time() + timeout
    while True:
        _, health = get_json(port, "/health")
        stored = health["stored"]
        if stored["conversations"] == conversations and stored["checkpoints"] == min(1, conversations - 1):
            return stored
        if time.time() > deadline:
            raise AssertionError(f"/health never showed {conversations} conversations: {stored}")
        time.sleep(0.2)


def test_stored_conversations_are_bounded_by_health_and_by_active_memory(model_path, tmp_path):
    server = _server(model_path, tmp_path / "server.log")
    try:
        system = {"role": "system", "content": "Answer in one sentence."}
        seen = []
        for text in _spans(4):
            body = {"messages": [system, {"role": "user", "content": text + " Summarize."}],
                    "max_tokens": 8, "temperature": 0.0}
            status, reply = post_json(server.port, CHAT, body, timeout=600)
            assert status == 200, reply
            assert reply["usage"]["prompt_tokens"] > 4 * BUDGET
            seen.append(_settled(server.port, conversations=len(seen) + 1))
    finally:
        server.stop()
    last = seen[-1]
    assert last["conversations"] == 4 and last["checkpoints"] == 1  # (the shared system prompt)
    caches = last["bytes"] - last["index_bytes"]  # (the packed token keys and trie: Python's heap)
    assert caches <= 4 * BOUND + BOUND, last
    assert caches / 4 <= BOUND * 1.25, last  # (the system prompt's share)
    assert 0 < last["index_bytes"] <= 16 * 4 * 1000, last  # (about 6 B per stored token)
    grew = [b["process"]["active_bytes"] - a["process"]["active_bytes"] for a, b in zip(seen, seen[1:])]
    counted = [(b["bytes"] - b["index_bytes"]) - (a["bytes"] - a["index_bytes"])
               for a, b in zip(seen, seen[1:])]
    for g, c in zip(grew, counted):
        assert c > 0 and abs(g - c) <= 0.1 * c, (grew, counted)


def test_the_greedy_answer_to_a_long_prompt_equals_qfilters_mlx_generate(model_path, tmp_path):
    """The shipped long prompt (~2,300 tokens: longer than the budget and the 2,048-token
    prefill step) at budget 64: the server (batched, mlx-lm's BatchGenerator) and
    ``qfilters-mlx generate`` (mlx-lm's stream_generate) give the same greedy text."""
    from qfilters_mlx.assets.prompts import long_prompt

    n = 24
    run = subprocess.run([sys.executable, "-m", "qfilters_mlx.commands.cli", "generate", "--model",
                          str(model_path), "--budget", str(BUDGET), "--max-tokens", str(n),
                          "--verbose", "False"], env=_env(), capture_output=True, text=True,
                         timeout=900, check=True)
    library = run.stdout.strip()
    server = _server(model_path, tmp_path / "server.log")
    try:
        body = {"messages": [{"role": "user", "content": long_prompt()}], "max_tokens": n,
                "temperature": 0.0}
        status, reply = post_json(server.port, CHAT, body, timeout=900)
    finally:
        server.stop()
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] > 2048 + BUDGET
    assert library and answer(reply).strip() == library


def test_a_prompt_edited_near_its_end_gets_the_same_greedy_answer_warm_and_cold(model_path, tmp_path):
    """A chat prompt 40 tokens past the 2,048-token prefill step (its last prefill call is short
    enough for the stored answer's journal to reach into it), answered; then the same prompt
    with its last words edited. The warm server (the first conversation stored) answers the
    edit as a fresh server does (it rewinds to the call boundary at 2,048 tokens, never into
    the recorded call), and reuses those 2,048 tokens."""
    from mlx_lm.utils import load_tokenizer

    from qfilters_mlx.assets.prompts import source_text

    tok = load_tokenizer(model_path)
    system = {"role": "system", "content": "Answer in one sentence."}
    ask = " What is this text about?"
    over = len(tok.apply_chat_template([system, {"role": "user", "content": ask}],
                                       add_generation_prompt=True))
    ids = tok.encode(source_text(), add_special_tokens=False)[: 2048 + 40 - over]
    text = tok.decode(ids)
    edited = text[:-30] + " (the last words were edited)"
    first = [system, {"role": "user", "content": text + ask}]
    second = [system, {"role": "user", "content": edited + ask}]

    def ask_(port, messages):
        status, reply = post_json(port, CHAT, {"messages": messages, "max_tokens": 12,
                                               "temperature": 0.0}, timeout=900)
        assert status == 200, reply
        return answer(reply), reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    answers = {}
    for name in ("warm", "cold"):
        server = _server(model_path, tmp_path / f"{name}.log")
        try:
            if name == "warm":
                ask_(server.port, first)
            answers[name] = ask_(server.port, second)
        finally:
            server.stop()
    assert answers["warm"][0] == answers["cold"][0]
    assert answers["warm"][1] == 2048 and answers["cold"][1] == 0
