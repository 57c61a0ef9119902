"""The HTTP side of ``qfilters-mlx server``: mlx-lm's handler and generation loop, made to
survive their users (subclasses of ``mlx_lm.server.APIHandler`` and ``ResponseGenerator``).

* :func:`handler_class`: every POST body is size-checked, parsed and checked
  (:mod:`.server_requests`) before mlx-lm's own ``do_POST`` sees it; errors are 4xx
  naming the field (413 over ``--max-body-bytes``, 411 without Content-Length, 400
  for the rest); an error from the generation loop is 400 when the request caused it,
  503 when no generation loop runs, 500 otherwise (mlx-lm answers 404 to all of them).
  ``/health`` adds the stored conversations (count, ``nbytes`` as the caches count
  them, rows per layer) and the generation loop's restarts.
* :func:`generator_class`: the served model is loaded in the generation thread before
  the server answers (a load error, e.g. a bad ``--filters`` file, stops the start);
  the generation loop restarts after an exception that escaped mlx-lm's handling
  (in-flight requests get a 500), instead of dying and leaving every later request a
  "generation thread died"; a prompt is cut into segments every ``checkpoint_every``
  tokens (:func:`~.server_cache.checkpoint_segments`: mlx-lm stores a checkpoint at
  the end of each).

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

from qfilters_mlx.commands.server_cache import checkpoint_segments
from qfilters_mlx.commands.server_requests import MAX_BODY_BYTES, RequestError, check_body, parse_body

__all__ = ["GenerationFailed", "error_status", "generator_class", "handler_class"]

RESTARTS_ALLOWED = 5
RESTART_WINDOW_S = 30.0
"""The loop gives up (``/health`` 503, as mlx-lm's dead thread) after this many failures within
this many seconds: a fault that every pass hits is not retried forever."""

ENDPOINTS = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}


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
    if type(err).__name__ in ("TemplateError", "TemplateSyntaxError", "UndefinedError"):
        return 400  # jinja2: the chat template refused the messages
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


def generator_class(server, checkpoint_every: int = 0):
    """``mlx_lm.server.ResponseGenerator`` whose loop restarts after an uncaught exception and
    that cuts prompts for a checkpoint every ``checkpoint_every`` tokens (0: mlx-lm's
    segments only)."""

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
            super().__init__(model_provider, prompt_cache)
            self._loaded.wait()
            if self._load_error is not None:  # the served model or its --filters: no server
                self.join()
                raise self._load_error

        def _tokenize(self, tokenizer, request, args):
            prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
            if vision is None:  # (requests with images are served whole, without segments)
                segments, types = checkpoint_segments(segments, types, checkpoint_every)
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
        """The handler's view of the generator: remembers the status of the error it raised."""

        def __init__(self, generator):
            self._generator = generator
            self.error_status = None

        def generate(self, *args, **kwargs):
            try:
                return self._generator.generate(*args, **kwargs)
            except Exception as err:
                self.error_status = error_status(err)
                raise

        def __getattr__(self, name):
            return getattr(self._generator, name)

    class CheckingAPIHandler(server.APIHandler):
        """mlx-lm's handler behind :func:`parse_body` / :func:`check_body`."""

        timeout = 120  # seconds a client may stall while the request is read

        def __init__(self, response_generator, *args, **kwargs):
            super().__init__(_Generate(response_generator), *args, **kwargs)

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
