"""The prompt trie of ``qfilters-mlx server``'s stored conversations: mlx-lm's ``PromptTrie``
queries on a radix trie whose keys are packed 4-byte token ids.

mlx-lm's ``PromptTrie`` holds one dict per token of every stored path (224 bytes each on
64-bit CPython, plus a 28-byte int object per token id of 257 and more), and the LRU order
holds every entry's token list (8 bytes per token): about 1.8 MB for the index of one
7,680-token conversation, more than a tenth of what its budget-bounded cache holds. Here a
node is kept only where a stored entry ends or two stored paths part; each edge holds its
tokens packed (:func:`pack`, 4 bytes per token), and the LRU order holds each key packed
(:func:`compact_order_class`). Searches walk each edge once with slice comparisons
(mlx-lm's longer-entry search copies the path at every node: quadratic in an entry's length).
"""

from __future__ import annotations

import heapq
import itertools
import sys
from array import array

__all__ = ["NODE_BYTES", "compact_order_class", "key_nbytes", "pack", "prompt_trie_class", "unpack"]

_ITEM = array("i").itemsize  # (4: a token id is a C int)


def pack(tokens) -> bytes:
    """Token ids as bytes: 4 per token, native order.

    Raises:
        OverflowError: a token id outside the C int range (no tokenizer has one).
    """
    return array("i", tokens).tobytes()


def unpack(key: bytes) -> list:
    """The token ids :func:`pack` packed, as a list of ints."""
    out = array("i")
    out.frombytes(key)
    return out.tolist()


def key_nbytes(tokens) -> int:
    """Bytes an entry's packed key holds in the LRU order (``sys.getsizeof`` of
    :func:`pack`'s bytes: 4 per token and the object's header)."""
    return sys.getsizeof(b"") + _ITEM * len(tokens)


class _Node:
    __slots__ = ("edges", "value")

    def __init__(self):
        self.edges = {}  # first token id -> (packed tokens of the edge, child node)
        self.value = None


NODE_BYTES = sys.getsizeof(_Node()) + sys.getsizeof({0: None}) + sys.getsizeof((b"", None))
"""Bytes of one trie node besides its edge's packed tokens: the node, a dict of one child,
and the ``(tokens, child)`` pair its parent holds (264 on 64-bit CPython 3.11)."""


def _matched(q: bytes, at: int, label: bytes) -> int:
    """Tokens of ``label`` that ``q`` repeats from its token ``at`` (slice comparisons:
    one when the whole label matches, a binary search for where they part otherwise)."""
    start = at * _ITEM
    n = min(len(label), len(q) - start) // _ITEM
    if q[start:start + n * _ITEM] == label[:n * _ITEM]:
        return n
    lo, hi = 0, n  # q repeats label's first lo tokens, not its first hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if q[start:start + mid * _ITEM] == label[:mid * _ITEM]:
            lo = mid
        else:
            hi = mid
    return lo


def prompt_trie_class(cache_module):
    """A prompt trie answering as ``cache_module.PromptTrie`` (``mlx_lm.models.cache``) does
    (``add``, ``get``, ``pop``, ``search``) and ``prefixes``, on the radix layout described
    above, that counts the bytes it holds (``nbytes``)."""
    Result = cache_module.PromptTrieResult

    class PromptTrie:
        """mlx-lm's prompt trie on packed edges. ``nbytes``: nodes x :data:`NODE_BYTES` plus
        the edges' packed tokens (``sys.getsizeof``), kept up to date by ``add`` and ``pop``."""

        def __init__(self):
            self._roots = {}
            self.nbytes = 0

        def _edge(self, parent, label, child):
            parent.edges[unpack(label[:_ITEM])[0]] = (label, child)

        def add(self, model, tokens, value):
            """Store ``value`` at ``tokens``; returns the value stored there before, or ``None``."""
            q = pack(tokens)  # (before any change: OverflowError for an id no C int holds)
            node = self._roots.setdefault(model, _Node())
            i, n = 0, len(tokens)
            while i < n:
                edge = node.edges.get(tokens[i])
                if edge is None:
                    child, tail = _Node(), q[i * _ITEM:]
                    self._edge(node, tail, child)
                    self.nbytes += NODE_BYTES + sys.getsizeof(tail)
                    node, i = child, n
                    break
                label, child = edge
                m = _matched(q, i, label)
                if m * _ITEM < len(label):  # split the edge where the paths part
                    mid, head, rest = _Node(), label[:m * _ITEM], label[m * _ITEM:]
                    self._edge(mid, rest, child)
                    self._edge(node, head, mid)
                    self.nbytes += NODE_BYTES + sys.getsizeof(head) + sys.getsizeof(rest) - sys.getsizeof(label)
                    child = mid
                node, i = child, i + m
            prev, node.value = node.value, value
            return prev

        def _path(self, model, tokens):
            """``[(parent, edge key, node)]`` from the root to the node that ``tokens`` end at;
            KeyError when no node ends there."""
            q = pack(tokens)
            node = self._roots[model]
            path, i = [(None, None, node)], 0
            while i < len(tokens):
                label, child = node.edges[tokens[i]]
                if _matched(q, i, label) * _ITEM != len(label):
                    raise KeyError(i)
                path.append((node, tokens[i], child))
                node, i = child, i + len(label) // _ITEM
            return path

        def get(self, model, tokens):
            """The value stored at ``tokens``; KeyError when none is."""
            value = self._path(model, tokens)[-1][2].value
            if value is None:
                raise KeyError(len(tokens))
            return value

        def pop(self, model, tokens):
            """Remove and return the value stored at ``tokens`` (KeyError when none is), then
            the nodes left without a purpose: a leaf without a value goes, a node without a
            value and with one child merges into its parent's edge."""
            path = self._path(model, tokens)
            node = path[-1][2]
            value, node.value = node.value, None
            if value is None:
                raise KeyError(len(tokens))
            for parent, key, node in reversed(path[1:]):
                if node.value is not None or len(node.edges) > 1:
                    break
                label = parent.edges.pop(key)[0]
                self.nbytes -= NODE_BYTES + sys.getsizeof(label)
                if node.edges:  # one child: its edge joins this one
                    (tail, child), = node.edges.values()
                    joined = label + tail
                    self._edge(parent, joined, child)
                    self.nbytes += sys.getsizeof(joined) - sys.getsizeof(tail)
                    break
            if not self._roots[model].edges and self._roots[model].value is None:
                del self._roots[model]
            return value

        def _walk(self, model, tokens):
            """Follow ``tokens`` down whole edges: ``(node, i, stops)``, the last node reached
            at token count ``i``, and ``stops`` the ``(count, value)`` of the stored entries
            passed, the root's included. Also ``(label, m)``: the edge ``tokens`` go on into,
            ``m`` of its tokens matched (``None`` when they stop at the node)."""
            q = pack(tokens)
            node, i, stops = self._roots[model], 0, []
            while True:
                if node.value is not None:
                    stops.append((i, node.value))
                edge = node.edges.get(tokens[i]) if i < len(tokens) else None
                if edge is None:
                    return node, i, stops, None
                label, child = edge
                m = _matched(q, i, label)
                if m * _ITEM < len(label):
                    return node, i, stops, (label, m, child)
                node, i = child, i + m

        def search(self, model, tokens):
            """mlx-lm's ``PromptTrie.search``: the exact entry, else the longest stored prefix
            (``shorter``, of two tokens or more), a shortest stored entry extending the common
            prefix (``longer``) and that prefix's length."""
            if model not in self._roots:
                return Result(model, None, None, None, 0)
            node, i, stops, partial = self._walk(model, tokens)
            if not tokens and node.value is not None:
                return Result(model, [], None, None, 0)
            if stops and stops[-1][0] == len(tokens) > 0:
                return Result(model, tokens, None, None, 0)
            last = max((n for n, _ in stops if n > 0), default=0) - 1
            shorter = tokens[: last + 1] if last > 0 else None
            index = i if partial is None else i + partial[1]
            longer = None
            if index > 0:
                start = [(0, b"", node)] if partial is None else [
                    (len(partial[0]) // _ITEM - partial[1], partial[0][partial[1] * _ITEM:], partial[2])]
                longer = tokens[:index] + unpack(_shortest_below(start))
            return Result(model, None, shorter, longer, index)

        def prefixes(self, model, tokens):
            """``(length, value)`` of every stored strict prefix of ``tokens``."""
            if model not in self._roots:
                return []
            return [(n, v) for n, v in self._walk(model, tokens)[2] if n < len(tokens)]

    return PromptTrie


def _shortest_below(start) -> bytes:
    """Packed tokens from a point of the trie to the nearest stored entry below it (fewest
    tokens; ``start``: ``[(tokens to the node, packed tokens to it, node)]``)."""
    order = itertools.count()
    heap = [(n, next(order), path, node) for n, path, node in start]
    while heap:
        n, _, path, node = heapq.heappop(heap)
        if node.value is not None:
            return path
        for label, child in node.edges.values():
            heapq.heappush(heap, (n + len(label) // _ITEM, next(order), path + label, child))
    raise AssertionError("a trie node without a value below it")


def compact_order_class(cache_module):
    """``LRUPromptCache.CacheOrder`` of ``cache_module`` holding each key's tokens packed
    (:func:`pack`: 4 bytes per token, where a token list holds 8 and an int object). The
    same calls take and give token lists; ``keys``, ``oldest`` and ``holds`` read the order
    without reaching into its deques."""

    class CompactOrder(cache_module.LRUPromptCache.CacheOrder):
        def push(self, model, tokens, cache_type="assistant"):
            super().push(model, pack(tokens), cache_type)

        def remove(self, model, tokens):
            super().remove(model, pack(tokens))

        def pop(self):
            model, key = super().pop()
            return model, unpack(key)

        def oldest(self, cache_type):
            """``(model, tokens)`` of the oldest entry of ``cache_type``."""
            model, key = self._lrus[cache_type][0]
            return model, unpack(key)

        def holds(self, model, tokens, cache_type) -> bool:
            return (model, pack(tokens)) in self._lrus[cache_type]

        def keys(self):
            """``(model, tokens)`` of every entry, type by type, oldest first."""
            return [(m, unpack(k)) for lru in self._lrus.values() for m, k in list(lru)]

    return CompactOrder
