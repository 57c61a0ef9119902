"""The rewind journal (``cache/journal.py``) pinned exactly: its reach, its bytes, and rewinds
across every kind of record (behaviour the mutation check of ``cache/journal.py``,
``cache/rewind.py`` and ``cache/slots.py`` needs pinned: ``tools/mutation.py``,
bench/results/mutation.md).

* reach (journal.py / ``rewindable_tokens``): the journal keeps the records of the newest
  calls covering at least ``qfilters_max_rewind`` tokens (one record per call, a decode step
  being a 1-token call); after an eviction ``trim`` can remove ``min(depth, tokens those
  records cover)``; a plain trim before any eviction forgets the trimmed tokens (whole calls
  and the tail of one); a compression clears it;
* bytes (``journal_nbytes``, formula of journal.py and accounting.py): per decode step
  ``B H (4 + (D_k + D_v) itemsize + 12)``, the step entering slot mode ``12 B H capacity``,
  per call the rows its eviction dropped, plus the free slot's rows;
* rewinds (README "Speculative decoding"): whole calls, decode steps, the tail of a call,
  across ``kept_positions()`` (which leaves slot mode), from a cache reloaded in slot mode:
  bit-identical to a cache that never saw the removed tokens, and both continue alike;
* ``dropped_rows``: the rows not kept, ascending, also past float32's exact integers.

References: a cache fed only the surviving calls (``assert_same`` of
``tests/test_exact_cache.py``: state, meta, offset, size, nbytes, journal bytes), the
byte formula and the reach rule written out, numpy (``np.setdiff1d``).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.cache.journal import dropped_rows
from test_exact_cache import (H, D, assert_same, assert_same_view, feed, fixed_cache, int_data, observable,
                              observed_query_cache)

BUDGET = 12
ROW = 2 * D * 4 + 4 + 8  # bytes of one row per (batch row, head): float32 K and V, score, position
STEP_BYTES = H * (4 + ROW)  # a decode step's record (B = 1): its slot (int32) and the rows it held
KP = "kept_positions"


def run(ops, k, v, f, depth=64):
    """A cache fed ``ops`` (an int: a call of that many tokens; ``KP``: ``kept_positions()``)."""
    c = fixed_cache(f, budget=BUDGET, depth=depth)
    start = 0
    for op in ops:
        if op == KP:
            c.kept_positions()
        else:
            start = feed(c, k, v, [op], start=start)
    return c


def tokens(ops):
    return sum(op for op in ops if op != KP)


# ------------------------------------------------------------------ rewinds
OPS = [14, 1, 1, 1, KP, 1, 1, 3, 1, KP, 2, 1, 4]


@pytest.mark.parametrize("cut", [i for i in range(1, len(OPS)) if OPS[i] != KP])
def test_rewinding_any_tail_of_calls_steps_and_layout_switches_is_exact(cut):
    """A cache fed ``OPS`` (an eviction, slot-mode steps, ``kept_positions()`` between them,
    calls from slot mode and from temporal order) and rewound by the tokens of ``OPS[cut:]``
    is the cache fed ``OPS[:cut]``, down to its journal bytes (the depth covers every token:
    the same records remain); rewound to one token into the first removed call (when it has
    more), it is the cache fed that token too; all continue alike."""
    k, v, f = int_data(64, seed=21)
    n = tokens(OPS[cut:])
    first = OPS[cut]
    for back, kept in [(n, OPS[:cut])] + ([(n - 1, OPS[:cut] + [1])] if first > 1 else []):
        a, b = run(OPS, k, v, f), run(kept, k, v, f)
        assert a.evicted and a.rewindable_tokens == tokens(OPS)  # every token (depth 64)
        assert a.trim(back) == back
        assert_same(a, b)
        start = tokens(kept)
        for L in (1, 2, 1, 1):
            for c in (a, b):
                feed(c, k, v, [L], start=start)
            start += L
            assert_same(a, b)


def test_a_cache_reloaded_in_slot_mode_rewinds_its_first_call_exactly(tmp_path):
    """A reloaded cache holds no journal nor the free slot's rows; a call fed after the reload
    (which leaves slot mode) is rewound exactly: the reloaded cache again, which continues
    like the cache that was saved."""
    k, v, f = int_data(40, seed=22)
    c = run([14, 1, 1], k, v, f)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [c])
    a, b = load_prompt_cache(path)[0], load_prompt_cache(path)[0]
    feed(a, k, v, [3], start=16)
    assert a.rewindable_tokens == 3
    assert a.trim(3) == 3
    assert_same(a, b)
    for x in (a, b, c):
        feed(x, k, v, [1, 1], start=16)
    assert_same(a, b)
    assert [np.array(x).tolist() for x in a.state[:4]] == [np.array(x).tolist() for x in c.state[:4]]


# -------------------------------------------------------------------- reach
def covered(calls, depth):
    """The rule written out: the tokens of the newest calls covering at least ``depth``
    tokens (all, when fewer were fed); ``trim`` can remove ``min(depth, covered)``."""
    total = 0
    for L in reversed(calls):
        total += L
        if total >= depth:
            break
    return total


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 7])
def test_rewindable_tokens_after_an_eviction_follow_the_reach_rule(depth):
    k, v, f = int_data(64, seed=23)
    calls = [14, 2, 1, 1, 3, 1, 1, 1, 5, 1]
    c = fixed_cache(f, budget=BUDGET, depth=depth)
    start = 0
    for i, L in enumerate(calls):
        start = feed(c, k, v, [L], start=start)
        assert c.rewindable_tokens == min(depth, covered(calls[: i + 1], depth))
    # a rewind uses up the records it replays
    assert c.trim(1) == 1 and c.rewindable_tokens == min(depth, covered(calls, depth) - 1)


def cut(calls, back):
    """The calls left after removing the newest ``back`` tokens (a call cut inside keeps its head)."""
    calls = list(calls)
    while back > 0:
        last = calls.pop()
        if last > back:
            calls.append(last - back)
        back -= min(last, back)
    return calls


@pytest.mark.parametrize("trims", [[1, 1, 4], [1, 4]], ids=["tail_of_a_call", "whole_calls"])
def test_plain_trims_before_an_eviction_shorten_the_journal_exactly(trims):
    """Before any eviction ``trim`` drops the newest tokens, also from the journal: a single
    token, a whole call, several calls and the tail of one; the evicting calls after it then
    rewind across the trimmed calls exactly (the cache fed only the surviving tokens), and
    ``rewindable_tokens`` counts exactly the tokens fed since the build (depth 64)."""
    k, v, f = int_data(64, seed=24)
    fed = [3, 3, 3, 2]  # 11 tokens: nothing evicted (budget 12)
    later = [5, 3, 1, 1]  # the 3-token call evicts
    left = cut(fed, sum(trims))

    def trimmed():
        x = run(fed, k, v, f)
        for n in trims:
            assert not x.evicted and x.rewindable_tokens == x.size()
            assert x.trim(n) == n
        return x

    a, b = trimmed(), run(left, k, v, f)
    assert_same(a, b)
    for c in (a, b):
        feed(c, k, v, later, start=sum(left))
    assert_same(a, b)
    total = sum(left) + sum(later)
    assert a.evicted and a.rewindable_tokens == total
    for back in (2, 4, 5, 10, 11, 12, total - 1):
        x = trimmed()
        feed(x, k, v, later, start=sum(left))
        assert x.trim(back) == back
        assert_same(x, run(cut(left + later, back), k, v, f))
        assert x.rewindable_tokens == (total - back if x.evicted else x.size())


def test_a_compression_clears_the_journal():
    """compress(): rewinds cannot cross the compression (nothing rewindable right after it,
    ``trim`` raises naming ``qfilters_max_rewind``); tokens fed after it refill the journal."""
    k, v, f = int_data(40, seed=25)
    c = QFiltersKVCache(KVCacheConfig(
        method="qfilters", qfilters_mode="compress_once", qfilters_compress_at="manual",
        qfilters_budget=8, qfilters_n_sink=2, qfilters_recent=2, qfilters_growth=2,
        qfilters_max_rewind=8, qfilters_backend="reference"), filters=mx.array(f))
    feed(c, k, v, [20])
    assert c.compress() == 8 and c.evicted
    assert c.rewindable_tokens == 0 and c.journal_nbytes == 0
    with pytest.raises(ValueError, match=r"cannot rewind 1 tokens.*qfilters_max_rewind=8"):
        c.trim(1)
    feed(c, k, v, [3, 1], start=20)  # 12 rows > 8 + 2: evicted again
    assert c.rewindable_tokens == 4
    with pytest.raises(ValueError, match=r"cannot rewind 5 tokens.*qfilters_max_rewind=8"):
        c.trim(5)
    assert c.trim(4) == 4 and c.rewindable_tokens == 0


def test_queries_that_do_not_fit_a_reloaded_or_trimmed_cache_raise_naming_the_shapes(tmp_path):
    """observe_queries on a query-calibrating cache with an empty journal (reloaded, or trimmed
    back past every journaled call) raises the documented ValueError naming the shapes, before
    anything changes (journal bytes, state); then queries that fit are taken."""
    c, k, q = observed_query_cache(26, 6, 7, qfilters_budget=12, qfilters_calib_tokens=16,
                                   qfilters_max_rewind=2)
    for L in (3, 3):
        c.update_and_fetch(k[:, :, :L], k[:, :, :L])
        c.observe_queries(q[:, :, :L])
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    r = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
    assert c.trim(3) == 3  # the journal (depth 2) held only the last call
    r.queries_observed = True
    for x, offset in ((c, 3), (r, 6)):
        before = observable(x)
        with pytest.raises(ValueError, match=rf"queries \(1, 4, 7, 8\) do not fit the cache "
                                             rf"\(B=1, H_kv=2, D=8, offset={offset}\)"):
            x.observe_queries(q)
        assert_same_view(before, observable(x))
        x.observe_queries(q[:, :, :offset])  # fits; the empty journal has no record to note it in
        assert_same_view(before, observable(x))  # (the first queries are all kept already)


# -------------------------------------------------------------------- bytes
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_journal_bytes_follow_the_formula(depth):
    """``journal_nbytes`` = the records of the reach rule, each at the documented size, plus
    the free slot's rows (``ROW`` bytes per head) once in slot mode."""
    k, v, f = int_data(64, seed=27)
    c = fixed_cache(f, budget=BUDGET, depth=depth)
    feed(c, k, v, [14])  # evicts 2 rows
    assert c.journal_nbytes == H * 2 * ROW
    feed(c, k, v, [1], start=14)  # enters slot mode: the 12-row scores/positions buffers
    entering = H * 12 * (4 + 8)
    assert c.journal_nbytes == (H * 2 * ROW if depth > 1 else 0) + entering + H * ROW
    feed(c, k, v, [1, 1, 1, 1], start=15)
    assert c.journal_nbytes == depth * STEP_BYTES + H * ROW
    feed(c, k, v, [3], start=19)  # from slot mode: 3 rows dropped, the slot layout left
    layout = H * 12 * 4 + H * 4 + H * ROW  # order [B, H, 12] int32, free slot, its rows
    steps = max(0, depth - 3) * STEP_BYTES
    assert c.journal_nbytes == H * 3 * ROW + layout + steps
    c.kept_positions()  # already temporal: nothing journaled
    assert c.journal_nbytes == H * 3 * ROW + layout + steps


# ------------------------------------------------------------- dropped rows
def test_dropped_rows_are_the_rows_not_kept_ascending_past_float32_integers():
    """``dropped_rows(kept, arrays)``: the rows of ``arrays`` not in ``kept``, ascending, for any
    row count (here ``2**24 + 1`` rows, past the integers float32 holds exactly)."""
    n = 2**24 + 1
    kept = np.array([0, 5, 7], np.int64)  # (row 0 kept, row 2**24 dropped)
    pos = mx.arange(n, dtype=mx.int64).reshape(1, 1, n)
    keys = mx.zeros((1, 1, n, 1), mx.float16)
    out = dropped_rows(mx.array(kept.reshape(1, 1, 3)), (keys, keys, mx.zeros((1, 1, n)), pos))
    assert out[0].shape == (1, 1, n - 3, 1) and out[2].shape == (1, 1, n - 3)
    assert np.array_equal(np.array(out[3])[0, 0], np.delete(np.arange(n), kept))


def test_queries_that_do_not_fit_change_nothing_not_even_the_journal():
    """No state change before an error: queries that do not fit leave the journal (its bytes),
    the kept queries and the pending flag as they were; the fitting ones are then noted in the
    call's record (``journal_nbytes`` grows by exactly their bytes)."""
    c, k, q = observed_query_cache(31, 3, 5, qfilters_budget=12, qfilters_calib_tokens=16,
                                   qfilters_max_rewind=2)
    c.update_and_fetch(k, k)
    before = observable(c)
    for bad in (q, q[:, :3], q[..., :4]):  # too many tokens, H_q not a multiple of H_kv, wrong D
        with pytest.raises(ValueError, match=r"do not fit the cache \(B=1, H_kv=2, D=8, offset=3\)"):
            c.observe_queries(bad)
        assert_same_view(before, observable(c))
        assert c._queries_pending  # (still owed: the next update refuses)
    c.observe_queries(q[:, :, :3])
    assert c.journal_nbytes == before[-1] + q[:, :, :3].nbytes
    np.testing.assert_array_equal(np.array(c.state[5]), np.array(q[:, :, :3]))
