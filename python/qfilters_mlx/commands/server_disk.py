"""Stored conversations that survive a restart: ``qfilters-mlx server --prompt-cache-dir DIR
[--prompt-cache-disk-bytes N]``.

:func:`disk_conversations_class` extends the server's stored conversations
(:mod:`.server_cache`) with a folder of files (:mod:`.server_files`, indexed by
:class:`~.server_disk_index.DiskIndex`), one per stored entry:

* **what is written**: every entry the stored conversations keep, as it is kept in memory (the
  budget's rows; the rewind journal is not written). An answer is written when its request
  ends, after the reply has been sent; a prompt checkpoint stored during a request is written
  then too, if it is still stored (most are dropped by their own answer).
* **what is removed**: the file of an entry the stored conversations drop because a newer one
  replaces it (an older turn of the same conversation), once an entry that continues it has
  been written (a crash in between leaves the older turn's file, which still serves the
  conversation; the file of another branch, never continued, stays until the bound removes it); files of entries that left memory or came from before a restart, by the same
  rule (:func:`~.server_calls.drops_prefix`), once the new entry is written. Not when an entry
  leaves memory for the count or byte bounds (``--prompt-cache-size``,
  ``--prompt-cache-bytes``): its file stays and serves the conversation. Past ``N`` bytes of
  files, the least recently used are removed (use: written, read, or its entry served from
  memory; the order survives a restart through the files' times).
* **reuse**: a prompt whose longest stored prefix is a file longer than what memory holds loads
  that file (read once; checksum, identity and token key checked before mlx-lm's
  ``load_prompt_cache`` reads the same bytes) and continues from it. A file that fails is
  logged with its name and the request is served from memory or computed again. A loaded entry
  cannot rewind until it has decoded again (no journal is written), so files serve as prefixes
  only.
* **identity** (:func:`~.server_disk_index.cache_identity`): the model (and draft model) by
  their parameters, the cache configuration by the state of fresh caches, and the server flags
  that change what is stored; a file of another identity is never read, and only counts
  towards ``N``.

The index is rebuilt from the folder's file headers when the served model has loaded
(:meth:`open_disk`). Only the served model's conversations are written (not those of a model a
request switches to).
"""

from __future__ import annotations

import logging
import time

from qfilters_mlx.commands.server_calls import PREFILL, drops_prefix, rewind_reach
from qfilters_mlx.commands.server_disk_index import DiskIndex, cache_identity
from qfilters_mlx.commands.server_files import file_name, pack_tokens

__all__ = ["REPLACED_KEPT", "disk_conversations_class"]

REPLACED_KEPT = 1024
"""Files of replaced entries remembered until an entry that continues them is written (those of
another branch of a conversation are never continued: the oldest are forgotten, their files
stay until the disk bound removes them)."""


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
            self._replaced = {}  # files of entries a newer one replaced: name -> packed key

        def open_disk(self, model_key, model, draft_model=None, settings: dict | None = None) -> None:
            """Lock the folder (unless taken before) and index its files for the served model
            (``model_key``: mlx-lm's key of it; ``settings``: the server flags that change what a
            stored cache holds, :func:`~.server_disk_index.cache_identity`). Raises as
            :class:`~.server_disk_index.DiskIndex`."""
            start = time.perf_counter()
            self.disk = DiskIndex(self.disk_folder, self.disk_max_bytes,
                                  cache_identity(model, draft_model, settings), lock)
            self._disk_model = model_key
            st = self.disk.stats()
            logging.info(f"qfilters-mlx: {self.disk_folder}: {st['usable']} stored conversation "
                         f"files of this model and configuration, {st['files']} files, "
                         f"{st['bytes'] / 1e6:.1f} MB (indexed in {time.perf_counter() - start:.2f} s)")

        def _ours(self, model) -> bool:
            return self.disk is not None and model == self._disk_model

        def _insert(self, model, tokens, prompt_cache, cache_type, done):
            super()._insert(model, tokens, prompt_cache, cache_type, done)
            if not self._ours(model) or cache_type == PREFILL:
                return
            if not done:
                self._pending.append(list(tokens))
                return
            pending, self._pending = self._pending, []
            entries = [(t, self._stored(model, t)) for t in pending]
            keys = [self._write(t, e.prompt_cache, e.cache_type) for t, e in entries if e is not None]
            keys.append(self._write(tokens, prompt_cache, cache_type))
            written = [k for k in keys if k is not None]
            for name, key in list(self._replaced.items()):  # (removed once a written entry
                if any(len(w) > len(key) and w.startswith(key) for w in written):  # continues them)
                    del self._replaced[name]
                    self.disk.remove(name)
            while len(self._replaced) > REPLACED_KEPT:  # (another branch's: its file stays)
                del self._replaced[next(iter(self._replaced))]

        def _stored(self, model, tokens):
            try:
                return self._trie.get(model, tokens)
            except KeyError:
                return None

        def _write(self, tokens, cache, cache_type) -> bytes | None:
            """Write an entry; once written, remove the files of entries not in memory that the
            stored conversations' rule drops for it (:func:`~.server_calls.drops_prefix`).
            Returns its packed key, or ``None`` when it was not written."""
            key = pack_tokens(tokens)
            if key is None or not self.disk.write(key, cache, cache_type):
                return None
            if cache_type == "system":
                return key
            old = [(n, e) for n, e in self.disk.prefixes(key) if e.cache_type != "system"]
            prompt = self._expected[0]  # (the request's prompt: an answer's own checkpoint is
            own = None  # its prompt but the last token, which a regenerated answer reuses)
            if cache_type == "assistant" and prompt is not None and tokens[:len(prompt)] == prompt:
                own = len(prompt) - 1
            reach = rewind_reach(cache)
            for name, e in old:
                length = e.n_tokens
                if (self._stored(self._disk_model, tokens[:length]) is None
                        and drops_prefix(len(tokens), reach, e.cache_type, length,
                                         own_prompt=own is not None and length >= own)):
                    self.disk.remove(name)
            return key

        def _drop(self, model, tokens, in_lru: bool = True, bound: bool = False) -> None:
            super()._drop(model, tokens, in_lru, bound)
            if self._ours(model) and not bound:
                key = pack_tokens(tokens)
                if key is not None:
                    self._replaced[file_name(self.disk.identity, key)] = key

        def fetch_nearest_cache(self, model, tokens):
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if not self._ours(model) or len(tokens) < 2:
                return cache, rest
            served = len(tokens) - len(rest)
            key = pack_tokens(tokens[:-1])
            if key is None:
                return cache, rest
            found = self.disk.longest_prefix(key)
            if found is not None and found[1].n_tokens > served:
                loaded = self.disk.read(found[0])
                if loaded is not None:
                    self._served = None  # (no stored answer in memory was found longer)
                    return loaded, tokens[found[1].n_tokens:]
            if served > 0:  # (an entry served from memory: its file was used too)
                self.disk.touch(file_name(self.disk.identity, key[:4 * served]))
            return cache, rest

        def stored_stats(self) -> dict:
            out = super().stored_stats()
            if self.disk is not None:
                out["disk"] = {"folder": str(self.disk_folder), **self.disk.stats()}
            return out

    return DiskConversations
