"""Prompt checkpoints of ``qfilters-mlx server`` (``commands/server_cache.py``), without HTTP.

The rules written out here:

* cutting: a prompt's pieces end at every segment end and at every multiple of ``every``
  inside the prompt; a piece ending a segment keeps that segment's type, the others are
  ``"user"`` (mlx-lm's checkpoint type);
* selection: with a checkpoint every ``every <= qfilters_max_rewind`` tokens of a stored
  prompt, a new prompt sharing ``c`` tokens with it reuses ``min(len(prompt) - 1, c)`` tokens
  (mlx-lm's rule for its full caches), and the cache it gets equals one that was fed the same
  pieces up to the last boundary before ``c`` and then the rest up to ``c`` (same kept
  positions; K/V up to float32 rounding);
* bounds: at most ``max_size`` conversations and ``max_checkpoints`` checkpoints, the
  oldest of each dropped first; the bytes counted are the sum of the kept caches' ``nbytes``.
"""

import copy

import mlx.core as mx
import mlx_lm.models.cache as cache_module
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.batch_helpers import config, tiny_llama
from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.commands.server_cache import checkpoint_segments, prompt_cache_class

EVERY = 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(0, 17))
def test_pieces_end_at_segment_ends_and_multiples_of_every(lengths, every):
    types = ["system", "user", "assistant", "user"][: len(lengths)]
    segments, start = [], 0
    for n in lengths:
        segments.append(list(range(start, start + n)))
        start += n
    pieces, kinds = checkpoint_segments(segments, types, every)
    assert sum(pieces, []) == list(range(start)) and all(pieces)
    ends = {sum(lengths[: i + 1]): types[i] for i in range(len(lengths))}
    cuts = set(range(every, start, every)) if every > 0 else set()
    expected = sorted(set(ends) | cuts)
    got, pos = [], 0
    for p in pieces:
        pos += len(p)
        got.append(pos)
    assert got == expected
    assert kinds == [ends.get(e, "user") for e in expected]


def _feed(model, cfg, pieces):
    caches = KVCacheBuilder.for_model(model, cfg)
    for p in pieces:
        model(mx.array([p]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _same(a, b):
    """Same tokens seen, same kept positions and metadata; K/V, scores, filter equal up to
    float32 rounding (a token's K/V computed inside a longer call are summed in another order)."""
    for x, y in zip(a, b):
        assert x.offset == y.offset
        sx, sy = x.state, y.state
        assert mx.array_equal(sx[3], sy[3]).item() and sx[6] == sy[6]
        for u, v in zip(sx[:6], sy[:6]):
            assert (u is None) == (v is None)
            if u is not None:
                assert mx.allclose(u, v, rtol=1e-5, atol=1e-4).item()


@pytest.fixture(scope="module")
def stored():
    """A 60-token prompt fed in pieces cut every ``EVERY`` tokens (budget 16: evicting from
    the third piece on), a checkpoint stored at each piece end, as the server stores them."""
    model = tiny_llama()
    cfg = config(qfilters_max_rewind=EVERY)
    toks = [(7 * i + 3) % 90 + 1 for i in range(60)]
    store = prompt_cache_class(cache_module, max_checkpoints=100)(10)
    pieces, kinds = checkpoint_segments([toks], ["user"], EVERY)
    caches = KVCacheBuilder.for_model(model, cfg)
    done = 0
    for p, kind in zip(pieces, kinds):
        model(mx.array([p]), cache=caches)
        done += len(p)
        store.insert_cache("m", toks[:done], copy.deepcopy(caches), cache_type=kind)
    assert caches[0].evicted
    return model, cfg, toks, store


@pytest.mark.parametrize("diverge", [True, False])
def test_every_shared_prefix_is_reused_exactly(stored, diverge):
    model, cfg, toks, store = stored
    for c in range(1, len(toks)):
        prompt = toks[:c] + ([0, 5] if diverge else [toks[c]])  # (token 0 is never in toks)
        cache, rest = store.fetch_nearest_cache("m", prompt)
        reused = len(prompt) - len(rest)
        assert reused == min(len(prompt) - 1, c) and rest == prompt[reused:], c
        below = (reused // EVERY) * EVERY
        pieces, _ = checkpoint_segments([toks[:below]], ["user"], EVERY)
        reference = _feed(model, cfg, [p for p in pieces if p] + ([toks[below:reused]] if reused > below else []))
        _same(cache, reference)


def test_the_stored_checkpoints_are_not_changed_by_a_fetch(stored):
    model, cfg, toks, store = stored
    before = [(len(store), store.nbytes)]
    store.fetch_nearest_cache("m", toks[:21] + [0])
    cache, rest = store.fetch_nearest_cache("m", toks[:24] + [0])
    assert len(rest) == 1
    _same(cache, _feed(model, cfg, checkpoint_segments([toks[:24]], ["user"], EVERY)[0]))
    assert [(len(store), store.nbytes)] == before


def test_conversations_and_checkpoints_are_bounded_oldest_first_and_bytes_are_the_caches():
    model = tiny_llama()
    cfg = config(qfilters_max_rewind=EVERY)
    store = prompt_cache_class(cache_module, max_checkpoints=3)(2)
    inserted = []
    for i in range(5):
        toks = [i + 1] + [(5 * j + i) % 90 + 1 for j in range(39)]  # (more than EVERY apart:
        for n, kind in ((10, "user"), (24, "system"), (40, "assistant")):  # no rewind between them)
            caches = _feed(model, cfg, [toks[:n]])
            store.insert_cache("m", toks[:n], caches, cache_type=kind)
            inserted.append((kind, toks[:n], caches))
    kept = [x for x in inserted if x[0] == "assistant"][-2:]
    checkpoints = [x for x in inserted if x[0] != "assistant"]
    # dropped oldest first, "user" checkpoints before "system" ones
    user = [x for x in checkpoints if x[0] == "user"]
    system = [x for x in checkpoints if x[0] == "system"]
    kept += system[-3:] if len(system) >= 3 else system + user[-(3 - len(system)):]
    stats = store.stored_stats()
    assert stats["conversations"] == 2 and stats["checkpoints"] == 3 and len(store) == 5
    assert store.nbytes == sum(c.nbytes for _, _, caches in kept for c in caches)
    assert stats["checkpoint_bytes"] == sum(c.nbytes for k, _, caches in kept if k != "assistant"
                                            for c in caches)
    for kind, toks, _ in inserted:
        present = any(t == toks for _, t, _ in kept)
        cache, rest = store.fetch_nearest_cache("m", toks + [0])
        assert (len(rest) == 1) == present, (kind, len(toks))


def test_checkpoints_are_spaced_by_the_rewind_depth_unless_given(capsys):
    """Default spacing = ``qfilters_max_rewind`` (every prefix within one rewind of a checkpoint);
    none for full caches; a spacing over depth + 1 is said on stderr."""
    from qfilters_mlx.commands.server import checkpoint_every

    assert checkpoint_every(None, config(qfilters_max_rewind=64)) == 64
    assert checkpoint_every(None, config(qfilters_max_rewind=0)) == 0
    assert checkpoint_every(None, config(method="full")) == 0
    assert checkpoint_every(17, config(qfilters_max_rewind=16)) == 17 and not capsys.readouterr().err
    assert checkpoint_every(32, config(qfilters_max_rewind=16)) == 32
    assert "reuses only the checkpoint below it" in capsys.readouterr().err
