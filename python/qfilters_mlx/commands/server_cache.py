"""Stored conversations of ``qfilters-mlx server``: mlx-lm's ``LRUPromptCache`` for caches that
rewind only so far.

mlx-lm reuses a stored conversation for a new prompt in three ways: the stored
tokens are the prompt (exact), a prefix of it (``shorter``: continue from there),
or they run past where the prompt leaves them (``longer``: ``trim`` the copy back
to the shared prefix). It decides the last from ``is_trimmable()``, and drops every
stored prefix of a trimmable conversation ("they just take space"). An eviction
cache rewinds only its last ``qfilters_max_rewind`` tokens after an eviction
(:attr:`QFiltersKVCache.rewindable_tokens`), so here:

* ``longer`` is used when every cache of the entry can rewind the tokens it must
  (:func:`rewind_reach`), and the trim is checked to have removed exactly that many;
  otherwise the longest stored prefix is used, as mlx-lm does for untrimmable caches.
  No trim the cache cannot do is ever attempted.
* stored prefixes are dropped only when the new entry can rewind to them: the
  checkpoints mlx-lm stores at the end of the system prompt and of the prompt stay
  reachable after an eviction (each holds at most ``budget`` + one chunk rows).

The log line of a finished request (:func:`request_summary`) compares kept K/V
bytes with a full cache's K/V bytes for the same tokens (like with like), and gives
the bytes every stored conversation holds (``nbytes``, as the caches count them).
"""

from __future__ import annotations

import copy
import logging
import math

__all__ = ["prompt_cache_class", "request_summary", "rewind_reach", "stored_rows"]


def rewind_reach(caches) -> float:
    """Tokens every cache of ``caches`` can remove with ``trim`` now: an eviction cache's
    ``rewindable_tokens``; ``inf`` for a trimmable mlx-lm cache (it trims any count it holds),
    0 for an untrimmable one."""
    reach = math.inf
    for c in caches:
        if hasattr(c, "rewindable_tokens"):
            reach = min(reach, c.rewindable_tokens)
        elif not c.is_trimmable():
            return 0
    return reach


def stored_rows(caches) -> int:
    """Rows per layer a stored conversation holds: the largest K/V buffer over its layers
    (allocated rows, live or not), plus the rows its rewind journal keeps."""
    rows = 0
    for c in caches:
        keys = getattr(c, "keys", None)
        n = 0 if keys is None else (keys[0] if isinstance(keys, tuple) else keys).shape[2]
        journal = getattr(c, "_journal", None)
        if journal is not None:
            for r in journal.records:
                dropped = getattr(r, "dropped", None)
                if dropped is not None:
                    n += dropped[0].shape[2]
        rows = max(rows, n)
    return rows


def request_summary(caches, prompt_tokens: int) -> str:
    """One log line for a finished request: tokens seen and kept; the kept K/V rows' bytes
    against the K/V bytes a full cache holds for the same tokens (both rows x row bytes);
    and everything the caches hold (``nbytes``: buffers with spare rows, scores, filter,
    rewind journal)."""
    ours = [c for c in caches if hasattr(c, "tokens_kept")]
    if not ours:
        return f"request done: {prompt_tokens} tokens, no eviction caches"
    kept = max(c.tokens_kept for c in ours)
    kept_kv = sum(c.kept_kv_bytes for c in ours)
    full = sum(c.full_seq_bytes for c in ours)
    held = sum(c.nbytes for c in ours)
    return (f"request done: {ours[0].tokens_seen} tokens seen, {kept} kept per layer and KV head "
            f"({len(ours)} layers); K/V of the kept tokens {kept_kv / 1e6:.2f} MB, of all tokens "
            f"(a full cache) {full / 1e6:.2f} MB; the cache holds {held / 1e6:.2f} MB "
            f"(buffers, scores, filter, rewind journal)")


def prompt_cache_class(cache_module):
    """``LRUPromptCache`` of ``cache_module`` (``mlx_lm.models.cache``) as described above."""

    class ReachTrie(cache_module.PromptTrie):
        """mlx-lm's trie; ``pop_prefixes`` keeps the prefixes more than ``reach`` tokens back."""

        reach = math.inf

        def pop_prefixes(self, model, tokens):
            if self.reach == math.inf:
                return super().pop_prefixes(model, tokens)
            lo = len(tokens) - self.reach
            values, current = [], self._trie[model]
            for i, tok in enumerate(tokens):
                if i >= lo and "__value__" in current:
                    values.append((i, current.pop("__value__")))
                current = current[tok]
            return values

    class StoredConversations(cache_module.LRUPromptCache):
        """mlx-lm's prompt cache that never asks a cache for a rewind it cannot do.

        Attributes:
            finishing: set by the generation loop just before it stores a finished
                request's cache (that insert is logged with :func:`request_summary`).
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._trie = ReachTrie()
            self.finishing = False

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            done, self.finishing = self.finishing, False
            self._trie.reach = rewind_reach(prompt_cache)
            try:
                super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            finally:
                self._trie.reach = math.inf
            if done:
                logging.info(f"qfilters-mlx: {request_summary(prompt_cache, len(tokens))}; stored: "
                             f"{len(self)} conversations, {self.nbytes / 1e6:.2f} MB")

        def fetch_nearest_cache(self, model, tokens):
            result = self._trie.search(model, tokens)
            if result.exact is not None:
                return super().fetch_nearest_cache(model, tokens)
            short = len(result.shorter) if result.shorter is not None else 0
            if result.longer is not None:
                prefix = min(len(tokens) - 1, result.common_prefix)
                entry = self._trie.get(result.model, result.longer)
                need = len(result.longer) - prefix
                if prefix > short and rewind_reach(entry.prompt_cache) >= need:
                    cache = copy.deepcopy(entry.prompt_cache)
                    if all(c.trim(need) == need for c in cache):
                        return cache, tokens[prefix:]
                    logging.warning("qfilters-mlx: a stored cache trimmed fewer tokens than it "
                                    "reported it could; using a shorter stored prefix")
            if short > 0:
                entry = self._trie.get(result.model, result.shorter)
                return copy.deepcopy(entry.prompt_cache), tokens[short:]
            return None, tokens

        def stored_stats(self) -> dict:
            """``sequences`` stored, ``bytes`` they hold (the caches' ``nbytes``), ``rows_per_layer``
            summed over them (:func:`stored_rows`)."""
            for _ in range(5):  # (read from the HTTP thread while the generation loop inserts)
                try:
                    keys = [k for lru in self._lru._lrus.values() for k in list(lru)]
                    rows = sum(stored_rows(self._trie.get(m, t).prompt_cache) for m, t in keys)
                    return {"sequences": len(keys), "bytes": self.nbytes, "rows_per_layer": rows}
                except (RuntimeError, KeyError):
                    continue
            return {"sequences": len(self), "bytes": self.nbytes, "rows_per_layer": None}

    return StoredConversations
