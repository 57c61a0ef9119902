"""Checks of ``qfilters-mlx server``'s request headers against web pages: a page a browser
shows can send requests to 127.0.0.1 (a ``text/plain`` POST needs no CORS preflight) or, by
DNS rebinding, under its own name resolving to 127.0.0.1. Nothing here imports MLX."""

from __future__ import annotations

from qfilters_mlx.commands.server_errors import RequestError

__all__ = ["LOOPBACK_HOSTS", "check_content_type", "check_host"]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""``Host`` names always accepted (also ``127.x.y.z`` and ``*.localhost``): a page that makes a
browser send a request to this server under another name (DNS rebinding) is refused."""


def check_host(host: str | None, allowed: set) -> None:
    """``Host`` of a request: a loopback name (:data:`LOOPBACK_HOSTS`, ``127.x.y.z``,
    ``*.localhost``) or one of ``allowed`` (``"*"``: any), with or without a port.

    Raises:
        RequestError: no ``Host`` (400) or another name (403), field ``"Host"``.
    """
    if "*" in allowed:
        return
    if not host:
        raise RequestError("Host", "the header is required", 400)
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:8080
        name = name[1:name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    parts = name.split(".")
    loopback = (name in LOOPBACK_HOSTS or name.endswith(".localhost")
                or (len(parts) == 4 and parts[0] == "127" and all(p.isdigit() for p in parts)))
    if not loopback and name not in allowed:
        raise RequestError("Host", f"{host[:80]!r} is not a name of this server (loopback names, "
                                   "or the server flag --allowed-hosts)", 403)


def check_content_type(value: str | None) -> None:
    """A POST body's ``Content-Type`` is ``application/json`` (parameters such as ``charset``
    allowed): a browser sends a cross-origin ``text/plain`` POST without asking CORS first.

    Raises:
        RequestError: anything else (415, field ``"Content-Type"``).
    """
    media = (value or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise RequestError("Content-Type", f"must be application/json, got {(value or '')[:60]!r}", 415)
