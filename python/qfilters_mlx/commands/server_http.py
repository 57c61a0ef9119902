"""The HTTP side of ``qfilters-mlx server``: mlx-lm's handler, made to survive its users
(a subclass of ``mlx_lm.server.APIHandler``; the generation loop: :mod:`.server_loop`).

:func:`handler_class`: every request's ``Host`` is checked (403, :mod:`.server_headers`);
every POST body is type-checked (``application/json``: 415), size-checked, read within the
body deadline (408), parsed and checked (:mod:`.server_requests`) before mlx-lm's own
``do_POST`` sees it; errors are 4xx naming the field (413 over ``--max-body-bytes``, 411
without Content-Length, 400 for the rest), and a refused body still being sent is read and
dropped so that the client reads the answer; connections beyond the cap get 503; an error
from the generation loop is 400 when the request caused it, 503 when no generation loop
runs, 500 otherwise (mlx-lm answers 404 to all of them). Every error is OpenAI's error
object (:func:`error_body`), mlx-lm's own included. A request that fails after it was
admitted still gets its error: a non-streaming reply is generated whole before its status
is sent (an HTTP error, never an empty 200; stopped when its client leaves), a streaming
one ends with an SSE ``error`` event. The handler answers 500 rather than die. ``/health``
adds the stored conversations (count, bytes as held at rest, rows per layer), the process's
memory (MLX's active bytes, RSS) and the generation loop's restarts.

Imported lazily (it imports nothing of MLX itself; its users import ``mlx_lm.server``).
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

from qfilters_mlx.commands.server_errors import OpenAIErrorWriter, error_body, error_status
from qfilters_mlx.commands.server_headers import check_content_type, check_host
from qfilters_mlx.commands.server_requests import MAX_BODY_BYTES, RequestError, check_body, parse_body

__all__ = ["BODY_TIMEOUT_S", "MAX_CONNECTIONS", "client_gone", "handler_class"]

MAX_CONNECTIONS = 64
"""Default most connections served at once (``--max-connections``); more get 503."""

BODY_TIMEOUT_S = 60.0
"""Default seconds a client has to send a request body (``--body-timeout``); slower: 408."""

DRAIN_BYTES, DRAIN_S = 64 << 20, 5.0
"""After refusing a request whose body was not read (413, 415, 503), at most this many bytes
of it are read and dropped within this many seconds, so that the client, still sending, gets
to read the answer (closing with unread data resets the connection)."""

ENDPOINTS = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}


class _StreamFailed(Exception):
    """A streamed reply failed after its 200 was sent; its error event is written."""


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
                self.max_tokens = None  # (the default within the cap: server_loop.cap_max_tokens)
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
            self.wfile = OpenAIErrorWriter(self, raw_out)
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
