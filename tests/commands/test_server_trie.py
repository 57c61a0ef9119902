"""The prompt trie and LRU order of ``qfilters-mlx server``'s stored conversations
(``commands/server_trie.py``), against mlx-lm's ``PromptTrie`` and ``CacheOrder``:

* after any sequence of adds and pops, ``get``, ``search`` (exact, shorter, common prefix, and a
  longer entry of the shortest length) and the stored strict prefixes are mlx-lm's;
* ``nbytes`` is the radix trie of the stored keys counted from the keys alone
  (``helpers.trie_reference``), and the process's Python allocations for a long entry are
  within what is counted;
* the compact LRU order pops, removes and holds what mlx-lm's order does;
* a search below a long stored entry is linear in its length.
"""

import gc
import random
import sys
import tracemalloc

import mlx_lm.models.cache as cache_module
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.trie_reference import radix_trie_bytes
from qfilters_mlx.commands.server_trie import (compact_order_class, key_nbytes, pack, prompt_trie_class,
                                               unpack)

Trie = prompt_trie_class(cache_module)


def _ref_prefixes(ref, model, q):
    out = []
    for i in range(len(q)):
        try:
            out.append((i, ref.get(model, q[:i])))
        except KeyError:
            continue
    return out


def _paths(rng, n, depth):
    paths = []
    for _ in range(n):
        base = rng.choice(paths) if paths and rng.random() < 0.6 else []
        cut = rng.randrange(len(base) + 1) if base else 0
        paths.append(base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(1, depth))])
    return paths


def _check(ours, ref, stored, queries):
    assert ours.nbytes == radix_trie_bytes(stored)
    for q in queries:
        a, b = ours.search("m", q), ref.search("m", q)
        assert (a.exact, a.shorter, a.common_prefix) == (b.exact, b.shorter, b.common_prefix), q
        assert (a.longer is None) == (b.longer is None)
        if a.longer is not None:
            assert len(a.longer) == len(b.longer) and a.longer[: a.common_prefix] == q[: a.common_prefix]
            assert a.longer in stored
        assert ours.prefixes("m", q) == _ref_prefixes(ref, "m", q)
    for p in stored:
        assert ours.get("m", p) is ref.get("m", p)


@pytest.mark.parametrize("seed", range(30))
def test_search_get_and_prefixes_are_mlx_lms_after_adds_and_pops(seed):
    rng = random.Random(seed)
    ours, ref = Trie(), cache_module.PromptTrie()
    stored = []
    for p in _paths(rng, 14, 12):
        value = object()
        assert ours.add("m", p, value) is (ref.get("m", p) if p in stored else None)
        ref.add("m", p, value)
        stored = stored + [p] if p not in stored else stored
    _check(ours, ref, stored, _paths(rng, 20, 14) + stored)
    for p in rng.sample(stored, len(stored) // 2):  # pops merge and remove nodes
        assert ours.pop("m", p) is ref.pop("m", p)
        stored.remove(p)
        _check(ours, ref, stored, stored + _paths(rng, 6, 14))
    for p in list(stored):
        ours.pop("m", p)
    assert ours.nbytes == 0 and ours.search("m", [1]).common_prefix == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(-3, 3), max_size=8), max_size=10), st.data())
def test_any_adds_then_pops_keep_the_count_and_the_answers(paths, data):
    ours, ref = Trie(), cache_module.PromptTrie()
    stored = []
    for p in paths:
        v = object()
        ours.add("m", p, v)
        ref.add("m", p, v)
        if p not in stored:
            stored.append(p)
    _check(ours, ref, stored, stored + [p + [0] for p in stored] + [p[:-1] for p in stored])
    for p in data.draw(st.permutations(stored)):
        assert ours.pop("m", p) is ref.pop("m", p)
        stored.remove(p)
        _check(ours, ref, stored, stored)


def test_a_missing_entry_and_a_token_id_no_c_int_holds_raise_before_any_change():
    ours = Trie()
    ours.add("m", [1, 2, 3], "v")
    before = ours.nbytes
    for bad in ([1, 2], [1, 2, 3, 4], [9]):
        with pytest.raises(KeyError):
            ours.get("m", bad)
        with pytest.raises(KeyError):
            ours.pop("m", bad)
    with pytest.raises(KeyError):
        ours.get("other", [1, 2, 3])
    with pytest.raises(OverflowError):
        ours.add("m", [1, 2, 2**40], "w")
    assert ours.nbytes == before and ours.get("m", [1, 2, 3]) == "v"
    assert ours.search("m", [1, 2, 3]).exact == [1, 2, 3]


def test_the_compact_order_is_mlx_lms_order():
    rng = random.Random(0)
    ours, ref = compact_order_class(cache_module)(), cache_module.LRUPromptCache.CacheOrder()
    keys = _paths(rng, 30, 6)
    live = []
    for i, k in enumerate(keys):
        kind = ["assistant", "user", "system"][i % 3]
        if (kind, k) in [(t, x) for t, x in live]:
            continue
        ours.push("m", k, kind)
        ref.push("m", k, kind)
        live.append((kind, k))
        if i % 4 == 3:
            kind, k = live.pop(rng.randrange(len(live)))
            ours.remove("m", k)
            ref.remove("m", k)
        if i % 7 == 6:
            assert ours.pop() == ref.pop()
        assert len(ours) == len(ref)
        assert ours.keys() == [(m, t) for lru in ref._lrus.values() for m, t in lru]
        for kind in ref._lrus:
            if ref._lrus[kind]:
                assert ours.oldest(kind) == ref._lrus[kind][0]
                assert ours.holds(*ref._lrus[kind][0], kind)


def test_pack_round_trips_token_ids():
    ids = [0, 1, 255, 256, 151_643, 2**31 - 1, -1]
    assert unpack(pack(ids)) == ids and len(pack(ids)) == 4 * len(ids)
    assert key_nbytes(ids) == sys.getsizeof(pack(ids))


def test_a_long_entry_holds_in_the_process_what_is_counted():
    """A 7,680-token checkpoint and its 8,080-token answer (ids of a 49k vocabulary, the source
    lists then freed), added to a store: the Python memory the trie and the order grow by
    (tracemalloc) is within what ``nbytes`` and ``key_nbytes`` count plus 1 KB, under 7 bytes
    per token of the two keys (mlx-lm's dict trie and token lists: about 150)."""
    rng = random.Random(1)
    tokens = [rng.randrange(300, 49_152) for _ in range(7_680)]
    answer = tokens + [rng.randrange(300, 49_152) for _ in range(400)]
    trie, order = Trie(), compact_order_class(cache_module)()
    trie.add("m", [1], None)  # (the store's own objects: the root, the deques' first blocks)
    for kind in ("user", "assistant"):
        order.push("m", [1], kind)
    gc.collect()
    tracemalloc.start()
    base, before = tracemalloc.get_traced_memory()[0], trie.nbytes
    for k, kind in ((tokens, "user"), (answer, "assistant")):
        trie.add("m", list(k), object())
        order.push("m", list(k), kind)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    counted = trie.nbytes - before + key_nbytes(tokens) + key_nbytes(answer)
    assert held <= counted + 1024, (held, counted)
    assert counted < 7 * (len(tokens) + len(answer))


def test_the_trie_search_is_linear_in_a_long_stored_entry():
    """mlx-lm's search copies the path at every node below the divergence (quadratic: 10 times
    the entry, 100 times the work); ours walks it once: 10 times the entry costs about 10 times
    as much (paired in one process, the best of 3 each; bound 40)."""
    import time

    def cost(n):
        trie = Trie()
        trie.add("m", list(range(n)), object())
        trie.add("m", list(range(n // 2)) + [-1], object())
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            result = trie.search("m", [0, 1, -5])
            best = min(best, time.perf_counter() - t)
        assert result.longer == list(range(n // 2)) + [-1] and result.common_prefix == 2
        return best

    small, large = cost(4_000), cost(40_000)
    assert large < 40 * small, (small, large)
