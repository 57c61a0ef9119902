"""The HTTP side of ``qfilters-mlx server``: mlx-lm's handler and generation loop, made to
survive their users (subclasses of ``mlx_lm.server.APIHandler`` and ``ResponseGenerator``).

* :func:`handler_class`: every request's ``Host`` is checked (403); every POST body is
  type-checked (``application/json``: 415), size-checked, read within the body deadline
  (408), parsed and checked (:mod:`.server_requests`) before mlx-lm's own ``do_POST``
  sees it; errors are 4xx naming the field (413 over ``--max-body-bytes``, 411 without
  Content-Length, 400 for the rest), and a refused body still being sent is read and
  dropped so that the client reads the answer; connections beyond the cap get 503; an
  error from the generation loop is 400 when the request caused it, 503 when no
  generation loop runs, 500 otherwise (mlx-lm answers 404 to all of them). Every error is
  OpenAI's error object (:func:`error_body`), mlx-lm's own included. A request that fails
  after it was admitted still gets its error: a non-streaming reply is generated whole
  before its status is sent (an HTTP error, never an empty 200; stopped when its client
  leaves), a streaming one ends with an SSE ``error`` event. The handler answers 500
  rather than die. ``/health`` adds the stored
  conversations (count, bytes as held at rest, rows per layer), the process's memory
  (MLX's active bytes, RSS) and the generation loop's restarts.
* :func:`generator_class`: the served model is loaded in the generation thread before
  the server answers (a load error, e.g. a bad ``--filters`` file, stops the start);
  the generation loop restarts after an exception that escaped mlx-lm's handling
  (in-flight requests get a 500), instead of dying and leaving every later request a
  "generation thread died"; a prompt over ``Served.max_prompt_tokens`` is refused (400)
  before any of it is processed, and ``max_tokens`` is capped at the context left by the
  prompt (:func:`_cap_max_tokens`); a prompt is cut at every multiple of ``--prefill-step-size``
  (:func:`~.server_cache.prefill_segments`), so it is prefilled in the calls
  ``mlx_lm.generate`` makes.

Imported lazily (it imports ``mlx_lm.server``, which imports MLX).
"""

from __future__ import annotations

import io
import json
import logging
import select
import socket
import threading
import time
import weakref
from collections import deque

from qfilters_mlx.commands.server_cache import prefill_segments
from qfilters_mlx.commands.server_requests import (MAX_BODY_BYTES, RequestError, check_body,
                                                   check_content_type, check_host, parse_body)

__all__ = ["BODY_TIMEOUT_S", "GenerationFailed", "MAX_CONNECTIONS", "client_gone", "error_body",
           "error_status", "generator_class", "handler_class"]

MAX_CONNECTIONS = 64
"""Default most connections served at once (``--max-connections``); more get 503."""

BODY_TIMEOUT_S = 60.0
"""Default seconds a client has to send a request body (``--body-timeout``); slower: 408."""

DRAIN_BYTES, DRAIN_S = 64 << 20, 5.0
"""After refusing a request whose body was not read (413, 415, 503), at most this many bytes
of it are read and dropped within this many seconds, so that the client, still sending, gets
to read the answer (closing with unread data resets the connection)."""

RESTARTS_ALLOWED = 5
RESTART_WINDOW_S = 30.0
"""The loop gives up (``/health`` 503, as mlx-lm's dead thread) after this many failures within
this many seconds: a fault that every pass hits is not retried forever."""

ENDPOINTS = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}


class _StreamFailed(Exception):
    """A streamed reply failed after its 200 was sent; its error event is written."""


class GenerationFailed(RuntimeError):
    """The generation loop failed while this request was in flight (the loop restarted)."""


class _Answered(BaseException):
    """The request's error reply is written (a BaseException: mlx-lm's ``except Exception``
    around the generator does not answer it again)."""


class _ClientGone(BaseException):
    """The client of a non-streaming request closed its connection; its generation stopped."""


def client_gone(sock) -> bool:
    """Whether the peer of connected socket ``sock`` closed it (readable with nothing to read,
    or an error); never blocks."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}`` (type
    ``invalid_request_error`` below 500, ``server_error`` from 500; ``code`` the HTTP status)."""
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500
                      else "server_error", "param": param, "code": status}}


def error_status(err: BaseException) -> int:
    """HTTP status of an error raised for a request by the generation side: 400 for what the
    request's contents caused (bad values, a chat template refusing the messages), 503 when
    no generation loop runs, 500 for the server's own faults."""
    if isinstance(err, RequestError):
        return err.status
    if isinstance(err, GenerationFailed):
        return 500
    if isinstance(err, RuntimeError) and "generation thread died" in str(err):
        return 503
    if isinstance(err, (ValueError, TypeError, KeyError, IndexError, RequestError)):
        return 400
    if any(k.__module__.startswith("jinja2") for k in type(err).__mro__):
        return 400  # the chat template failed on the messages (or a client's template failed)
    return 500


class _Reply:
    """The generation loop's end of a request's reply queue: marks the put of ``None`` (the
    request is done) on the generator, so that the cache stored right after it is logged once."""

    def __init__(self, queue, owner):
        self._queue, self._owner = queue, owner

    def put(self, item):
        if item is None:
            self._owner.prompt_cache.finishing = True
        self._queue.put(item)


def _cap_max_tokens(args, prompt_tokens: int, served, default: int, field: str) -> None:
    """``args.max_tokens`` at most the model's context minus the prompt and the operator's
    ``--max-tokens-limit``: a request asking more is refused (400 naming the cap); one that
    asked nothing (``None``, set by the handler) gets the server's default within the cap."""
    caps = []
    context = getattr(served, "context", None)
    if context is not None:
        if prompt_tokens >= context:
            raise RequestError(field, f"the prompt is {prompt_tokens} tokens: it leaves no room "
                                      f"to answer in the model's context of {context}")
        caps.append(context - prompt_tokens)
    limit = getattr(served, "max_tokens_limit", None)
    if limit is not None:
        caps.append(limit)
    cap = min(caps) if caps else None
    if args.max_tokens is None:
        args.max_tokens = default if cap is None else min(default, cap)
    elif cap is not None and args.max_tokens > cap:
        raise RequestError("max_tokens", f"at most {cap} for this prompt ({prompt_tokens} tokens; "
                                         f"the model's context {context}, server flag "
                                         f"--max-tokens-limit {limit}), got {args.max_tokens}")


def generator_class(server):
    """``mlx_lm.server.ResponseGenerator`` whose loop restarts after an uncaught exception,
    that refuses prompts over the served limit and cuts prompts at every multiple of the
    prefill step (see the module docstring)."""

    class RestartingResponseGenerator(server.ResponseGenerator):
        """mlx-lm's generator; its loop never dies from one request (see the module docstring).

        Attributes:
            loop_restarts: how many times the loop failed and was restarted.
        """

        def __init__(self, model_provider, prompt_cache):
            self._in_flight = weakref.WeakSet()
            self.loop_restarts = 0
            self._loaded = threading.Event()
            self._load_error = None
            limit = getattr(model_provider.cli_args, "prompt_cache_bytes", None)
            if limit is not None and hasattr(prompt_cache, "stored_stats"):
                prompt_cache.max_bytes = int(limit)  # (checked at every insert)
            if hasattr(prompt_cache, "prefill_step"):
                prompt_cache.prefill_step = int(model_provider.cli_args.prefill_step_size or 0)
            super().__init__(model_provider, prompt_cache)
            self._loaded.wait()
            if self._load_error is not None:  # the served model or its --filters: no server
                self.join()
                raise self._load_error

        def _tokenize(self, tokenizer, request, args):
            field = "messages" if request.request_type == "chat" else "prompt"
            try:  # (rendering depends only on the request: a failure is the request's)
                prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
            except Exception as err:  # noqa: BLE001
                raise RequestError(field, f"the prompt could not be rendered: "
                                          f"{type(err).__name__}: {err}"[:500]) from err
            if not prompt:
                raise RequestError(field, "the prompt renders to no tokens")
            served = getattr(self.model_provider, "served", None)
            limit = getattr(served, "max_prompt_tokens", None)
            if limit is not None and len(prompt) > limit:
                raise RequestError(field, f"the prompt is {len(prompt)} tokens, over the limit of "
                                          f"{limit} (the model's context unless the server sets "
                                          "--max-prompt-tokens)")
            _cap_max_tokens(args, len(prompt), served, self.cli_args.max_tokens, field)
            if vision is None:  # (requests with images are served whole, without segments)
                segments, types = prefill_segments(segments, types, self.cli_args.prefill_step_size)
            return prompt, segments, types, state, vision

        def _next_request(self, timeout=None):
            request = super()._next_request(timeout)
            if request is None:
                return None
            self._in_flight.add(request[0])  # (weakly: the handler waiting on it holds it)
            return (_Reply(request[0], self), *request[1:])

        def _run_generate(self):
            try:  # in this thread: the arrays it loads belong to its MLX stream
                self.model_provider.load_default()
            except Exception as err:  # noqa: BLE001 (raised again in the starting thread)
                self._load_error = err
                self._generation_failed = True
                return
            finally:
                self._loaded.set()
            failures = deque(maxlen=RESTARTS_ALLOWED)
            while not self._stop:
                try:
                    self._generate()  # (its load_default finds the model loaded)
                    return
                except Exception as err:  # noqa: BLE001 (restart the loop; requests learn why)
                    self.loop_restarts += 1
                    failures.append(time.monotonic())
                    logging.exception(f"qfilters-mlx: generation loop failed ({err!r}); in-flight "
                                      f"requests get 500, the loop restarts "
                                      f"(restart {self.loop_restarts})")
                    for reply in list(self._in_flight):  # (a finished request's queue is unread)
                        reply.put(GenerationFailed(f"generation failed: {type(err).__name__}"))
                    self._in_flight = weakref.WeakSet()
                    if len(failures) == RESTARTS_ALLOWED and failures[-1] - failures[0] < RESTART_WINDOW_S:
                        logging.error(f"qfilters-mlx: {RESTARTS_ALLOWED} generation loop failures within "
                                      f"{RESTART_WINDOW_S:g} s: giving up (/health answers 503)")
                        self._generation_failed = True
                        return

    return RestartingResponseGenerator


def handler_class(server, max_body_bytes: int = MAX_BODY_BYTES, *,
                  max_connections: int = MAX_CONNECTIONS, body_timeout: float = BODY_TIMEOUT_S):
    """``mlx_lm.server.APIHandler`` that checks requests first (see the module docstring)."""
    slots = threading.BoundedSemaphore(max_connections)

    class _Generate:
        """The handler's view of the generator: remembers the status of the error it raised;
        a non-streaming reply is generated whole before the handler sends its status (and
        stopped when its client leaves), a streaming one that fails ends with an SSE error
        event (:class:`_StreamFailed`)."""

        def __init__(self, generator, handler):
            self._generator = generator
            self._handler = weakref.ref(handler)
            self.error_status = None

        def generate(self, request, args, progress_callback=None):
            handler = self._handler()
            streaming = getattr(handler, "stream", False)
            ctx = None

            def progress(*a):  # (called while the prompt is processed)
                if not streaming and ctx is not None and client_gone(handler.connection):
                    ctx.stop()
                    raise _ClientGone()
                if progress_callback is not None:
                    progress_callback(*a)

            try:
                ctx, response = self._generator.generate(request, args, progress_callback=progress)
                if not streaming:
                    return ctx, iter(self._whole(ctx, response, handler))
            except Exception as err:
                self.error_status = error_status(err)
                handler._error(self.error_status, err)
                raise _Answered() from err
            return ctx, self._streamed(response, handler)

        @staticmethod
        def _whole(ctx, response, handler):
            """Every item of a non-streaming reply (errors raise here, before any status);
            the generation is stopped once the client has left (:class:`_ClientGone`)."""
            out, checked = [], time.monotonic()
            for item in response:
                out.append(item)
                if time.monotonic() - checked > 0.1:
                    checked = time.monotonic()
                    if client_gone(handler.connection):
                        ctx.stop()
                        raise _ClientGone()
            return out

        def _streamed(self, response, handler):
            try:
                yield from response
            except Exception as err:  # noqa: BLE001 (the client learns it; the reply ends)
                handler._stream_error(error_status(err), err)
                raise _StreamFailed() from err

        def __getattr__(self, name):
            return getattr(self._generator, name)

    class _OpenAIErrors(io.RawIOBase):
        """The handler's ``wfile`` while mlx-lm's ``do_POST`` runs: an error body mlx-lm writes
        itself (``{"error": "<text>"}``) goes out as OpenAI's error object."""

        def __init__(self, handler, raw):
            self._handler, self._raw = handler, raw

        def write(self, data):
            if data[:10] == b'{"error": ' and self._handler._status >= 400:
                try:
                    text = json.loads(data).get("error")
                except ValueError:
                    text = None
                if isinstance(text, str):
                    data = json.dumps(error_body(self._handler._status, text)).encode()
            return self._raw.write(data)

        def flush(self):
            return self._raw.flush()

        def writable(self):
            return True

    class CheckingAPIHandler(server.APIHandler):
        """mlx-lm's handler behind :func:`parse_body` / :func:`check_body`."""

        timeout = 120  # seconds a client may stall while the request line and headers are read
        _status = 200

        def __init__(self, response_generator, *args, **kwargs):
            super().__init__(_Generate(response_generator, self), *args, **kwargs)

        def handle(self):
            if not slots.acquire(blocking=False):  # over --max-connections: 503, then close
                try:
                    self.raw_requestline = self.rfile.readline(65537)
                    if self.raw_requestline and self.parse_request():
                        self._refuse(RequestError("connections", f"{max_connections} connections "
                                                  "are open, the most this server serves at once "
                                                  "(server flag --max-connections)", 503))
                except OSError:
                    pass
                self.close_connection = True
                return
            try:
                super().handle()
            finally:
                slots.release()

        def send_response(self, code, message=None):
            self._status = code
            super().send_response(code, message)

        def handle_completion(self, request, stop_words):
            if "max_tokens" not in self.body and "max_completion_tokens" not in self.body:
                self.max_tokens = None  # (the server's default within the cap: _cap_max_tokens)
            try:
                return super().handle_completion(request, stop_words)
            except (_StreamFailed, _Answered):
                self.close_connection = True  # (the error was the reply's last)
            except _ClientGone:
                logging.info("qfilters-mlx: the client left before its reply; generation stopped")
                self.close_connection = True

        def _stream_error(self, status: int, err) -> None:
            """Write an SSE ``error`` event (OpenAI's shape) on a stream that already sent 200."""
            logging.warning(f"qfilters-mlx: a streamed reply failed after it started: {err!r}")
            payload = error_body(status, str(err), getattr(err, "field", None))
            try:
                self.wfile.write(f"event: error\ndata: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()
            except OSError:
                pass  # (the client is gone)

        def _error(self, status: int, err) -> None:
            data = json.dumps(error_body(status, str(err), getattr(err, "field", None))).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self._set_cors_headers()
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
            except OSError:
                self.close_connection = True  # (the client is gone)

        def _refuse(self, err) -> None:
            """Answer ``err`` to a request whose body is not read, then read and drop what the
            client still sends (at most :data:`DRAIN_BYTES` within :data:`DRAIN_S`), so that it
            reads the answer instead of a reset connection."""
            self.close_connection = True
            self._error(err.status, err)
            try:
                self.connection.shutdown(socket.SHUT_WR)
                deadline, left = time.monotonic() + DRAIN_S, DRAIN_BYTES
                while left > 0 and time.monotonic() < deadline:
                    self.connection.settimeout(max(0.05, deadline - time.monotonic()))
                    chunk = self.rfile.read1(min(left, 1 << 16))
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:
                pass

        def _set_completion_headers(self, status_code: int = 200):
            # mlx-lm answers every error of the generation side with 404
            if status_code == 404 and self.response_generator.error_status is not None:
                status_code = self.response_generator.error_status
            super()._set_completion_headers(status_code)

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError("Content-Length", "the header is required", 411)
            try:
                length = int(length)
            except ValueError:
                raise RequestError("Content-Length", "not an integer") from None
            if length < 0:
                raise RequestError("Content-Length", "negative")
            if length > max_body_bytes:
                raise RequestError("body", f"{length} bytes is over the limit of {max_body_bytes} "
                                           "(server flag --max-body-bytes)", 413)
            deadline, parts, got = time.monotonic() + body_timeout, [], 0
            try:
                while got < length:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise socket.timeout()
                    self.connection.settimeout(left)
                    chunk = self.rfile.read1(min(length - got, 1 << 16))
                    if not chunk:
                        break
                    parts.append(chunk)
                    got += len(chunk)
            except (socket.timeout, TimeoutError):
                self.close_connection = True
                raise RequestError("body", f"got {got} of {length} bytes within {body_timeout:g} s "
                                           "(server flag --body-timeout)", 408) from None
            finally:
                self.connection.settimeout(self.timeout)
            if got != length:
                raise RequestError("body", f"got {got} of {length} bytes")
            return b"".join(parts)

        def _checked(self) -> bool:
            """The ``Host`` check of every request; False when it was refused (answered)."""
            try:
                check_host(self.headers.get("Host"),
                           getattr(self.response_generator.model_provider.served, "allowed_hosts",
                                   set()) or set())
            except RequestError as err:
                logging.info(f"qfilters-mlx: refused {self.command} {self.path[:80]}: {err}")
                self._refuse(err)
                return False
            return True

        def do_GET(self):
            if self._checked():
                super().do_GET()

        def do_OPTIONS(self):
            if self._checked():
                super().do_OPTIONS()

        def do_POST(self):
            try:
                self._post()
            except (_Answered, _ClientGone, _StreamFailed):
                self.close_connection = True
            except Exception as err:  # noqa: BLE001 (the handler never dies on a request)
                logging.exception(f"qfilters-mlx: a request failed in the handler: {err!r}")
                self.close_connection = True
                self._error(500, RuntimeError(f"the server failed on this request: "
                                              f"{type(err).__name__}"))

        def _post(self):
            if not self._checked():
                return
            endpoint = ENDPOINTS.get(self.path)
            if endpoint is None:
                return super().do_POST()  # mlx-lm's 404
            try:
                check_content_type(self.headers.get("Content-Type"))
                raw = self._read_body()
            except RequestError as err:
                logging.info(f"qfilters-mlx: refused {self.path}: {err}")
                if err.status in (413, 415):
                    return self._refuse(err)
                return self._error(err.status, err)
            try:
                body = check_body(parse_body(raw), endpoint, self.response_generator.model_provider.served)
            except RequestError as err:
                logging.info(f"qfilters-mlx: refused {self.path}: {err}")
                return self._error(err.status, err)
            data = json.dumps(body).encode()
            self.rfile = io.BytesIO(data)
            del self.headers["Content-Length"]
            self.headers["Content-Length"] = str(len(data))
            raw_out = self.wfile
            self.wfile = _OpenAIErrors(self, raw_out)
            try:
                return super().do_POST()
            finally:
                self.wfile = raw_out

        def handle_health_check(self):
            gen = self.response_generator
            healthy = gen.is_healthy
            cache = gen.prompt_cache
            body = {"status": "ok" if healthy else "unavailable",
                    "stored": cache.stored_stats() if hasattr(cache, "stored_stats") else None,
                    "generation_loop_restarts": getattr(gen, "loop_restarts", 0)}
            data = json.dumps(body).encode()
            self._set_completion_headers(200 if healthy else 503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return CheckingAPIHandler
