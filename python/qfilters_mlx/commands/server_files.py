"""Files of stored conversations (``qfilters-mlx server --prompt-cache-dir DIR``): the folder,
its lock, and one file per stored entry.

A file is mlx-lm's prompt-cache file (``save_prompt_cache``: safetensors, readable with
``mlx_lm.models.cache.load_prompt_cache``) whose metadata adds, under keys of their own:

* ``qfilters_mlx_file``: :data:`FILE_FORMAT`;
* ``qfilters_mlx_identity``: the identity of the model and cache configuration that wrote it
  (:func:`~.server_disk.cache_identity`), hex;
* ``qfilters_mlx_tokens``: the entry's token key (the prompt, or prompt and answer), int32
  little-endian, base64;
* ``qfilters_mlx_type``: mlx-lm's cache type of the entry (``"assistant"``, ``"user"``,
  ``"system"``);
* ``qfilters_mlx_checksum``: SHA-256 (hex) of the whole file's bytes with this value replaced
  by :data:`PENDING` (same length), so that damage anywhere (header, metadata, arrays,
  truncation) is found before the arrays are used.

Writes are atomic: a temporary file (``.tmp-*``, mode 0600 from its creation) in the folder,
written, checksummed, ``fsync``-ed, renamed over the final name, the folder ``fsync``-ed. A
file's name is :func:`file_name`: a hash of the identity and the token key, so nothing a client
sends appears in a path. The folder is created mode 0700; an existing folder must be owned by
the server's user and closed to others (mode ``& 0o077 == 0``). One server holds the folder's
``lock`` file (``flock``); a second one on the same folder is refused at start.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import io
import json
import os
import stat
import struct
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["Damaged", "FILE_FORMAT", "PENDING", "SUFFIX", "file_name", "lock_folder", "pack_tokens",
           "read_info", "unpack_tokens", "verified_load", "write_entry"]

FILE_FORMAT = "1"
"""Layout of the metadata above; a file with another value is not read."""

SUFFIX = ".safetensors"
PENDING = "qfilters-mlx-checksum-pending".ljust(64, ".")
"""What the checksum field holds while the checksum is computed (64 characters, as the digest)."""

_KEY = "0.qfilters_mlx_"  # (save_prompt_cache stores the user metadata under "0.")
_CHUNK = 1 << 20
MAX_HEADER = 64 << 20
"""Largest safetensors header read (bytes); a larger length field is damage."""


class Damaged(ValueError):
    """A file of this server's name whose bytes are not a whole file of the layout above
    (truncated, a header that does not parse, a checksum that does not match); files of another
    layout or identity raise a plain ``ValueError``."""


def pack_tokens(tokens) -> bytes | None:
    """The token key ``tokens`` as int32 little-endian bytes, or ``None`` when it is not a
    sequence of ints in int32's range (such an entry is not written)."""
    try:
        a = np.asarray(tokens)
    except (TypeError, ValueError):
        return None
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer) or (a.size and (
            a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max)):
        return None
    return a.astype("<i4").tobytes()


def unpack_tokens(key: bytes) -> list[int]:
    """The token list of a packed key (:func:`pack_tokens`)."""
    return np.frombuffer(key, dtype="<i4").tolist()


def file_name(identity: str, key: bytes) -> str:
    """The file name of an entry: SHA-256 of the identity and the packed token key, hex."""
    return hashlib.sha256(identity.encode() + b"\0" + key).hexdigest() + SUFFIX


def lock_folder(folder) -> object:
    """Create ``folder`` (mode 0700) or check it, take its lock, and remove temporary files a
    stopped writer left. Returns the open lock file (the lock lasts while it stays open).

    Raises:
        ValueError: ``folder`` is not a folder, is not owned by this user, or others may read,
            write or enter it (its mode and the ``chmod`` that fixes it named).
        RuntimeError: another process holds the lock (another server uses the folder).
        OSError: the folder cannot be created, or its lock file opened.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--prompt-cache-dir {folder}: not a folder")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.geteuid():
        raise ValueError(f"--prompt-cache-dir {folder}: owned by another user (uid {st.st_uid})")
    if st.st_mode & 0o077:
        raise ValueError(f"--prompt-cache-dir {folder}: others may access it (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); stored conversations need a private "
                         f"folder: chmod 700 {folder}, or name a new folder")
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    lock = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise RuntimeError(f"--prompt-cache-dir {folder}: another server uses this folder (its "
                           "lock is held); give each server a folder of its own") from None
    for p in folder.glob(".tmp-*" + SUFFIX):
        p.unlink(missing_ok=True)
    return lock


def _open_regular(path):
    """``path`` opened for reading, refusing what is not a regular file (a symbolic link, a
    folder, a FIFO: opened without blocking, then checked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EMLINK):
            raise ValueError("a symbolic link, not a file this server wrote") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    return os.fdopen(fd, "rb")


def _header(data: bytes) -> tuple[bytes, int]:
    """``(header, length)`` of the safetensors bytes ``data`` (its start, at least)."""
    if len(data) < 8:
        raise Damaged("truncated (no header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
        raise Damaged("truncated or damaged (header length)")
    return data[8:8 + n], n


def _read_header(f) -> tuple[bytes, int]:
    """``(header, length)`` of the safetensors file ``f``, read from its start (:func:`_header`'s
    checks: a length field over :data:`MAX_HEADER` or past the end is damage)."""
    start = f.read(8)
    n = struct.unpack("<Q", start)[0] if len(start) == 8 else 0
    return _header(start + f.read(n if n <= MAX_HEADER else 0))


def _fields(head: bytes) -> dict:
    """Our metadata fields of a header (see the module doc), the token key unpacked to bytes."""
    try:
        meta = json.loads(head).get("__metadata__") or {}
    except (ValueError, AttributeError) as err:
        raise Damaged(f"damaged header ({type(err).__name__}: {err})") from None
    try:
        info = {k: meta[_KEY + k] for k in ("file", "identity", "tokens", "type", "checksum")}
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a stored conversation of this server (no {err})") from None
    if info["file"] != FILE_FORMAT:
        raise ValueError(f"file layout {info['file']!r}, not {FILE_FORMAT!r}")
    try:
        info["tokens"] = base64.b64decode(info["tokens"], validate=True)
    except ValueError as err:
        raise Damaged(f"bad token key ({err})") from None
    if len(info["tokens"]) % 4 or len(info["checksum"]) != 64:
        raise Damaged("bad token key or checksum field (length)")
    return info


def _digest(data, head_len: int, at: int) -> str:
    """SHA-256 of the file bytes ``data`` (a bytes-like or an open file at offset 0) with the 64
    characters at offset ``8 + at`` (in the header) read as :data:`PENDING`."""
    h = hashlib.sha256()
    if isinstance(data, (bytes, bytearray, memoryview)):
        h.update(data[:8 + at])
        h.update(PENDING.encode())
        h.update(data[8 + at + 64:])
        return h.hexdigest()
    head = data.read(8 + head_len)
    h.update(head[:8 + at] + PENDING.encode() + head[8 + at + 64:])
    for chunk in iter(lambda: data.read(_CHUNK), b""):
        h.update(chunk)
    return h.hexdigest()


def read_info(path) -> dict:
    """The metadata of ours in the file at ``path``: ``file``, ``identity``, ``tokens``
    (packed), ``type``, ``checksum`` (only the header is read; nothing is verified).

    Raises:
        Damaged: truncated, or a header that does not parse.
        ValueError: not a regular file, or not one of ours (a field missing), or another
            :data:`FILE_FORMAT`; the message says which.
        OSError: the file cannot be read.
    """
    with _open_regular(path) as f:
        head, _ = _read_header(f)
    return _fields(head)


def write_entry(folder, name: str, cache: list, meta: dict[str, str]) -> int:
    """Write ``cache`` (a list of layer caches) with ``meta`` (``identity``, ``tokens`` packed,
    ``type``) atomically as ``folder / name``; returns the file's size in bytes. On any error
    nothing is left under ``name`` (a file there before stays) and no temporary file stays.

    Raises:
        OSError: the write failed (disk full, permissions); ValueError: a cache that mlx-lm's
            ``save_prompt_cache`` cannot store.
    """
    from mlx_lm.models.cache import save_prompt_cache

    folder = Path(folder)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=folder)  # (mode 0600)
    os.close(fd)
    try:
        extra = {"qfilters_mlx_file": FILE_FORMAT, "qfilters_mlx_identity": meta["identity"],
                 "qfilters_mlx_tokens": base64.b64encode(meta["tokens"]).decode(),
                 "qfilters_mlx_type": meta["type"], "qfilters_mlx_checksum": PENDING}
        save_prompt_cache(tmp, cache, extra)
        with open(tmp, "r+b") as f:
            head, n = _read_header(f)
            at = head.find(PENDING.encode())
            if at < 0 or head.find(PENDING.encode(), at + 1) >= 0:
                raise ValueError("the checksum field is not found once in the written header")
            f.seek(0)
            digest = _digest(f, n, at)
            f.seek(8 + at)
            f.write(digest.encode())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, folder / name)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return os.stat(folder / name).st_size
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def verified_load(path, identity: str, key: bytes) -> list:
    """The caches in the file at ``path``, after checking its checksum, that it was written for
    ``identity`` and that its token key is ``key``: the file is read once, and mlx-lm's
    ``load_prompt_cache`` reads the caches from the bytes that were checked.

    Raises:
        Damaged: checksum, truncation, a header that does not parse. ValueError: not a regular
            file, another identity or token key, or caches that do not load (their error); the
            message says which. OSError: the file cannot be read.
    """
    from mlx_lm.models.cache import load_prompt_cache

    with _open_regular(path) as f:
        data = f.read()
    head, n = _header(data)
    info = _fields(head)
    if info["identity"] != identity:
        raise ValueError("written by another model or cache configuration")
    if info["tokens"] != key:
        raise ValueError("its token key is not the one its name stands for")
    at = head.find(info["checksum"].encode())
    if at < 0 or _digest(data, n, at) != info["checksum"]:
        raise Damaged("checksum mismatch (damaged)")
    buffer = io.BytesIO(data)
    buffer.name = Path(path).name  # (mx.load tells the format by the name's suffix)
    del data
    try:
        return load_prompt_cache(buffer)
    except Exception as err:  # noqa: BLE001 - any failure to rebuild the caches is the file's
        raise ValueError(f"its caches do not load ({type(err).__name__}: {err})") from None
