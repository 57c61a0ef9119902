"""Stored conversations that survive a restart: ``qfilters-mlx server --prompt-cache-dir DIR
[--prompt-cache-disk-bytes N]``.

:func:`disk_conversations_class` extends the server's stored conversations
(:mod:`.server_cache`) with a folder of files (:mod:`.server_files`), one per stored entry:

* **what is written**: every entry the stored conversations keep, as it is kept in memory (the
  budget's rows; the rewind journal is not written). An answer is written when its request
  ends, after the reply has been sent; a prompt checkpoint stored during a request is written
  then too, if it is still stored (most are dropped by their own answer).
* **what is removed**: a file whose entry the stored conversations drop because a newer entry
  replaces it (an older turn of the same conversation; the same rule for files of entries that
  left memory or came from before a restart); not when an entry leaves memory for the
  count or byte bounds (``--prompt-cache-size``, ``--prompt-cache-bytes``): then the file
  stays, and serves the conversation from disk. Past ``N`` bytes of files, the least recently
  used are removed (use: written or read; order kept across restarts by the files' times).
* **reuse**: a prompt whose longest stored prefix is a file longer than what memory holds
  loads that file (checksum, identity and token key checked: :func:`~.server_files.verified_load`)
  and continues from it. A file that fails is logged with its name, removed, and the request
  is served from memory or computed again. A loaded entry cannot rewind until it has
  decoded again (no journal is written), so disk entries are used as prefixes only.
* **identity** (:func:`cache_identity`): the model (and draft model) by their parameters, and
  the cache configuration by the state of fresh caches (classes, configuration, filters); a
  file of another identity is never read, and only counts towards ``N``.

The index is rebuilt from the folder's file headers when the served model has loaded
(:meth:`open_disk`); it holds each file's token key packed (4 bytes per token), its size and
type. Only the served model's conversations are written (not those of a model a request
switches to).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

from qfilters_mlx.commands.server_calls import PREFILL
from qfilters_mlx.commands.server_files import (SUFFIX, file_name, lock_folder, pack_tokens, read_info,
                                                verified_load, write_entry)

__all__ = ["DiskEntry", "DiskIndex", "ENTRY_NBYTES", "cache_identity", "disk_conversations_class"]

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


def cache_identity(model, draft_model=None) -> str:
    """What a file must have been written for to be read (hex SHA-256): the model's (and the
    draft model's) identity fields (:func:`qfilters_mlx.identity.identity_fields`: architecture,
    parameter names, shapes, dtypes, sampled values) and, for every layer cache
    ``model.make_cache()`` builds (mlx-lm's ``make_prompt_cache``), its class, ``state`` and
    ``meta_state`` while empty (for this package's caches: the configuration, build options and
    filter)."""
    from mlx_lm.models.cache import make_prompt_cache

    from qfilters_mlx.identity import identity_fields

    h = hashlib.sha256()
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
            st = p.stat()
            try:
                info = read_info(p)
                usable = info["identity"] == identity and file_name(identity, info["tokens"]) == p.name
                entry = DiskEntry(info["tokens"], st.st_size, info["type"], usable)
                if not usable:
                    logging.info(f"qfilters-mlx: {p} was written by another model or cache "
                                 "configuration: not used (it counts towards the disk bound)")
            except (OSError, ValueError) as err:
                logging.warning(f"qfilters-mlx: skipping {p}: {err}")
                entry = DiskEntry(b"", st.st_size, "damaged", False)
            found.append((st.st_mtime_ns, p.name, entry))
        for _, name, entry in sorted(found):
            self._add(name, entry)
        self._bound()

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

    def write(self, key: bytes, cache: list, cache_type: str) -> None:
        """Store ``cache`` under ``key`` (replacing its file), then apply the bound. A failed
        write is logged and leaves the index as it was."""
        name = file_name(self.identity, key)
        start = time.perf_counter()
        try:
            n = write_entry(self.folder, name, cache, {"identity": self.identity, "tokens": key,
                                                       "type": cache_type})
        except Exception as err:  # noqa: BLE001 - the reply is sent: a failed write costs a file only
            self.failures += 1
            logging.warning(f"qfilters-mlx: could not write {self.folder / name}: "
                            f"{type(err).__name__}: {err}")
            return
        old = self.entries.pop(name, None)
        if old is not None:
            self._count(name, old, -1)
        self._add(name, DiskEntry(key, n, cache_type))
        self.writes += 1
        self.write_s += time.perf_counter() - start
        self._bound()

    def read(self, name: str) -> list | None:
        """The caches of file ``name``, marked as used; ``None`` (logged, file removed) when it
        fails its checks."""
        e = self.entries[name]
        path = self.folder / name
        start = time.perf_counter()
        try:
            cache = verified_load(path, self.identity, e.key)
        except Exception as err:  # noqa: BLE001 - a file that fails any check is not used
            self.failures += 1
            logging.warning(f"qfilters-mlx: skipping {path}: {type(err).__name__}: {err}; "
                            "computing the prompt again")
            self.remove(name)
            return None
        self.reads += 1
        self.read_s += time.perf_counter() - start
        self.entries.move_to_end(name)
        now = time.time_ns()
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass
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


def disk_conversations_class(base, folder, max_bytes: int | None = None, lock=None):
    """``base`` (a stored-conversations class of :func:`~.server_cache.prompt_cache_class`)
    keeping its entries in ``folder`` as well (see the module docstring). The folder is indexed
    by :meth:`open_disk` once the served model has loaded; ``lock``: its lock, when taken
    before (:func:`~.server_files.lock_folder`)."""

    class DiskConversations(base):
        """Stored conversations with a folder of files (the module docstring)."""

        disk_folder, disk_max_bytes = folder, max_bytes

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.disk = None
            self._disk_model = None
            self._pending = []  # checkpoints stored during a request: written when it ends

        def open_disk(self, model_key, model, draft_model=None) -> None:
            """Lock the folder and index its files for the served model (``model_key``:
            mlx-lm's key of it). Raises as :class:`DiskIndex`."""
            start = time.perf_counter()
            self.disk = DiskIndex(self.disk_folder, self.disk_max_bytes,
                                  cache_identity(model, draft_model), lock)
            self._disk_model = model_key
            st = self.disk.stats()
            logging.info(f"qfilters-mlx: {self.disk_folder}: {st['usable']} stored conversation "
                         f"files of this model and configuration, {st['files']} files, "
                         f"{st['bytes'] / 1e6:.1f} MB (indexed in {time.perf_counter() - start:.2f} s)")

        def _insert(self, model, tokens, prompt_cache, cache_type, done):
            super()._insert(model, tokens, prompt_cache, cache_type, done)
            if self.disk is None or model != self._disk_model or cache_type == PREFILL:
                return
            if not done:
                self._pending.append(list(tokens))
                return
            pending, self._pending = self._pending, []
            for t in pending:
                entry = self._stored(model, t)
                if entry is not None:
                    self._write(t, entry.prompt_cache, entry.cache_type)
            self._write(tokens, prompt_cache, cache_type)

        def _stored(self, model, tokens):
            try:
                return self._trie.get(model, tokens)
            except KeyError:
                return None

        def _write(self, tokens, cache, cache_type) -> None:
            key = pack_tokens(tokens)
            if key is None:
                return
            if cache_type != "system":  # (files an entry replaces: older turns, as in memory)
                for name, e in self.disk.prefixes(key):
                    if e.cache_type != "system" and self._stored(self._disk_model,
                                                                 tokens[:len(e.key) // 4]) is None:
                        self.disk.remove(name)
            self.disk.write(key, cache, cache_type)

        def _drop(self, model, tokens, in_lru: bool = True, bound: bool = False) -> None:
            super()._drop(model, tokens, in_lru, bound)
            if self.disk is not None and not bound and model == self._disk_model:
                key = pack_tokens(tokens)
                if key is not None:
                    self.disk.remove(file_name(self.disk.identity, key))

        def fetch_nearest_cache(self, model, tokens):
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if self.disk is None or model != self._disk_model or len(tokens) < 2:
                return cache, rest
            key = pack_tokens(tokens[:-1])
            found = None if key is None else self.disk.longest_prefix(key)
            if found is None or len(found[1].key) // 4 <= len(tokens) - len(rest):
                return cache, rest
            loaded = self.disk.read(found[0])
            if loaded is None:
                return cache, rest
            self._served = None  # (no stored answer in memory was found longer)
            return loaded, tokens[len(found[1].key) // 4:]

        def stored_stats(self) -> dict:
            out = super().stored_stats()
            if self.disk is not None:
                out["disk"] = {"folder": str(self.disk_folder), **self.disk.stats()}
            return out

    return DiskConversations
