"""The HTTP side of ``qfilters-mlx server``: mlx-lm's handler and generation loop, made to
survive their users (subclasses of ``mlx_lm.server.APIHandler`` and ``ResponseGenerator``).

* :func:`handler_class`: every POST body is size-checked, parsed and checked
  (:mod:`.server_requests`) before mlx-lm's own ``do_POST`` sees it; errors are 4xx
  naming the field (413 over ``--max-body-bytes``, 411 without Content-Length, 400
  for the rest); an error from the generation loop is 400 when the request caused it,
  503 when no generation loop runs, 500 otherwise (mlx-lm answers 404 to all of them).
  A request that fails after it was admitted still gets its error: a non-streaming reply
  is generated whole before its status is sent (an HTTP error, never an empty 200), a
  streaming one ends with an SSE ``error`` event. ``/health`` adds the stored
  conversations (count, bytes as held at rest, rows per layer), the process's memory
  (MLX's active bytes, RSS) and the generation loop's restarts.
* :func:`generator_class`: the served model is loaded in the generation thread before
  the server answers (a load error, e.g. a bad ``--filters`` file, stops the start);
  the generation loop restarts after an exception that escaped mlx-lm's handling
  (in-flight requests get a 500), instead of dying and leaving every later request a
  "generation thread died"; a prompt over ``Served.max_prompt_tokens`` is refused (400)
  before any of it is processed; a prompt is cut at every multiple of ``--prefill-step-size``
  (:func:`~.server_cache.prefill_segments`), so it is prefilled in the calls
  ``mlx_lm.generate`` makes.

Imported lazily (it imports ``mlx_lm.server``, which imports MLX).
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
import weakref
from collections import deque

from qfilters_mlx.commands.server_cache import prefill_segments
from qfilters_mlx.commands.server_requests import MAX_BODY_BYTES, RequestError, check_body, parse_body

__all__ = ["GenerationFailed", "error_status", "generator_class", "handler_class"]

RESTARTS_ALLOWED = 5
RESTART_WINDOW_S = 30.0
"""The loop gives up (``/health`` 503, as mlx-lm's dead thread) after this many failures within
this many seconds: a fault that every pass hits is not retried forever."""

ENDPOINTS = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}


class _StreamFailed(Exception):
    """A streamed reply failed after its 200 was sent; its error event is written."""


class GenerationFailed(RuntimeError):
    """The generation loop failed while this request was in flight (the loop restarted)."""


def error_status(err: BaseException) -> int:
    """HTTP status of an error raised for a request by the generation side: 400 for what the
    request's contents caused (bad values, a chat template refusing the messages), 503 when
    no generation loop runs, 500 for the server's own faults."""
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


def handler_class(server, max_body_bytes: int = MAX_BODY_BYTES):
    """``mlx_lm.server.APIHandler`` that checks requests first (see the module docstring)."""

    class _Generate:
        """The handler's view of the generator: remembers the status of the error it raised;
        a non-streaming reply is generated whole before the handler sends its status, a
        streaming one that fails ends with an SSE error event (:class:`_StreamFailed`)."""

        def __init__(self, generator, handler):
            self._generator = generator
            self._handler = weakref.ref(handler)
            self.error_status = None

        def generate(self, *args, **kwargs):
            handler = self._handler()
            try:
                ctx, response = self._generator.generate(*args, **kwargs)
                if not getattr(handler, "stream", False):
                    return ctx, iter(list(response))  # (errors raise here, before any status)
            except Exception as err:
                self.error_status = error_status(err)
                raise
            return ctx, self._streamed(response, handler)

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

        timeout = 120  # seconds a client may stall while the request is read

        def __init__(self, response_generator, *args, **kwargs):
            super().__init__(_Generate(response_generator, self), *args, **kwargs)

        def handle_completion(self, request, stop_words):
            try:
                return super().handle_completion(request, stop_words)
            except _StreamFailed:
                self.close_connection = True  # (the error event was the reply's last)

        def _stream_error(self, status: int, err) -> None:
            """Write an SSE ``error`` event (OpenAI's shape) on a stream that already sent 200."""
            logging.warning(f"qfilters-mlx: a streamed reply failed after it started: {err!r}")
            payload = {"error": {"message": str(err), "code": status, "type": "invalid_request_error"
                                 if status < 500 else "server_error"}}
            try:
                self.wfile.write(f"event: error\ndata: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()
            except OSError:
                pass  # (the client is gone)

        def _error(self, status: int, err) -> None:
            payload = {"error": {"message": str(err), "type": "invalid_request_error"
                                 if status < 500 else "server_error",
                                 "param": getattr(err, "field", None)}}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self._set_cors_headers()
            self.end_headers()
            self.wfile.write(data)

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
                self.close_connection = True  # the body is not read
                raise RequestError("body", f"{length} bytes is over the limit of {max_body_bytes} "
                                           "(server flag --max-body-bytes)", 413)
            raw = self.rfile.read(length)
            if len(raw) != length:
                raise RequestError("body", f"got {len(raw)} of {length} bytes")
            return raw

        def do_POST(self):
            endpoint = ENDPOINTS.get(self.path)
            if endpoint is None:
                return super().do_POST()  # mlx-lm's 404
            try:
                body = parse_body(self._read_body())
                served = self.response_generator.model_provider.served
                body = check_body(body, endpoint, served)
            except RequestError as err:
                logging.info(f"qfilters-mlx: refused {self.path}: {err}")
                return self._error(err.status, err)
            data = json.dumps(body).encode()
            self.rfile = io.BytesIO(data)
            del self.headers["Content-Length"]
            self.headers["Content-Length"] = str(len(data))
            return super().do_POST()

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
