"""The errors of ``qfilters-mlx server``: a request its checks refuse (:mod:`.server_requests`,
:mod:`.server_messages`, :mod:`.server_headers`), and the generation loop failing under a
request (:mod:`.server_loop`); the HTTP status and OpenAI error object a client gets for
each."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

__all__ = ["GenerationFailed", "OpenAIErrorWriter", "RequestError", "error_body", "error_status"]


@dataclass
class RequestError(Exception):
    """A request the server refuses: ``status`` (HTTP), ``field`` (the body's key, or
    ``"body"``), ``message`` (what is wrong, for the client)."""

    field: str
    message: str
    status: int = 400

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field != "body" else self.message


class GenerationFailed(RuntimeError):
    """The generation loop failed while this request was in flight (the loop restarted)."""


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
    if isinstance(err, (ValueError, TypeError, KeyError, IndexError)):
        return 400
    if any(k.__module__.startswith("jinja2") for k in type(err).__mro__):
        return 400  # the chat template failed on the messages (or a client's template failed)
    return 500


class OpenAIErrorWriter(io.RawIOBase):
    """A handler's ``wfile`` while mlx-lm's ``do_POST`` runs: an error body mlx-lm writes
    itself (``{"error": "<text>"}``, after a status of 400 or more, read from the handler's
    ``_status``) goes out as OpenAI's error object (:func:`error_body`)."""

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
