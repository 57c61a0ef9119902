"""Stored conversations of ``qfilters-mlx server``: mlx-lm's ``LRUPromptCache`` for caches
that hold a fixed budget and rewind only so far.

mlx-lm's server stores a copy of a request's cache at the end of each prompt *segment*
(the system prompt: type ``"system"``; the prompt but its last token: ``"user"``) and at
the end of the answer (``"assistant"``: prompt and answer). A new prompt reuses the stored
entry that shares most with it: the stored tokens are the prompt or a prefix of it
(continue from there), or they run past where the prompt leaves them (``trim`` a copy back
to the shared prefix). Here, for eviction caches:

* **what an entry holds at rest**: each stored cache is cut to what it needs
  (:meth:`QFiltersKVCache.shrink_to_fit`): its kept rows (the budget; ``budget + 1`` slots
  in decode) and at most ``max_rewind`` rows of rewind journal, as buffers of its
  own (a copy that is a view of a batch's or a prefill chunk's larger buffer would keep
  that buffer alive). The bytes counted (``nbytes``) are then the bytes the process holds.
* **which entries are kept** (per conversation at most a prompt checkpoint and its answer,
  whatever the prompt length; :func:`~.server_calls.drops_prefix`): a new entry drops every stored entry
  it extends, except a ``"system"`` checkpoint (shared by conversations with the same
  system prompt) and, for an answer, the checkpoint of its own prompt while the answer
  cannot rewind back to it. A follow-up turn extends the stored answer; a regenerated
  answer (the same prompt again) is served by the answer rewound over its own tokens, or
  by the prompt checkpoint when the answer is longer than the rewind depth. Requests
  mlx-lm serves one at a time (a ``seed``, ``--kv-bits``, a draft model, images) store
  only their answer: the same prompt again reuses it only within the rewind depth.
* **bounds**, checked whenever an entry is stored, oldest dropped first (mlx-lm's order):
  ``max_size`` answers (``--prompt-cache-size``), ``max_size`` checkpoints, and
  ``max_bytes`` bytes (``--prompt-cache-bytes``) over all entries.
* **reuse**: the longest stored prefix of the prompt continues as is (a follow-up turn: the
  conversation goes on as the library's chat loop with one cache over the turns would).
  ``longer`` (a stored entry rewound back into the prompt) only to a token count the entry
  reaches without splitting a recorded call and that the prompt's cold run also passes
  (:func:`~.server_calls.rewind_target`: a multiple of the prefill step, a call boundary of the prompt
  announced by :meth:`expect_calls`, the prompt's last token, or the end of an entry stored
  here, where a request stopped and the next one continued), so the
  answer is the cold run's; checked to have removed exactly that many. Otherwise the longest
  stored prefix, as mlx-lm does for untrimmable caches. No trim a cache cannot do is ever
  attempted. The last prompt token is always left to compute.
* **prefill**: :func:`~.server_calls.prefill_segments` cuts a prompt's segments at every multiple of the
  prefill step (``--prefill-step-size``), so that the prompt is processed in the calls
  ``mlx_lm.generate`` (and ``qfilters-mlx generate``) makes: ``[0, step)``, ``[step, 2
  step)``, ..., and where the last user message starts (after the template's header of
  that turn, so that two follow-ups of one turn share a call boundary). Those cuts are
  typed ``PREFILL`` and never stored (:mod:`.server_calls`).

The log line of a finished request (:func:`request_summary`) compares kept K/V bytes with a
full cache's K/V bytes for the same tokens, and gives the bytes every stored entry holds.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import OrderedDict

from qfilters_mlx.commands.server_calls import (PREFILL, drops_prefix, rewind_reach, rewind_target,
                                                rows_back_to)
from qfilters_mlx.commands.server_memory import (journal_rows, process_memory, release_freed, request_summary,
                                                 stored_rows)
from qfilters_mlx.commands.server_trie import compact_order_class, key_nbytes, prompt_trie_class

__all__ = ["CHECKPOINT_TYPES", "prompt_cache_class"]

CHECKPOINT_TYPES = ("user", "system")
"""mlx-lm's cache types of prompt checkpoints."""

SYSTEM_END_SLACK = 3
"""Tokens at the end of a system prompt's checkpoint that depend on the text after it (mlx-lm
ends the segment where the rendering with an empty user message departs from the prompt: the
first user token can merge with the template's newline), left out when a second request is
asked whether it repeats a system prompt."""

BRANCH_SCAN = 512
"""Tokens before the point where two branches part searched for the turn end they share."""

TURN_ENDS_KEPT = 4096
"""Stored entries remembered as turn ends (token count and hash of their tokens: where a
request stopped and a later one may have continued), newest kept."""


def _key(model, tokens) -> tuple:
    """What an entry's tokens are remembered by: ``(model, length, hash of the tokens)``."""
    return model, len(tokens), hash(tuple(tokens))


def prompt_cache_class(cache_module, journal_at_rest: int | None = None):
    """``LRUPromptCache`` of ``cache_module`` (``mlx_lm.models.cache``) as described above:
    ``StoredConversations(max_size, max_bytes=None)``. ``journal_at_rest``: rows of rewind
    journal a stored checkpoint keeps (``None``: each cache's ``max_rewind``)."""
    PromptTrie = prompt_trie_class(cache_module)
    CompactOrder = compact_order_class(cache_module)

    class StoredConversations(cache_module.LRUPromptCache):
        """mlx-lm's prompt cache holding, per conversation, at most a prompt checkpoint and
        its answer, each cut to the budget plus the rewind journal (see the module docstring).

        Args:
            max_size: answers kept (and, apart, checkpoints kept).
            max_bytes: bytes all entries may hold together (``None``: no bound).

        Attributes:
            finishing: set by the generation loop just before it stores a finished
                request's cache (that insert is logged with :func:`request_summary`, and
                the memory the request freed is then returned: :func:`release_freed`, so that the
                process keeps what is stored, not the largest request's temporaries).
        """

        journal_at_rest = None

        def __init__(self, max_size: int = 10, max_bytes: int | None = None):
            super().__init__(max_size, 1 << 63 if max_bytes is None else int(max_bytes))
            self._trie = PromptTrie()
            self._lru = CompactOrder()
            self.finishing = False
            self.requests_stored = 0  # requests whose final cache was handed in (stored or not)
            self.prefill_step = 0
            self._expected = (None, frozenset())
            self._turn_ends = OrderedDict()  # (model, length, hash of an entry's tokens) -> None
            self._systems = OrderedDict()  # the same keys, of system prompts seen
            self._prompt_ends = OrderedDict()  # the same keys, of stored answers -> prompt length
            self._served = None  # (prompt, the longer entry its fetch found, common prefix)

        def expect_calls(self, tokens, bounds) -> None:
            """The token counts where the cold run of ``tokens`` (the next prompt fetched, the
            same list object) ends a call: accepted as rewind targets (:func:`rewind_target`)."""
            self._expected = (tokens, frozenset(bounds))

        def _is_turn_end(self, model, tokens) -> bool:
            """Whether ``tokens`` are those of an entry stored here (now or before): a point
            where a request stopped (a checkpoint, an answer) and the next one continued."""
            return _key(model, tokens) in self._turn_ends

        @property
        def nbytes(self) -> int:
            """Bytes of every stored entry: the caches' ``nbytes``, their packed token keys and
            the prompt trie (:func:`~.server_trie.key_nbytes`, ``PromptTrie.nbytes``)."""
            return self._n_bytes + self._trie.nbytes

        def _rest_rows(self, cache) -> int:
            return journal_rows(cache) if self.journal_at_rest is None else self.journal_at_rest

        def _seen_before(self, model, tokens) -> bool:
            """Whether a system prompt's checkpoint of these tokens came before, up to its last
            :data:`SYSTEM_END_SLACK` tokens (remembered from now on)."""
            keys = [_key(model, tokens[:n])
                    for n in range(max(1, len(tokens) - SYSTEM_END_SLACK), len(tokens) + 1)]
            seen = any(k in self._systems for k in keys)
            for k in keys:
                self._systems[k] = None
            while len(self._systems) > TURN_ENDS_KEPT:
                self._systems.popitem(last=False)
            return seen

        def _left_answer(self, model, prompt):
            """``(old, common, end)``: the stored answer ``old`` that the fetch of ``prompt``
            (the request whose answer is being stored) found longer than the ``common`` tokens
            they share, ``end`` the length of that answer's own prompt; ``None`` when the fetch
            found none, or it is no stored answer now."""
            served, self._served = self._served, None
            if served is None or served[0] is not prompt:
                return None
            _, old, common = served
            end = self._prompt_ends.get(_key(model, old))
            if end is None or not self._lru.holds(model, old, "assistant"):
                return None
            return old, common, end

        def _branch_rows(self, model, tokens, prompt_cache, left) -> int | None:
            """Journal rows that take this answer (``tokens``) back to the last turn end before
            the point where it parts from the stored answer ``left`` (:meth:`_left_answer`)
            of another branch, when that answer's own prompt ends after that point (a second
            follow-up of one turn) and the rows are fewer than that answer holds; else
            ``None``. Kept with those rows, this answer stands in for the other: it serves the
            other branch's continuations from that turn end (one answer per conversation, the
            other branch's own turn recomputed)."""
            old, common, end = left
            if common >= end:
                return None
            ends = sorted({n for m, n, _ in self._turn_ends  # (lengths first: few hashes)
                           if m == model and max(common - BRANCH_SCAN, 0) < n <= common}, reverse=True)
            t = next((n for n in ends if self._is_turn_end(model, tokens[:n])), None)
            rows = None if t is None else rows_back_to(prompt_cache, len(tokens), t)
            if rows is None or rows > stored_rows(self._trie.get(model, old).prompt_cache):
                return None
            return rows

        def _moved_past(self, model, tokens, prompt, reach, left) -> bool:
            """Whether ``prompt`` (of the answer ``tokens``, rewinding ``reach``) moved past the
            stored answer ``left`` (:meth:`_left_answer`): it leaves it after that answer's own
            prompt, before its end (the client re-sent it with other tokens), and the new answer
            rewinds into its prompt or its prompt's checkpoint stays (so they serve what it did)."""
            old, common, end = left
            return end <= common < len(old) and (len(tokens) - reach < len(prompt) or any(
                n >= len(prompt) - 1 and e.cache_type != "system"
                for n, e in self._trie.prefixes(model, tokens)))

        def _turn_ended(self, model, tokens) -> None:
            self._turn_ends[_key(model, tokens)] = None
            while len(self._turn_ends) > TURN_ENDS_KEPT:
                self._turn_ends.popitem(last=False)

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            done, self.finishing = self.finishing, False
            try:
                self._insert(model, tokens, prompt_cache, cache_type, done)
            finally:
                self.requests_stored += done  # (after the entry and its drops: /health reads it)

        def _insert(self, model, tokens, prompt_cache, cache_type, done):
            if cache_type == PREFILL:
                return
            self._turn_ended(model, tokens)
            if cache_type == "system" and not self._seen_before(model, tokens):
                return  # (stored once a second request repeats the system prompt)
            prefixes = self._trie.prefixes(model, tokens)
            own = None  # an answer's own prompt checkpoint: its longest non-system prefix
            if cache_type == "assistant":
                own = max((n for n, e in prefixes if e.cache_type != "system"), default=None)
            back = None  # journal rows that take the answer back to its prompt checkpoint
            if own is not None:
                back = rows_back_to(prompt_cache, len(tokens), own)
                checkpoint = stored_rows(self._trie.get(model, tokens[:own]).prompt_cache)
                if back is not None and back > checkpoint:
                    back = None  # (the checkpoint holds fewer rows: it stays)
            prompt = self._expected[0]  # (this request's answer: its tokens start with it)
            answer = cache_type == "assistant" and prompt is not None and tokens[:len(prompt)] == prompt
            left = self._left_answer(model, prompt) if answer else None
            branch = None if left is None else self._branch_rows(model, tokens, prompt_cache, left)
            if branch is not None:  # (rows back to where the other branch's turn ended)
                back = max(back or 0, branch)
            for c in prompt_cache:  # (an answer that replaces its checkpoint also keeps the
                if hasattr(c, "shrink_to_fit"):  # journal the checkpoint would have kept)
                    c.shrink_to_fit(self._rest_rows(c) + (back or 0))
            reach = rewind_reach(prompt_cache)
            entry = self.CacheEntry(prompt_cache, sum(c.nbytes for c in prompt_cache)
                                    + key_nbytes(tokens), cache_type)
            for length, old in prefixes:
                if drops_prefix(len(tokens), reach, old.cache_type, length, own_prompt=length == own):
                    self._drop(model, tokens[:length])
            if left is not None and (branch is not None or self._moved_past(
                    model, tokens, prompt, reach, left)):
                self._drop(model, left[0])
            prev = self._trie.add(model, tokens, entry)
            if prev is not None:
                self._count(prev, -1)
                self._lru.remove(model, tokens)
            self._count(entry, +1)
            self._lru.push(model, tokens, cache_type)
            if answer:
                self._prompt_ends[_key(model, tokens)] = len(prompt)
                while len(self._prompt_ends) > TURN_ENDS_KEPT:
                    self._prompt_ends.popitem(last=False)
            lrus = self._lru._lrus
            while len(lrus["assistant"]) > self.max_size:
                self._drop(*self._lru.oldest("assistant"), bound=True)
            while sum(len(lrus[k]) for k in CHECKPOINT_TYPES) > self.max_size:
                self._drop(*self._lru.oldest(next(k for k in CHECKPOINT_TYPES if lrus[k])), bound=True)
            while self.nbytes > self.max_bytes and len(self._lru):
                self._drop(*self._lru.pop(), in_lru=False, bound=True)
            if done:
                release_freed()  # (a request's temporaries, from MLX's pool and the C heap)
                st = self.stored_stats()
                logging.info(f"qfilters-mlx: {request_summary(prompt_cache, len(tokens))}; stored: "
                             f"{st['conversations']} conversations and {st['checkpoints']} "
                             f"checkpoints, {self.nbytes / 1e6:.2f} MB")

        def trim_to(self, *, n_sequences=None, n_bytes=None):
            n_sequences = math.inf if n_sequences is None else max(0, n_sequences)
            n_bytes = math.inf if n_bytes is None else max(0, n_bytes)
            while len(self._lru) and (len(self._lru) > n_sequences or self.nbytes > n_bytes):
                self._drop(*self._lru.pop(), in_lru=False, bound=True)

        def _count(self, entry, sign: int) -> None:
            self._n_bytes += sign * entry.nbytes
            self._n_bytes_by_type[entry.cache_type] += sign * entry.nbytes

        def _drop(self, model, tokens, in_lru: bool = True, bound: bool = False) -> None:
            """Remove one stored entry (trie, LRU order unless already popped, byte counts);
            ``bound``: for the count or byte bounds (else: a newer entry replaces it)."""
            entry = self._trie.pop(model, tokens)
            if in_lru:
                self._lru.remove(model, tokens)
            self._count(entry, -1)

        def fetch_nearest_cache(self, model, tokens):
            head = tokens[:-1]  # the last prompt token is always computed (it gives the logits)
            if not head:
                return None, tokens
            result = self._trie.search(model, head)
            if result.exact is not None:
                entry = self._trie.get(result.model, result.exact)
                return copy.deepcopy(entry.prompt_cache), tokens[len(head):]
            short = len(result.shorter) if result.shorter is not None else 0
            self._served = None
            if result.longer is not None:
                prefix = result.common_prefix  # (at most len(head): mlx-lm's min(len - 1, .))
                self._served = (tokens, list(result.longer), prefix)
                entry = self._trie.get(result.model, result.longer)
                step = self.prefill_step

                expected = self._expected[1] if self._expected[0] is tokens else ()

                def cold(t):  # a boundary of the prompt's own calls, or where a turn ended
                    return ((step > 0 and t % step == 0) or t == len(head) or t in expected
                            or self._is_turn_end(result.model, tokens[:t]))

                target = rewind_target(entry.prompt_cache, len(result.longer), prefix, short, cold)
                if target is not None:
                    need = len(result.longer) - target
                    cache = copy.deepcopy(entry.prompt_cache)
                    if all(c.trim(need) == need for c in cache):
                        return cache, tokens[target:]
                    logging.warning("qfilters-mlx: a stored cache trimmed fewer tokens than it "
                                    "reported it could; using a shorter stored prefix")
            if short > 0:
                entry = self._trie.get(result.model, result.shorter)
                return copy.deepcopy(entry.prompt_cache), tokens[short:]
            return None, tokens

        def stored_stats(self) -> dict:
            """``conversations`` (answers) and ``checkpoints`` stored, ``sequences`` (both),
            ``bytes`` they hold (the caches' ``nbytes``, cut to what they hold at rest, and
            their tokens: ``index_bytes`` of them in packed token keys and the prompt trie;
            ``checkpoint_bytes`` of them in checkpoints), ``bytes_per_conversation``,
            ``max_bytes`` (``None``: no bound), ``rows_per_layer`` summed over the entries
            (:func:`stored_rows`), ``requests`` (requests whose final cache was handed in to be
            stored, since the start) and the process's memory (:func:`process_memory`)."""
            by_type = self.stats_by_type()
            out = {"conversations": by_type["assistant"]["n_sequences"],
                   "checkpoints": sum(by_type[k]["n_sequences"] for k in CHECKPOINT_TYPES),
                   "checkpoint_bytes": sum(by_type[k]["n_bytes"] for k in CHECKPOINT_TYPES),
                   "max_bytes": None if self.max_bytes >= 1 << 63 else self.max_bytes,
                   "requests": self.requests_stored,
                   "process": process_memory()}
            n = max(out["conversations"], 1)
            for _ in range(5):  # (read from the HTTP thread while the generation loop inserts)
                try:
                    keys = self._lru.keys()
                    rows = sum(stored_rows(self._trie.get(m, t).prompt_cache) for m, t in keys)
                    index = self._trie.nbytes + sum(key_nbytes(t) for _, t in keys)
                    return {"sequences": len(keys), "bytes": self.nbytes, "index_bytes": index,
                            "bytes_per_conversation": self.nbytes / n, "rows_per_layer": rows, **out}
                except (RuntimeError, KeyError):
                    continue
            return {"sequences": len(self), "bytes": self.nbytes, "index_bytes": None,
                    "bytes_per_conversation": self.nbytes / n, "rows_per_layer": None, **out}

    StoredConversations.journal_at_rest = journal_at_rest
    return StoredConversations
