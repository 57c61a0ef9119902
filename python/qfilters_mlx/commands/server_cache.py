"""Stored conversations and prompt checkpoints of ``qfilters-mlx server``: mlx-lm's
``LRUPromptCache`` for caches that rewind only so far.

mlx-lm reuses a stored cache for a new prompt in three ways: the stored tokens
are the prompt (exact), a prefix of it (``shorter``: continue from there), or they
run past where the prompt leaves them (``longer``: ``trim`` the copy back to the
shared prefix). It decides the last from ``is_trimmable()``, and drops every stored
prefix of a trimmable conversation ("they just take space"). An eviction cache
rewinds only its last ``qfilters_max_rewind`` tokens after an eviction
(:attr:`QFiltersKVCache.rewindable_tokens`), so here:

* **checkpoints**: mlx-lm's server stores a copy of a request's cache at the end of
  each prompt *segment* (the system prompt, the prompt but its last token: cache
  types ``"system"`` and ``"user"``). :func:`checkpoint_segments` cuts the segments
  further at every multiple of ``every`` tokens of the prompt, so a prompt leaves a
  checkpoint every ``every`` tokens. With ``every <= qfilters_max_rewind`` every
  prefix of a stored prompt is within one rewind of a checkpoint: a new prompt
  sharing ``c`` tokens with it reuses exactly ``c`` (mlx-lm's rule for its own
  trimmable caches, ``min(len(prompt) - 1, c)``). Each checkpoint of an evicting
  cache holds the budget plus the rows its last chunks dropped (kept for exact
  rewinds, :mod:`qfilters_mlx.cache.journal`), at most ``budget + 2 every`` rows per layer.
* ``longer`` is used when every cache of the entry can rewind the tokens it must
  (:func:`rewind_reach`), and the trim is checked to have removed exactly that many;
  otherwise the longest stored prefix is used, as mlx-lm does for untrimmable caches.
  No trim the cache cannot do is ever attempted. The last prompt token is always left
  to compute (mlx-lm's exact match would leave none, which its batch loop refuses).
* a stored prefix is dropped only when the new entry serves every prompt the prefix
  served (:func:`covers`).
* bounds: ``max_size`` conversations (finished requests, type ``"assistant"``) and
  ``max_checkpoints`` checkpoints, each dropped oldest first; mlx-lm's byte bound
  (``--prompt-cache-bytes``) counts both, with the same bytes (``nbytes``).

The log line of a finished request (:func:`request_summary`) compares kept K/V
bytes with a full cache's K/V bytes for the same tokens (like with like), and gives
the bytes every stored conversation holds (``nbytes``, as the caches count them).
"""

from __future__ import annotations

import copy
import logging
import math

__all__ = ["CHECKPOINT_TYPES", "checkpoint_segments", "covers", "prompt_cache_class", "request_summary",
           "rewind_reach", "stored_rows"]

CHECKPOINT_TYPES = ("user", "system")
"""mlx-lm's cache types of prompt checkpoints (dropped in this order, oldest first)."""


def checkpoint_segments(segments, types, every: int):
    """mlx-lm's prompt ``segments`` (lists of token ids, in prompt order) and their cache
    ``types``, cut at every multiple of ``every`` tokens of the whole prompt (absolute
    positions, so a prompt cut the same way whatever part of it came from a stored cache).

    Each piece but the last of a segment is typed ``"user"`` (a checkpoint); the last piece
    keeps the segment's type. ``every <= 0``: unchanged.

    Returns:
        ``(pieces, types)``: lists of equal length; the pieces joined are the segments joined.
    """
    if every <= 0:
        return list(segments), list(types)
    pieces, kinds, start = [], [], 0
    for segment, kind in zip(segments, types):
        end = start + len(segment)
        bounds = [start, *range((start // every + 1) * every, end, every), end]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append(segment[a - start:b - start])
            kinds.append("user")
        kinds[-1] = kind
        start = end
    return pieces, kinds


def covers(new_length: int, new_reach: float, old_length: int, old_reach: float) -> bool:
    """Whether a stored entry of ``new_length`` tokens that can rewind ``new_reach`` serves
    every prompt a stored prefix of it (``old_length`` tokens, rewinding ``old_reach``)
    serves: those sharing at least ``old_length - old_reach`` tokens with it. The new entry
    reuses exactly the shared tokens for prompts sharing ``new_length - new_reach`` or more."""
    return new_length - new_reach <= old_length - old_reach


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


def prompt_cache_class(cache_module, max_checkpoints: int = 64):
    """``LRUPromptCache`` of ``cache_module`` (``mlx_lm.models.cache``) as described above,
    keeping at most ``max_checkpoints`` checkpoints (``StoredConversations(max_size)``: at most
    ``max_size`` conversations)."""

    class ReachTrie(cache_module.PromptTrie):
        """mlx-lm's trie; ``pop_prefixes`` drops only the prefixes the new entry (rewinding
        ``reach``) :func:`covers`."""

        reach = math.inf

        def pop_prefixes(self, model, tokens):
            if self.reach == math.inf:
                return super().pop_prefixes(model, tokens)
            values, current = [], self._trie[model]
            for i, tok in enumerate(tokens):
                value = current.get("__value__")
                if value is not None and covers(len(tokens), self.reach, i,
                                                rewind_reach(value.prompt_cache)):
                    values.append((i, current.pop("__value__")))
                current = current[tok]
            return values

    class StoredConversations(cache_module.LRUPromptCache):
        """mlx-lm's prompt cache that never asks a cache for a rewind it cannot do, and keeps
        at most ``max_size`` conversations and ``max_checkpoints`` checkpoints.

        Attributes:
            finishing: set by the generation loop just before it stores a finished
                request's cache (that insert is logged with :func:`request_summary`).
        """

        def __init__(self, max_size: int = 10, *args, **kwargs):
            super().__init__(max_size, *args, **kwargs)
            self._trie = ReachTrie()
            self.finishing = False
            self.max_checkpoints = max_checkpoints

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            done, self.finishing = self.finishing, False
            self._trie.reach = rewind_reach(prompt_cache)
            limit, self.max_size = self.max_size, math.inf  # (counted per kind below)
            try:
                super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            finally:
                self._trie.reach, self.max_size = math.inf, limit
            lrus = self._lru._lrus
            while len(lrus["assistant"]) > self.max_size:
                self._drop(*lrus["assistant"][0])
            while sum(len(lrus[k]) for k in CHECKPOINT_TYPES) > self.max_checkpoints:
                self._drop(*next(lrus[k][0] for k in CHECKPOINT_TYPES if lrus[k]))
            if done:
                st = self.stored_stats()
                logging.info(f"qfilters-mlx: {request_summary(prompt_cache, len(tokens))}; stored: "
                             f"{st['conversations']} conversations and {st['checkpoints']} "
                             f"checkpoints, {self.nbytes / 1e6:.2f} MB")

        def _drop(self, model, tokens) -> None:
            """Remove one stored entry (trie, LRU order, byte counts), as mlx-lm's ``trim_to``."""
            entry = self._trie.pop(model, tokens)
            self._lru.remove(model, tokens)
            self._n_bytes -= entry.nbytes
            self._n_bytes_by_type[entry.cache_type] -= entry.nbytes

        def fetch_nearest_cache(self, model, tokens):
            head = tokens[:-1]  # the last prompt token is always computed (it gives the logits)
            if not head:
                return None, tokens
            result = self._trie.search(model, head)
            if result.exact is not None:
                entry = self._trie.get(result.model, result.exact)
                return copy.deepcopy(entry.prompt_cache), tokens[len(head):]
            short = len(result.shorter) if result.shorter is not None else 0
            if result.longer is not None:
                prefix = result.common_prefix  # (at most len(head): mlx-lm's min(len - 1, .))
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
            """``sequences`` stored (``conversations`` + ``checkpoints``), ``bytes`` they hold (the
            caches' ``nbytes``; ``checkpoint_bytes`` of them in checkpoints), ``rows_per_layer``
            summed over them (:func:`stored_rows`)."""
            by_type = self.stats_by_type()
            out = {"conversations": by_type["assistant"]["n_sequences"],
                   "checkpoints": sum(by_type[k]["n_sequences"] for k in CHECKPOINT_TYPES),
                   "checkpoint_bytes": sum(by_type[k]["n_bytes"] for k in CHECKPOINT_TYPES)}
            for _ in range(5):  # (read from the HTTP thread while the generation loop inserts)
                try:
                    keys = [k for lru in self._lru._lrus.values() for k in list(lru)]
                    rows = sum(stored_rows(self._trie.get(m, t).prompt_cache) for m, t in keys)
                    return {"sequences": len(keys), "bytes": self.nbytes, "rows_per_layer": rows, **out}
                except (RuntimeError, KeyError):
                    continue
            return {"sequences": len(self), "bytes": self.nbytes, "rows_per_layer": None, **out}

    return StoredConversations
