"""The error of ``qfilters-mlx server``'s request checks (:mod:`.server_requests`,
:mod:`.server_messages`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestError"]


@dataclass
class RequestError(Exception):
    """A request the server refuses: ``status`` (HTTP), ``field`` (the body's key, or
    ``"body"``), ``message`` (what is wrong, for the client)."""

    field: str
    message: str
    status: int = 400

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field != "body" else self.message
