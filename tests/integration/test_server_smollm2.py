"""``qfilters-mlx server`` end to end with SmolLM2: concurrent chat requests equal a sequential
run, a follow-up turn reuses the stored cache, the log reports kept tokens / KV bytes.

The server is a subprocess on 127.0.0.1 and a free port; every request and the
start have hard timeouts, and the server is stopped (terminate, then kill) in all cases.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.integration

START_TIMEOUT = 600  # (the first start may calibrate the default filter: minutes under load)
REQUEST_TIMEOUT = 120
MAX_TOKENS = 12
# Budget 64 against ~100-token prompts: every request evicts.
CACHE_FLAGS = ["--budget", "64", "--n-sink", "4", "--recent", "16", "--calib-tokens", "32"]
QUESTIONS = [
    "Name three primary colors and explain why they are called primary, in detail please.",
    "What is the capital of France? Tell me about its history, its river and its museums.",
    "Describe how a bicycle works: pedals, chain, gears, brakes, wheels and the frame.",
    "Why is the sky blue? Explain Rayleigh scattering to a curious ten year old child.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, messages):
    body = json.dumps({"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        return json.loads(r.read())


def _chat(q):
    return [{"role": "system", "content": "You are a helpful assistant. " * 8},
            {"role": "user", "content": q}]


class Server:
    def __init__(self, model_path, log_path, extra=()):
        self.port = _free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qfilters_mlx.commands.cli", "server", "--model", str(model_path),
             "--port", str(self.port), *CACHE_FLAGS, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(log_path).read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError("server did not start")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.log.close()


def test_server_concurrent_equals_sequential_and_reuses_cache(model_path, tmp_path):
    log = tmp_path / "server.log"
    server = Server(model_path, log, ["--decode-concurrency", "4", "--prompt-concurrency", "4"])
    try:
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            concurrent = list(pool.map(lambda q: _post(server.port, _chat(q)), QUESTIONS))
        first = concurrent[0]["choices"][0]["message"]["content"]
        follow = _chat(QUESTIONS[0]) + [{"role": "assistant", "content": first},
                                         {"role": "user", "content": "Say it shorter."}]
        reply = _post(server.port, follow)
    finally:
        server.stop()
    text = log.read_text()
    assert "qfilters-mlx server: KV cache method=qfilters budget=64 n_sink=4" in text
    assert "request done:" in text and "kept per layer" in text
    assert "64 kept per layer" in text  # evicted down to the budget
    cached = reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached > 0, reply["usage"]

    # Sequential reference: a fresh server answering one request at a time.
    seq = Server(model_path, tmp_path / "seq.log", ["--decode-concurrency", "1",
                                                    "--prompt-concurrency", "1"])
    try:
        sequential = [_post(seq.port, _chat(q)) for q in QUESTIONS]
    finally:
        seq.stop()
    for a, b in zip(concurrent, sequential):
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
