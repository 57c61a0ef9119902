"""The index of a ``--prompt-cache-dir`` folder (:mod:`.server_disk`): which files it holds,
which of them this server may read, their sizes and order of use, and the identity a file must
have been written for (:func:`cache_identity`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import sys
import time
from collections import OrderedDict
from pathlib import Path

from qfilters_mlx.commands.server_files import (SUFFIX, Damaged, file_name, lock_folder, read_info,
                                                verified_load, write_entry)

__all__ = ["DiskEntry", "DiskIndex", "ENTRY_NBYTES", "cache_identity"]

ENTRY_NBYTES = 200
"""Bytes counted per indexed file besides its key and name: the entry object (four slots, 72 B)
and its ``OrderedDict`` slot and link (about 100 B), rounded up."""


def _leaves(h, tree) -> None:
    """Hash every leaf of ``tree`` (arrays by dtype, shape and float32 values)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    for name, leaf in tree_flatten(tree):
        h.update(name.encode())
        if isinstance(leaf, mx.array):
            h.update(f"{leaf.dtype}{leaf.shape}".encode())
            h.update(np.asarray(leaf.astype(mx.float32)).tobytes())
        else:
            h.update(repr(leaf).encode())


def cache_identity(model, draft_model=None, settings: dict | None = None) -> str:
    """What a file must have been written for to be read (hex SHA-256): the model's (and the
    draft model's) identity fields (:func:`qfilters_mlx.identity.identity_fields`: architecture,
    parameter names, shapes, dtypes, sampled values) and, for every layer cache
    ``model.make_cache()`` builds (mlx-lm's ``make_prompt_cache``), its class, ``state`` and
    ``meta_state`` while empty (for this package's caches: the configuration, build options and
    filter), and ``settings``: the server's flags that change what a stored cache holds
    (mlx-lm's ``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``, ``--max-kv-size``)."""
    from mlx_lm.models.cache import make_prompt_cache

    from qfilters_mlx.identity import identity_fields

    h = hashlib.sha256()
    h.update(json.dumps(settings or {}, sort_keys=True, default=str).encode())
    for m in (model, draft_model):
        if m is None:
            h.update(b"none")
            continue
        h.update(json.dumps(identity_fields(m), sort_keys=True).encode())
        for c in make_prompt_cache(m):
            h.update(type(c).__name__.encode())
            for name in ("state", "meta_state"):
                try:
                    _leaves(h, getattr(c, name))
                except Exception:  # noqa: BLE001 - mlx-lm's empty caches raise on state
                    h.update(b"-")
    return h.hexdigest()


class DiskEntry:
    """A file of the index: packed token ``key``, ``nbytes`` on disk, mlx-lm's ``cache_type``,
    and whether it may be read (``usable``: ours, this identity)."""

    __slots__ = ("key", "nbytes", "cache_type", "usable")

    def __init__(self, key: bytes, nbytes: int, cache_type: str, usable: bool = True):
        self.key, self.nbytes, self.cache_type, self.usable = key, nbytes, cache_type, usable

    @property
    def n_tokens(self) -> int:
        """Tokens of the key (packed int32: :func:`~.server_files.pack_tokens`)."""
        return len(self.key) // 4


class DiskIndex:
    """The files of ``folder`` (locked while this lives), least recently used first.

    Args:
        folder: the folder (created mode 0700; see :func:`~.server_files.lock_folder`).
        max_bytes: bytes the files may take together (``None``: no bound).
        identity: :func:`cache_identity` of the served model and caches.
        lock: the folder's lock file when the caller took it already
            (:func:`~.server_files.lock_folder`), else it is taken here.

    Raises:
        ValueError, RuntimeError: from :func:`~.server_files.lock_folder`.
    """

    def __init__(self, folder, max_bytes: int | None, identity: str, lock=None):
        self.folder, self.max_bytes, self.identity = Path(folder), max_bytes, identity
        self._lock = lock if lock is not None else lock_folder(self.folder)
        self.entries: OrderedDict[str, DiskEntry] = OrderedDict()
        self.nbytes = 0
        self._usable = self._index_nbytes = 0  # (kept as entries come and go: /health reads them)
        self.writes = self.reads = self.failures = 0
        self.write_s = self.read_s = 0.0  # (seconds spent writing / reading files)
        found = []
        for p in self.folder.glob("*" + SUFFIX):
            if len(p.name) != 64 + len(SUFFIX) or p.name.startswith("."):
                continue  # (not a name this server writes: never read nor removed)
            entry = self._scan(p)
            if entry is not None:
                found.append((entry[0], p.name, entry[1]))
        for _, name, entry in sorted(found):
            self._add(name, entry)
        self._bound()

    def _scan(self, p) -> tuple[int, DiskEntry] | None:
        """``(mtime, entry)`` of the file ``p`` found at start; ``None`` (logged) for what is not
        a regular file (never read nor removed) and for a damaged file (removed)."""
        try:
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):
                logging.warning(f"qfilters-mlx: skipping {p}: not a regular file (left as it is)")
                return None
            info = read_info(p)
        except Damaged as err:
            logging.warning(f"qfilters-mlx: removing {p}: {err}")
            p.unlink(missing_ok=True)
            return None
        except (OSError, ValueError) as err:
            logging.warning(f"qfilters-mlx: skipping {p}: {err} (it counts towards the disk bound)")
            return st.st_mtime_ns, DiskEntry(b"", st.st_size, "foreign", False)
        if info["identity"] != self.identity:
            why = "written by another model or cache configuration"
        elif file_name(self.identity, info["tokens"]) != p.name:
            why = "its name is not the hash of its token key"
        else:
            return st.st_mtime_ns, DiskEntry(info["tokens"], st.st_size, info["type"])
        logging.info(f"qfilters-mlx: {p}: {why}: not used (it counts towards the disk bound)")
        return st.st_mtime_ns, DiskEntry(b"", st.st_size, "foreign", False)

    def _add(self, name: str, entry: DiskEntry) -> None:
        self.entries[name] = entry
        self._count(name, entry, +1)

    def _count(self, name: str, entry: DiskEntry, sign: int) -> None:
        self.nbytes += sign * entry.nbytes
        self._usable += sign * entry.usable
        self._index_nbytes += sign * (sys.getsizeof(entry.key) + sys.getsizeof(name) + ENTRY_NBYTES)

    @property
    def index_nbytes(self) -> int:
        """Bytes the index holds in Python objects: each file's packed token key and name (their
        ``sys.getsizeof``) and :data:`ENTRY_NBYTES` for its entry and dict slot."""
        return self._index_nbytes

    def longest_prefix(self, key: bytes) -> tuple[str, DiskEntry] | None:
        """The usable file whose token key is the longest prefix of ``key`` (packed)."""
        best = None
        for name, e in self.entries.items():
            if e.usable and len(e.key) <= len(key) and (best is None or len(e.key) > len(best[1].key)) \
                    and key.startswith(e.key):
                best = (name, e)
        return best

    def prefixes(self, key: bytes) -> list[tuple[str, DiskEntry]]:
        """Usable files whose token key is a proper prefix of ``key``."""
        return [(n, e) for n, e in self.entries.items()
                if e.usable and len(e.key) < len(key) and key.startswith(e.key)]

    def write(self, key: bytes, cache: list, cache_type: str) -> bool:
        """Store ``cache`` under ``key`` (replacing its file), then apply the bound; ``True``
        when the file was written. A failed write is logged and leaves the folder and the
        index as they were."""
        name = file_name(self.identity, key)
        start = time.perf_counter()
        try:
            n = write_entry(self.folder, name, cache, {"identity": self.identity, "tokens": key,
                                                       "type": cache_type})
        except Exception as err:  # noqa: BLE001 - the reply is sent: a failed write costs a file only
            self.failures += 1
            logging.warning(f"qfilters-mlx: could not write {self.folder / name}: "
                            f"{type(err).__name__}: {err}")
            return False
        old = self.entries.pop(name, None)
        if old is not None:
            self._count(name, old, -1)
        self._add(name, DiskEntry(key, n, cache_type))
        self.writes += 1
        self.write_s += time.perf_counter() - start
        self._bound()
        if name not in self.entries:
            logging.warning(f"qfilters-mlx: a stored conversation's file ({n} bytes) is larger than "
                            f"--prompt-cache-disk-bytes ({self.max_bytes}): not kept")
        return True

    def touch(self, name: str) -> None:
        """Mark file ``name`` as used now (its place in the order, and its time on disk)."""
        if name not in self.entries:
            return
        self.entries.move_to_end(name)
        now = time.time_ns()
        try:
            os.utime(self.folder / name, ns=(now, now))
        except OSError:
            pass

    def read(self, name: str) -> list | None:
        """The caches of file ``name``, marked as used; ``None`` (logged) when it fails its
        checks: a damaged or unreadable file is removed, another one kept and never read."""
        e = self.entries[name]
        path = self.folder / name
        start = time.perf_counter()
        try:
            cache = verified_load(path, self.identity, e.key)
        except Exception as err:  # noqa: BLE001 - a file that fails any check is not used
            self.failures += 1
            damaged = isinstance(err, (Damaged, OSError))
            logging.warning(f"qfilters-mlx: skipping {path}: {type(err).__name__}: {err}; "
                            f"{'removed; ' if damaged else ''}computing the prompt again")
            if damaged:
                self.remove(name)
            else:  # (kept, never read again: it counts towards the bound)
                self._count(name, e, -1)
                self.entries[name] = DiskEntry(b"", e.nbytes, "foreign", False)
                self._count(name, self.entries[name], +1)
            return None
        self.reads += 1
        self.read_s += time.perf_counter() - start
        self.touch(name)
        return cache

    def remove(self, name: str) -> None:
        """Delete file ``name`` and its index entry (nothing when absent)."""
        e = self.entries.pop(name, None)
        if e is None:
            return
        self._count(name, e, -1)
        try:
            (self.folder / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            logging.warning(f"qfilters-mlx: could not remove {self.folder / name}: {err}")

    def _bound(self) -> None:
        while self.max_bytes is not None and self.nbytes > self.max_bytes and self.entries:
            self.remove(next(iter(self.entries)))

    def stats(self) -> dict:
        """``files``, ``bytes``, ``max_bytes``, ``usable`` files, ``index_bytes``, and since the
        start ``writes``, ``reads``, ``failures`` and seconds spent (``write_s``, ``read_s``:
        reads include checking the checksum and rebuilding the caches)."""
        return {"files": len(self.entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "usable": self._usable, "index_bytes": self.index_nbytes,
                "writes": self.writes, "reads": self.reads, "failures": self.failures,
                "write_s": round(self.write_s, 4), "read_s": round(self.read_s, 4)}
