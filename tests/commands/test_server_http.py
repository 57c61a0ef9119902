"""The HTTP edges of ``qfilters-mlx server`` (``commands/server_http.py``), on 127.0.0.1 with a
generator stand-in (no model): what a client reads for each way a request can go wrong.

The rules written out here: a POST body must be ``application/json`` (415) and arrive within
the body deadline (408); a request's ``Host`` is a loopback name or an allowed one (403); an
oversized body's 413 (and a 415) is read by a client still sending its body; connections
beyond the cap get 503; every error after admission is OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``); a non-streaming generation is stopped
when its client leaves; the handler answers 500 instead of dying.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from types import SimpleNamespace

import mlx_lm.server as mlx_server
import pytest

from qfilters_mlx.commands.server_http import client_gone, handler_class
from qfilters_mlx.commands.server_requests import Served

GOOD = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
ERROR_KEYS = {"message", "type", "param", "code"}


class Generator:
    """Stands in for mlx-lm's ``ResponseGenerator``: ``tokens`` yields the reply (an
    exception instance in it is raised), after ``delay`` seconds per token."""

    cli_args = SimpleNamespace(allowed_origins=[], num_draft_tokens=3, max_tokens=8, temp=0.0,
                               top_p=1.0, top_k=0, min_p=0.0, model=None)

    def __init__(self, tokens=("Hi",), delay=0.0, served=None):
        self.model_provider = SimpleNamespace(served=served or Served(vocab_size=100))
        self.tokens, self.delay = tokens, delay
        self.stopped = threading.Event()

    def generate(self, request, args, progress_callback=None):
        from mlx_lm.generate import TextStateMachine

        if isinstance(self.tokens, Exception):
            raise self.tokens
        ctx = SimpleNamespace(tool_parser=None, text_sm=TextStateMachine({"normal": []}),
                              initial_state="normal", prompt=[1, 2], prompt_cache_count=0,
                              stop=self.stopped.set)

        def tokens():
            for t in self.tokens:
                if self.stopped.is_set():
                    return
                time.sleep(self.delay)
                if isinstance(t, Exception):
                    raise t
                yield mlx_server.Response(t, 5, -0.1, None, ())
            yield mlx_server.Response("", 5, -0.1, "length", ())

        return ctx, tokens()


@pytest.fixture
def serve():
    servers = []

    def start(gen=None, **limits):
        gen = gen or Generator()
        handler = handler_class(mlx_server, limits.pop("max_body_bytes", 1 << 20), **limits)
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(gen, *a))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return httpd.server_address[1], gen

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def _post(port, body=GOOD, headers=None, path="/v1/chat/completions", timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                       **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _openai_error(raw, status):
    err = json.loads(raw)["error"]
    assert set(err) == ERROR_KEYS and err["code"] == status and isinstance(err["message"], str)
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


@pytest.mark.parametrize("ctype,status", [("application/json", 200),
                                          ("application/json; charset=utf-8", 200),
                                          ("Application/JSON", 200), ("text/plain", 415),
                                          ("application/x-www-form-urlencoded", 415),
                                          ("multipart/form-data; boundary=x", 415), (None, 415)])
def test_a_post_body_must_be_json_by_content_type(serve, ctype, status):
    """A web page can POST ``text/plain`` (or a form) to 127.0.0.1 without a CORS preflight."""
    port, _ = serve()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    if ctype is not None:
        conn.putheader("Content-Type", ctype)
    conn.putheader("Content-Length", str(len(GOOD)))
    conn.endheaders()
    conn.send(GOOD)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    assert r.status == status, raw
    if status != 200:
        assert _openai_error(raw, 415)["param"] == "Content-Type"


@pytest.mark.parametrize("host,allowed,status", [
    ("127.0.0.1:8080", "", 200), ("localhost", "", 200), ("[::1]:8080", "", 200),
    ("127.5.6.7", "", 200), ("app.localhost:80", "", 200),
    ("evil.example", "", 403), ("evil.example:8080", "", 403), ("127.0.0.1.evil.example", "", 403),
    ("10.0.0.5:8080", "", 403), ("myhost:8080", "myhost", 200), ("evil.example", "*", 200),
])
def test_host_is_a_loopback_name_or_an_allowed_one(serve, host, allowed, status):
    """DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 sends its own
    name as ``Host``; refused (403) for POST and GET unless the operator allows it."""
    hosts = {h for h in allowed.split(",") if h}
    port, _ = serve(Generator(served=Served(vocab_size=100, allowed_hosts=hosts)))
    status_post, raw = _post(port, headers={"Host": host})
    assert status_post == status, raw
    if status != 200:
        assert _openai_error(raw, 403)["param"] == "Host"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Host": host})
    r = conn.getresponse()
    r.read()
    conn.close()
    assert (r.status == 403) == (status == 403)


@pytest.mark.parametrize("ctype", ["application/json", "text/plain"])
def test_a_refused_body_still_being_sent_gets_its_answer_read(serve, ctype):
    """A 3 MiB body over a 1 MiB limit (413) or of the wrong type (415): the client, still
    sending when the server answers, reads the answer instead of a reset connection."""
    port, _ = serve(max_body_bytes=1 << 20)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (3 << 20)}]}).encode()
    for _ in range(3):
        status, raw = _post(port, body=body, headers={"Content-Type": ctype})
        want = 413 if ctype == "application/json" else 415
        assert status == want, raw
        _openai_error(raw, want)
    assert _post(port)[0] == 200


def test_a_slow_body_gets_408_after_the_body_deadline(serve):
    port, _ = serve(body_timeout=1.0)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    t = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    for _ in range(4):  # a byte every 0.5 s: each read is quick, the whole body is not
        time.sleep(0.5)
        try:
            sock.sendall(b" ")
        except OSError:
            break
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    assert data.startswith(b"HTTP/1.0 408") or data.startswith(b"HTTP/1.1 408"), data[:80]
    _openai_error(data.split(b"\r\n\r\n", 1)[1], 408)
    assert time.monotonic() - t < 10


def test_connections_beyond_the_cap_get_503_and_the_rest_are_served(serve):
    port, _ = serve(max_connections=2)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    time.sleep(0.3)  # (both are being served: waiting for their request line)
    status, raw = _post(port)
    assert status == 503, raw
    assert _openai_error(raw, 503)["param"] == "connections"
    for s in idle:
        s.close()
    time.sleep(0.3)
    assert _post(port)[0] == 200


@pytest.mark.parametrize("error,status", [(ValueError("bad stop word"), 400),
                                          (RuntimeError("generation thread died"), 503),
                                          (MemoryError("out of memory"), 500)])
def test_every_error_after_admission_is_openais_error_object(serve, error, status):
    port, _ = serve(Generator(tokens=error))
    got, raw = _post(port)
    assert got == status
    assert str(error) in _openai_error(raw, status)["message"]
    got, raw = _post(port, body=json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                            "stream": True}).encode())
    assert got == status  # (failed before the stream started: an HTTP error)
    _openai_error(raw, status)


def test_mlx_lms_own_error_replies_become_openais_error_object(serve, monkeypatch):
    """An error mlx-lm's handler writes itself (``{"error": "<text>"}``, here its parameter
    validation) goes out as OpenAI's error object."""
    def refuse(self):
        raise ValueError("refused by mlx-lm")

    monkeypatch.setattr(mlx_server.APIHandler, "validate_model_parameters", refuse)
    port, _ = serve()
    status, raw = _post(port)
    assert status == 400 and _openai_error(raw, 400)["message"] == "refused by mlx-lm"


def test_a_non_streaming_generation_stops_when_its_client_leaves(serve):
    gen = Generator(tokens=["tok"] * 10_000, delay=0.01)
    port, _ = serve(gen)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(GOOD) + GOOD)
    time.sleep(0.5)
    sock.close()
    assert gen.stopped.wait(10)  # (ctx.stop(): mlx-lm's loop drops the request)
    assert _post(port)[0] == 200  # (a stand-in with a fresh reply)


def test_client_gone_reads_a_closed_peer_and_never_blocks():
    a, b = socket.socketpair()
    assert not client_gone(a)
    b.sendall(b"more")  # (a pipelined request: still there)
    assert not client_gone(a)
    b.close()
    a.recv(4)
    assert client_gone(a)
    a.close()


def test_the_handler_answers_500_instead_of_dying(serve, monkeypatch):
    def boom(self, *a, **k):
        raise TypeError("'>' not supported between instances of 'int' and 'NoneType'")

    monkeypatch.setattr(mlx_server.APIHandler, "handle_completion", boom)
    port, _ = serve()
    status, raw = _post(port)
    assert status == 500 and _openai_error(raw, 500)["param"] is None
    monkeypatch.undo()
    assert _post(port)[0] == 200
