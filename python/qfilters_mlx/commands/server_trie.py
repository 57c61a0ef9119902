"""The prompt trie of ``qfilters-mlx server``'s stored conversations: mlx-lm's ``PromptTrie``
with a search linear in the tokens it walks.

mlx-lm's ``PromptTrie.search`` looks for the shortest stored entry that extends the
shared prefix by a depth-first walk that copies the path at every node, quadratic in a
stored entry's length (a 60,000-token entry: about 1.8 x 10^9 list items copied, on the
generation thread). Here the walk is breadth first with parent links: each node below
the divergence is visited once, and the path is rebuilt once.
"""

from __future__ import annotations

import sys
from collections import deque

__all__ = ["INT_BYTES", "NODE_BYTES", "key_nbytes", "linear_trie_class"]

NODE_BYTES = sys.getsizeof({0: {}})
"""Bytes of one trie node: a dict holding one child (224 on 64-bit CPython 3.11)."""

INT_BYTES = sys.getsizeof(2**16)
"""Bytes of one token id's int object (28 on 64-bit CPython)."""


def key_nbytes(tokens) -> int:
    """Bytes a stored entry's token list holds: the list (``sys.getsizeof``) and an int
    object per token (:data:`INT_BYTES`; ids under 257 are CPython's shared small ints, and
    the trie's keys are the same objects)."""
    return sys.getsizeof(tokens) + INT_BYTES * len(tokens)


def _longer(node):
    """The shortest token path below trie ``node`` that ends at a stored value (breadth
    first: linear in the nodes visited), or ``None``."""
    queue = deque([(node, None)])  # (node, index in `seen` of the path that leads to it)
    seen = []  # (parent index, token)
    while queue:
        current, at = queue.popleft()
        if "__value__" in current:
            path = []
            while at is not None:
                at, tok = seen[at]
                path.append(tok)
            return path[::-1]
        for tok, child in current.items():
            if tok != "__value__":
                seen.append((at, tok))
                queue.append((child, len(seen) - 1))
    return None


def linear_trie_class(cache_module):
    """``PromptTrie`` of ``cache_module`` (``mlx_lm.models.cache``) with a linear ``search``
    (same results: the exact entry, the longest stored prefix, the common prefix, and a
    shortest stored extension) and ``prefixes``."""

    class LinearTrie(cache_module.PromptTrie):
        """mlx-lm's trie whose ``search`` is linear in the tokens it walks (mlx-lm's copies
        the path at every node of its longer-entry search: quadratic in a stored entry's
        length), and that counts its nodes (``nbytes``: nodes x :data:`NODE_BYTES`)."""

        def __init__(self):
            super().__init__()
            self.nodes = 0

        @property
        def nbytes(self) -> int:
            return self.nodes * NODE_BYTES

        def add(self, model, tokens, value):
            current = self._trie.setdefault(model, {})
            for tok in tokens:
                child = current.get(tok)
                if child is None:
                    child = current[tok] = {}
                    self.nodes += 1
                current = child
            prev = current.get("__value__")
            current["__value__"] = value
            return prev

        def pop(self, model, tokens):
            path = [self._trie[model]]
            for tok in tokens:
                path.append(path[-1][tok])
            value = path[-1].pop("__value__")
            for i in range(len(tokens), 0, -1):
                if path[i]:
                    break
                del path[i - 1][tokens[i - 1]]
                self.nodes -= 1
            return value

        def search(self, model, tokens):
            result = cache_module.PromptTrieResult
            if model not in self._trie:
                return result(model, None, None, None, 0)
            current = self._trie[model]
            if not tokens and "__value__" in current:
                return result(model, [], None, None, 0)
            last, index = -1, 0
            while index < len(tokens) and tokens[index] in current:
                current = current[tokens[index]]
                if "__value__" in current:
                    last = index
                index += 1
            if last == len(tokens) - 1 >= 0:
                return result(model, tokens, None, None, 0)
            shorter = tokens[: last + 1] if last > 0 else None
            longer = None
            if index > 0:
                extra = _longer(current)
                longer = None if extra is None else tokens[:index] + extra
            return result(model, None, shorter, longer, index)

        def prefixes(self, model, tokens):
            """``(length, entry)`` of every stored strict prefix of ``tokens``."""
            out, current = [], self._trie.get(model, {})
            for i, tok in enumerate(tokens):
                value = current.get("__value__")
                if value is not None:
                    out.append((i, value))
                current = current.get(tok)
                if current is None:
                    break
            return out

    return LinearTrie
