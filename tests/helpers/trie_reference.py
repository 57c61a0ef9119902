"""The bytes a radix trie of given keys holds, counted from the keys alone: a node at the root,
at every key, and at every prefix where two keys go on with different tokens; each node but
the root holds ``NODE_BYTES`` and its edge's tokens packed (4 bytes per token)."""

import sys

from qfilters_mlx.commands.server_trie import NODE_BYTES


def radix_nodes(keys) -> list:
    """The non-root nodes' prefixes (tuples), shortest first."""
    keys = [tuple(k) for k in keys]
    nodes = {k for k in keys if k}
    nexts = {}
    for k in keys:
        for i in range(len(k)):
            nexts.setdefault(k[:i], set()).add(k[i])
    nodes |= {p for p, toks in nexts.items() if p and len(toks) > 1}
    return sorted(nodes, key=len)


def radix_trie_bytes(keys) -> int:
    nodes = radix_nodes(keys)
    total = 0
    for p in nodes:
        parent = max((len(q) for q in nodes if len(q) < len(p) and p[: len(q)] == q), default=0)
        total += NODE_BYTES + sys.getsizeof(bytes(4 * (len(p) - parent)))
    return total
