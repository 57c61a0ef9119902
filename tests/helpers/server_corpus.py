"""Bad-input corpus for an OpenAI-style completion server, and a server subprocess helper.

Used by the integration test (``tests/integration/test_server_corpus.py``, against
``qfilters-mlx server``) and by ``bench/bench_server_soak.py`` (the same corpus against
``mlx_lm.server`` recorded beside ours). Each :class:`Case` is one raw HTTP request with the
status ``qfilters-mlx server`` must answer: 400 for a bad field (the error names it), 404 for
an unknown path, 411/413 for a missing or huge ``Content-Length``, 415 for a body that is not
``application/json``, 403 for a ``Host`` that is not the server's. The kinds: every field of
the chat and completions bodies with a wrong type and an out-of-range value, names of other
models / draft models / adapters (the path exists or not: same answer), bodies that are not
UTF-8, not JSON, not an object, nested 100k deep, announced as 10**12 bytes or sent over the
limit, strings the chat template renders (roles, names, tools, template arguments) over the
character limit, ``max_tokens`` over the context left by the prompt.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
GOOD_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GOOD_CHAT = {"messages": GOOD_MESSAGES, "max_tokens": 4, "temperature": 0.0}


@dataclass
class Case:
    """One request: ``raw`` body bytes (``None``: no body), extra ``headers``; ``status`` is
    what qfilters-mlx server answers and ``param`` the field its error names (if any)."""

    name: str
    path: str
    raw: bytes | None
    status: int
    param: str | None = None
    headers: dict = field(default_factory=dict)
    method: str = "POST"


def _chat(name, status, param, **fields):
    body = {"messages": GOOD_MESSAGES, "max_tokens": 4, **fields}
    return Case(name, CHAT, json.dumps(body).encode(), status, param)


def _text(name, status, param, **fields):
    body = {"prompt": "Once upon a time", "max_tokens": 4, **fields}
    return Case(name, TEXT, json.dumps(body).encode(), status, param)


# field -> bad values (wrong types and out-of-range), each sent in a chat body
FIELD_VALUES = {
    "stream": ["yes", 1],
    "stream_options": ["x", {"include_usage": "yes"}],
    "model": [5, "/etc/passwd", "gpt-3.5-turbo", "/no/such/path"],
    "draft_model": [7, "/tmp", "/no/such/draft"],
    "adapters": [3, "/tmp", "/no/such/adapters"],
    "num_draft_tokens": [-1, "3", 1000],
    "n": [2, 0, "1"],
    "max_tokens": [0, -5, "10", 1.5, True, 2**40],
    "max_completion_tokens": [0, "x"],
    "temperature": [-1, "hot", float("inf"), [0.5]],
    "top_p": [1.5, -0.1, "x"],
    "top_k": [-1, 10**9, 1.5, "5"],
    "min_p": [2, -1],
    "repetition_penalty": [-1, "x"],
    "repetition_context_size": [-1, 10**12],
    "presence_penalty": ["x", 1e6],
    "presence_context_size": [-3],
    "frequency_penalty": [[]],
    "frequency_context_size": [1.5],
    "xtc_probability": [2, "x"],
    "xtc_threshold": [1.5, -1],
    "logit_bias": [[], {"abc": 1}, {"999999999": 100}, {"-1": 5}, {"5": "x"}, {"5": 1e6}],
    "logprobs": ["yes", 1],
    "top_logprobs": [50, -2, "3"],
    "seed": [-1, "x", 1.5, 2**70],
    "stop": [123, [1, 2], [None], "", [""], ["a"] * 100],
    "chat_template_kwargs": ["x", 5],
    "tools": ["x", [1]],
    "role_mapping": ["x", {"user": 5}],
}

BAD_MESSAGES = {
    "missing": None,
    "empty": [],
    "string": "hi",
    "number-item": [1],
    "no-role": [{"content": "x"}],
    "number-role": [{"role": 5, "content": "x"}],
    "number-content": [{"role": "user", "content": 5}],
    "http-image": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}],
    "text-part-without-text": [{"role": "user", "content": [{"type": "text"}]}],
    "audio-part": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
    "bad-tool-call": [{"role": "assistant", "content": "", "tool_calls": [{"function": 5}]},
                      {"role": "user", "content": "x"}],
    "tool-call-arguments-not-json": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
        {"role": "user", "content": "x"}],
}


def cases() -> list[Case]:
    """The corpus, in a fixed order."""
    out = []
    for name, values in FIELD_VALUES.items():
        for i, v in enumerate(values):
            case = _chat(f"chat.{name}[{i}]={json.dumps(v)[:24]}", 400, name, **{name: v})
            if isinstance(v, float) and not math.isfinite(v):
                case.param = "body"  # sent as the literal Infinity
            out.append(case)
    for name, msgs in BAD_MESSAGES.items():
        body = {"max_tokens": 4} if msgs is None else {"messages": msgs, "max_tokens": 4}
        out.append(Case(f"chat.messages.{name}", CHAT, json.dumps(body).encode(), 400, "messages"))
    for name in ("temperature", "top_k", "logit_bias", "stop", "seed", "max_tokens"):
        out.append(_text(f"text.{name}={json.dumps(FIELD_VALUES[name][0])[:24]}", 400, name,
                         **{name: FIELD_VALUES[name][0]}))
    for name, prompt in (("missing", None), ("number", 5), ("empty", ""), ("token-list", [1, 2, 3])):
        body = {"max_tokens": 4} if prompt is None else {"prompt": prompt, "max_tokens": 4}
        out.append(Case(f"text.prompt.{name}", TEXT, json.dumps(body).encode(), 400, "prompt"))
    base = json.dumps({"messages": GOOD_MESSAGES, "max_tokens": 4})
    out += [
        Case("body.nan-temperature", CHAT, base[:-1].encode() + b', "temperature": NaN}', 400, "body"),
        Case("body.infinity-top-p", CHAT, base[:-1].encode() + b', "top_p": Infinity}', 400, "body"),
        Case("body.overflowing-temperature", CHAT, base[:-1].encode() + b', "temperature": 1e999}', 400,
             "temperature"),
        Case("body.not-json", CHAT, b"{not json", 400, "body"),
        Case("body.array", CHAT, b"[1, 2]", 400, "body"),
        Case("body.string", TEXT, b'"hello"', 400, "body"),
        Case("body.null", TEXT, b"null", 400, "body"),
        Case("body.not-utf8", CHAT, b'{"messages": "\xff\xfe"}', 400, "body"),
        Case("body.nested-100k", TEXT, b"[" * 100_000 + b"]" * 100_000, 400, "body"),
        Case("body.nested-object-100k", CHAT, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400, "body"),
        Case("header.content-length-1e12", CHAT, None, 413, "body",
             headers={"Content-Length": str(10**12)}),
        Case("header.content-length-missing", CHAT, None, 411, "Content-Length"),
        Case("header.content-length-not-a-number", CHAT, None, 400, "Content-Length",
             headers={"Content-Length": "abc"}),
        Case("path.unknown", "/v1/embeddings", b"{}", 404),
        Case("body.integer-5000-digits", CHAT, base[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}",
             400, "body"),
        Case("body.integer-100-digits", TEXT, b'{"prompt": "x", "max_tokens": ' + b"1" * 100 + b"}",
             400, "body"),
        _chat("chat.chat_template=client", 400, "chat_template",
              chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"),
        _chat("chat.chat_template_kwargs.chat_template", 400, "chat_template_kwargs",
              chat_template_kwargs={"chat_template": "{{ messages }}"}),
        _chat("chat.chat_template_kwargs.tokenize", 400, "chat_template_kwargs",
              chat_template_kwargs={"tokenize": False}),
        _chat("chat.stop.too-long", 400, "stop", stop="s" * 300),
        Case("chat.messages.too-many", CHAT, json.dumps(
            {"messages": [{"role": "user", "content": "x"}] * 5000, "max_tokens": 4}).encode(),
            400, "messages"),
        # (refused after tokenization, by the generation side: over the model's 8,192 tokens)
        Case("text.prompt.over-the-context", TEXT, json.dumps(
            {"prompt": "seven " * 9000, "max_tokens": 4}).encode(), 400, None),
        Case("after-tokenization.max_tokens.over-context-minus-prompt", CHAT, json.dumps(
            {"messages": GOOD_MESSAGES, "max_tokens": 8190}).encode(), 400, "max_tokens"),
        # every string the template renders counts toward the character limit (64 per token
        # of the 8,192-token context: 524,288)
        Case("chat.messages.huge-role", CHAT, json.dumps(
            {"messages": [{"role": "r" * 600_000, "content": "x"}], "max_tokens": 4}).encode(),
            400, "messages"),
        Case("chat.messages.huge-name", CHAT, json.dumps(
            {"messages": [{"role": "user", "name": "n" * 600_000, "content": "x"}],
             "max_tokens": 4}).encode(), 400, "messages"),
        _chat("chat.tools.huge-description", 400, "messages", tools=[
            {"type": "function", "function": {"name": "f", "description": "d" * 600_000}}]),
        _chat("chat.chat_template_kwargs.huge-value", 400, "messages",
              chat_template_kwargs={"enable_thinking": "t" * 600_000}),
        # transport: what a web page can send to 127.0.0.1, and a body sent over the limit
        Case("header.content-type-text-plain", CHAT, json.dumps(GOOD_CHAT).encode(), 415,
             "Content-Type", headers={"Content-Type": "text/plain"}),
        Case("header.content-type-form", CHAT, b"messages=x", 415, "Content-Type",
             headers={"Content-Type": "application/x-www-form-urlencoded"}),
        Case("header.host-rebound", CHAT, json.dumps(GOOD_CHAT).encode(), 403, "Host",
             headers={"Host": "evil.example:8080"}),
        Case("body.sent-over-the-limit", CHAT, json.dumps(
            {"messages": [{"role": "user", "content": "x" * (9 << 20)}]}).encode(), 413, "body"),
    ]
    return out


# ------------------------------------------------------------------ HTTP
def send(port: int, case: Case, timeout: float = 60.0) -> tuple[int | None, bytes]:
    """Send ``case`` on a fresh connection: ``(status, body)``, or ``(None, b"<why>")`` when the
    server closed the connection or timed out without an answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", **case.headers}
        conn.putrequest(case.method, case.path, skip_accept_encoding=True,
                        skip_host="Host" in headers)
        if case.raw is not None and "Content-Length" not in headers:
            headers["Content-Length"] = str(len(case.raw))
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        if case.raw is not None:
            conn.send(case.raw)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException) as err:
        return None, f"{type(err).__name__}: {err}".encode()
    finally:
        conn.close()


def post_json(port: int, path: str, body: dict, timeout: float = 120.0) -> tuple[int | None, dict]:
    """POST ``body``: ``(status, decoded JSON answer)`` (``{}`` if not JSON; status ``None``: no answer)."""
    status, raw = send(port, Case("", path, json.dumps(body).encode(), 0), timeout)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"raw": raw[:200].decode(errors="replace")}


def get_json(port: int, path: str, timeout: float = 10.0) -> tuple[int | None, dict]:
    status, raw = send(port, Case("", path, None, 0, method="GET"), timeout)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {}


def answer(reply: dict) -> str | None:
    """The text of a chat completion reply (``None`` if it has none)."""
    try:
        return reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess (``argv`` + ``--port``) on 127.0.0.1, up once ``/health`` answers 200.

    Raises:
        RuntimeError: it exited during the start (its log's tail in the message).
        TimeoutError: no 200 from ``/health`` within ``start_timeout`` seconds.
    """

    def __init__(self, argv, log_path, env=None, start_timeout=180.0):
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env or dict(os.environ),
                                     start_new_session=True)
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"server exited ({self.proc.returncode}): "
                                   f"{open(log_path).read()[-3000:]}")
            status, _ = get_json(self.port, "/health", timeout=5)
            if status == 200:
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("server did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        """Resident memory of the server process (``/proc``), MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.log.close()
