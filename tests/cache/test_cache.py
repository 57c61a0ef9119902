"""QFiltersKVCache: data flow, invariants and protocol members (docs/method.md, "How the cache evicts")."""

import math

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from helpers.cache_model import CacheModel, model_keep, model_scores
from helpers.oracle import np_attention, np_keep_rows, np_random_scores
from qfilters_mlx import CompressOnce, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.backends.dispatch import get_backend


def make(method="qfilters", budget=16, n_sink=2, recent=4, calib=8, sign=1, source="keys",
         max_rewind=None, **kw):
    cfg = KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=n_sink,
                        qfilters_recent=recent, qfilters_calib_tokens=calib, qfilters_sign=sign,
                        qfilters_filter_source=source, **kw)
    return QFiltersKVCache(cfg, backend="reference", max_rewind=max_rewind)


def rand_kv(seed, B=1, H=2, T=40, D=16, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32)).astype(dtype)
    return k, v


def feed(cache, k, v, chunks):
    """Feed [B,H,T,D] in chunks of the given sizes; returns the outputs of each call."""
    outs, start = [], 0
    for L in chunks:
        outs.append(cache.update_and_fetch(k[:, :, start:start + L], v[:, :, start:start + L]))
        start += L
    assert start == k.shape[2]
    return outs


def kept(cache):
    return np.array(cache.kept_positions())


# ---------------------------------------------------------------- RoPE offset
def test_offset_is_absolute_position_and_returned_keys_bounded():
    k, v = rand_kv(0, B=1, H=4, T=264, D=64, dtype=mx.float16)
    c = make(budget=32, n_sink=4, recent=8, calib=16)
    out_k, _ = c.update_and_fetch(k[:, :, :64], v[:, :, :64])
    assert out_k.shape[2] == 64 and c.offset == 64
    for t in range(64, 264):
        assert c.offset == t
        out_k, out_v = c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert out_k.shape[2] == 32 + 1 and out_v.shape == out_k.shape  # budget slots + the new one
        assert c.size() == 32
    assert c.offset == 264 == c.tokens_seen


# ------------------------------------------------------------ data flow
def test_current_call_tokens_all_returned_then_evicted():
    k, v = rand_kv(1, T=40)
    c = make(budget=16, n_sink=2, recent=4, calib=8)
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    assert c.size() == 16
    before_k = np.array(c.keys[:, :, :16])
    out_k, out_v = c.update_and_fetch(k[:, :, 30:40], v[:, :, 30:40])
    assert out_k.shape[2] == 26
    np.testing.assert_array_equal(np.array(out_k[:, :, :16]), before_k)
    np.testing.assert_array_equal(np.array(out_k[:, :, 16:]), np.array(k[:, :, 30:40]))
    np.testing.assert_array_equal(np.array(out_v[:, :, 16:]), np.array(v[:, :, 30:40]))
    assert c.size() == 16


def test_precalibration_passthrough():
    k, v = rand_kv(2, T=60)
    c = make(budget=8, n_sink=1, recent=2, calib=50)
    for t in range(49):
        out_k, _ = c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert out_k.shape[2] == t + 1 and c.filter is None
    assert c.size() == 49 and c.rewindable_tokens == 49
    c.update_and_fetch(k[:, :, 49:50], v[:, :, 49:50])
    assert c.filter is not None and c.size() == 8


def test_filter_frozen_from_exactly_first_calib_keys():
    from qfilters_mlx.backends import reference as ref

    k, v = rand_kv(3, B=2, T=40)
    c = make(calib=13)
    c.update_and_fetch(k[:, :, :25], v[:, :, :25])
    np.testing.assert_array_equal(np.array(c.filter), np.array(ref.estimate_filter_from_keys(k[:, :, :13])))


@pytest.mark.parametrize("method", ["qfilters", "l2norm", "random", "streaming_llm"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_path_independence_bit_for_bit(method, dtype):
    k, v = rand_kv(4, B=2, H=3, T=90, D=16, dtype=dtype)
    chunkings = [[90], [1] * 90, [7, 1, 20, 3, 33, 26], [13, 13, 13, 51]]
    results = []
    for chunks in chunkings:
        c = make(method=method, budget=20, n_sink=3, recent=5, calib=17)
        feed(c, k, v, chunks)
        results.append(c)
    first = results[0]
    for c in results[1:]:
        np.testing.assert_array_equal(kept(c), kept(first))
        np.testing.assert_array_equal(np.array(c.keys[:, :, :c.size()].astype(mx.float32)),
                                      np.array(first.keys[:, :, :20].astype(mx.float32)))
        np.testing.assert_array_equal(np.array(c.scores[:, :, :20]), np.array(first.scores[:, :, :20]))
        if method == "qfilters":
            np.testing.assert_array_equal(np.array(c.filter), np.array(first.filter))


def test_kept_set_equals_numpy_ranking_against_frozen_filter():
    k, v = rand_kv(5, B=2, H=3, T=70, D=16)
    for sign in (1, -1):
        c = make(budget=20, n_sink=3, recent=5, calib=10, sign=sign)
        c.update_and_fetch(k, v)
        f = np.array(c.filter).astype(np.float64)
        scores = sign * np.einsum("bhtd,hd->bht", np.array(k).astype(np.float64), f)
        np.testing.assert_array_equal(kept(c), np_keep_rows(scores, 20, 3, 5))
        # temporal order and bit-exact rows
        idx = kept(c)
        assert np.all(np.diff(idx, axis=-1) > 0)
        np.testing.assert_array_equal(np.array(c.keys[:, :, :20]),
                                      np.take_along_axis(np.array(k), idx[..., None], axis=2))
        np.testing.assert_array_equal(np.array(c.values[:, :, :20]),
                                      np.take_along_axis(np.array(v), idx[..., None], axis=2))


def test_per_head_selection_differs_but_sizes_agree():
    k, v = rand_kv(6, B=1, H=4, T=80)
    c = make(budget=16, calib=8)
    c.update_and_fetch(k, v)
    idx = kept(c)
    assert idx.shape == (1, 4, 16)
    assert len({tuple(r) for r in idx[0]}) > 1  # heads choose independently


def test_frozen_scores_never_change():
    k, v = rand_kv(7, T=120)
    c = make(budget=16, calib=8)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    seen = {}
    for t in range(20, 120):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        pos, sc = kept(c), np.array(c.scores[:, :, :c.size()])
        for h in range(2):
            for p, s in zip(pos[0, h], sc[0, h]):
                assert seen.setdefault((h, int(p)), s) == s


# ---------------------------------------------------------------- sinks and recent window
def test_sinks_and_recent_survive_500_steps():
    k, v = rand_kv(8, B=2, H=2, T=520, D=8)
    c = make(budget=24, n_sink=4, recent=6, calib=10)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    for t in range(20, 520):
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        idx = kept(c)
        if t + 1 > 24:
            assert np.all(idx[..., :4] == np.arange(4))
            assert np.all(idx[..., -6:] == np.arange(t + 1 - 6, t + 1))


# ---------------------------------------------------------------- attention after scattered eviction
def test_chunk_attention_after_scattered_eviction_matches_explicit_mask():
    k, v = rand_kv(9, B=1, H=2, T=52, D=16)
    q = mx.array(np.random.default_rng(10).standard_normal((1, 2, 12, 16)).astype(np.float32))
    c = make(budget=16, n_sink=2, recent=4, calib=8)
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    stored_pos = kept(c)
    mask = c.make_mask(12, return_array=True)
    out_k, out_v = c.update_and_fetch(k[:, :, 40:], v[:, :, 40:])
    assert mask.shape[-1] == out_k.shape[2] == 28
    got = mx.fast.scaled_dot_product_attention(q, out_k, out_v, scale=16 ** -0.5, mask="causal")
    got_arr = mx.fast.scaled_dot_product_attention(q, out_k, out_v, scale=16 ** -0.5, mask=mask)
    for h in range(2):
        kpos = np.concatenate([stored_pos[0, h], np.arange(40, 52)])
        qpos = np.arange(40, 52)
        explicit = qpos[:, None] >= kpos[None, :]  # position-based causal mask
        kk = np.array(k[0, h])[kpos]
        vv = np.array(v[0, h])[kpos]
        want = np_attention(np.array(q[0, h]), kk, vv, explicit)
        np.testing.assert_allclose(np.array(got[0, h]), want, atol=1e-3)
        np.testing.assert_allclose(np.array(got_arr[0, h]), want, atol=1e-3)


@pytest.mark.parametrize("N", [1, 5])
def test_make_mask_matches_returned_key_count(N):
    k, v = rand_kv(11, T=60)
    c = make(budget=16, calib=8)
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    S = c.size()
    m_str = c.make_mask(N)
    m_arr = c.make_mask(N, return_array=True)
    out_k, _ = c.update_and_fetch(k[:, :, 40:40 + N], v[:, :, 40:40 + N])
    assert out_k.shape[2] == S + N
    if N == 1:
        assert m_str is None
    else:
        assert m_str == "causal"
    assert m_arr.shape == (N, S + N)
    want = np.concatenate([np.ones((N, S), bool), np.tril(np.ones((N, N), bool))], axis=1)
    np.testing.assert_array_equal(np.array(m_arr), want)


def test_make_mask_window_before_eviction_and_streaming():
    k, v = rand_kv(12, T=40)
    c = make(budget=64, calib=8)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    m = np.array(c.make_mask(3, window_size=5))
    qpos, kpos = np.arange(20, 23)[:, None], np.arange(23)[None]
    np.testing.assert_array_equal(m, (kpos <= qpos) & (kpos > qpos - 5))
    s = make(method="streaming_llm", budget=10, n_sink=2, recent=0)
    s.update_and_fetch(k[:, :, :30], v[:, :, :30])
    m = np.array(s.make_mask(2, window_size=4))
    kpos = np.concatenate([kept(s)[0, 0], [30, 31]])[None]
    qpos = np.array([30, 31])[:, None]
    np.testing.assert_array_equal(m, (kpos <= qpos) & (kpos > qpos - 4))
    c = make(budget=16, calib=8)
    c.update_and_fetch(k, v)  # evicts per head
    assert c.evicted
    with pytest.raises(ValueError, match="window_size"):
        c.make_mask(2, window_size=4)


# ---------------------------------------------------------------- trim
def test_trim_before_and_after_eviction():
    k, v = rand_kv(13, T=30)
    c = make(budget=8, n_sink=2, recent=2, calib=4, max_rewind=4)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert c.evicted and c.is_trimmable()  # rewinds within max_rewind are exact
    snap = (c.offset, c.size(), kept(c).copy())
    assert c.trim(-5) == 0 and (c.offset, c.size()) == snap[:2]
    with pytest.raises(ValueError, match="cannot rewind 5 tokens"):  # deeper than the journal
        c.trim(5)
    assert (c.offset, c.size()) == snap[:2] and np.array_equal(kept(c), snap[2])
    assert c.trim(3) == 3 and c.offset == 17  # as if only 17 tokens had been fed
    ref = make(budget=8, n_sink=2, recent=2, calib=4, max_rewind=4)
    ref.update_and_fetch(k[:, :, :17], v[:, :, :17])
    np.testing.assert_array_equal(kept(c), kept(ref))

    c = make(budget=64, calib=4, max_rewind=0)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert not c.is_trimmable()  # max_rewind=0: mlx-lm never trims it (see test_no_silent_rewind)
    assert c.trim(-5) == 0 and c.offset == 20
    assert c.trim(3) == 3 and c.offset == 17 and c.size() == 17
    out_k, _ = c.update_and_fetch(k[:, :, 17:18], v[:, :, 17:18])
    assert out_k.shape[2] == 18 and c.offset == 18
    np.testing.assert_array_equal(np.array(out_k), np.array(k[:, :, :18]))
    assert c.trim(100) == 18 and c.offset == 0


def test_trim_into_calibration_drops_filter_and_recalibrates_identically():
    from qfilters_mlx.backends import reference as ref

    k, v = rand_kv(14, T=30)
    c = make(budget=64, calib=10)
    c.update_and_fetch(k[:, :, :12], v[:, :, :12])
    assert c.filter is not None
    c.trim(5)
    assert c.filter is None
    k2 = mx.concatenate([k[:, :, :7], k[:, :, 20:30]], axis=2)
    v2 = mx.concatenate([v[:, :, :7], v[:, :, 20:30]], axis=2)
    c.update_and_fetch(k2[:, :, 7:], v2[:, :, 7:])
    np.testing.assert_array_equal(np.array(c.filter), np.array(ref.estimate_filter_from_keys(k2[:, :, :10])))


# ------------------------------------------------------- protocol / bytes
def test_protocol_members_and_byte_accounting():
    k, v = rand_kv(15, B=1, H=2, T=50, D=16, dtype=mx.float16)
    c = make(budget=16, calib=8)
    assert c.empty() and c.size() == 0 and c.nbytes == 0 and c.state[:5] == (None,) * 5
    assert c.qfilters_kept_bytes == 0 and c.compression_ratio == 1.0
    c.update_and_fetch(k, v)
    assert not c.empty() and c.size() == 16 == c.tokens_kept and c.tokens_seen == 50
    kv_bytes = 2 * 1 * 2 * 16 * 16 * 2  # K and V, B, H, kept, D, fp16
    score_bytes = 1 * 2 * 16 * 4
    filter_bytes = 2 * 16 * 4
    assert c.qfilters_kept_bytes == kv_bytes + score_bytes + filter_bytes
    assert c.full_seq_bytes == 2 * 1 * 2 * 50 * 16 * 2
    assert c.compression_ratio == pytest.approx(c.full_seq_bytes / c.qfilters_kept_bytes)
    assert c.nbytes >= c.qfilters_kept_bytes
    st = c.state
    assert [a.shape for a in st[:5]] == [(1, 2, 16, 16), (1, 2, 16, 16), (1, 2, 16), (1, 2, 16), (2, 16)]
    other = QFiltersKVCache.from_state(st)
    assert other.size() == 16 and other.offset == 50 and other.config == c.config
    np.testing.assert_array_equal(kept(other), kept(c))


def test_methods_share_engine():
    k, v = rand_kv(16, B=1, H=2, T=60, D=8)
    full = make(method="full")
    full.update_and_fetch(k, v)
    assert full.size() == 60 and full.is_trimmable()
    sl = make(method="streaming_llm", budget=16, n_sink=3, recent=0)
    sl.update_and_fetch(k, v)
    np.testing.assert_array_equal(kept(sl)[0, 0], np.r_[0:3, 47:60])
    l2 = make(method="l2norm", budget=16, n_sink=2, recent=4)
    l2.update_and_fetch(k, v)
    norms = -np.linalg.norm(np.array(k), axis=-1)
    np.testing.assert_array_equal(kept(l2), np_keep_rows(norms, 16, 2, 4))
    r1, r2 = make(method="random", qfilters_seed=3), make(method="random", qfilters_seed=3)
    r3 = make(method="random", qfilters_seed=4)
    for c in (r1, r2, r3):
        c.update_and_fetch(k, v)
    np.testing.assert_array_equal(kept(r1), kept(r2))
    assert not np.array_equal(kept(r1), kept(r3))
    sc = np.array(r1.scores[:, :, :16])
    assert np.all((sc >= 0) & (sc < 1))


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_batch_rows_select_independently(backend):
    """Each batch row keeps its own tokens: a B=3 cache equals three B=1 caches (l2norm scores
    depend on the row only; the key-SVD filter would pool the rows)."""
    k, v = rand_kv(17, B=3, H=2, T=50, D=8)
    cfg = dict(method="l2norm", budget=12, n_sink=2, recent=3)
    c = make(**cfg)
    c.backend = get_backend(backend)
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    for t in range(40, 50):  # slot-mode decode steps too
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert kept(c).shape == (3, 2, 12)
    for b in range(3):
        single = make(**cfg)
        single.update_and_fetch(k[b:b + 1, :, :40], v[b:b + 1, :, :40])
        for t in range(40, 50):
            single.update_and_fetch(k[b:b + 1, :, t:t + 1], v[b:b + 1, :, t:t + 1])
        np.testing.assert_array_equal(kept(single)[0], kept(c)[b])
        np.testing.assert_array_equal(np.array(single.keys[0, :, :12]), np.array(c.keys[b, :, :12]))


def test_bad_state_assignment_changes_nothing_even_in_slot_mode():
    k, v = rand_kv(20, T=40)
    runs = []
    for bad in (False, True):
        c = make(budget=8, n_sink=2, recent=2, calib=4)
        c.update_and_fetch(k[:, :, :20], v[:, :, :20])
        for t in range(20, 25):
            c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if bad:
            for value in ((1, 2, 3), (None,) * 6 + ("{",), c.state[:6] + ("{}",)):
                with pytest.raises(ValueError, match="state"):
                    c.state = value
        for t in range(25, 30):
            c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        runs.append(kept(c))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_bad_updates_raise_before_state_changes():
    k, v = rand_kv(18, T=20)
    c = make(budget=16, calib=8)
    c.update_and_fetch(k[:, :, :10], v[:, :, :10])
    snap = (c.offset, c.size(), np.array(c.keys[:, :, :10]))
    # (keys, values, exception, what the message must name: the argument and the cause)
    bad = [
        (k[0], v[0], ValueError, r"keys must be \[B, H_kv, L, D\], got shape \(2, 20, 16\)"),
        (k[:, :, :2], v[:, :, :3], ValueError, r"keys and values must agree on \[B, H_kv, L\]"),
        (k[:, :1, :2], v[:, :1, :2], ValueError,
         r"filters shape \(2, 16\) does not match keys \[H_kv, D\] = \(1, 16\)$"),
        (k[..., :8][:, :, :2], v[..., :8][:, :, :2], ValueError, r"filters shape \(2, 16\) does not match keys"),
        (k[:, :, :2].astype(mx.float16), v[:, :, :2].astype(mx.float16), TypeError,
         r"keys dtype (mlx\.core\.)?float16 does not match the cache \((mlx\.core\.)?float32\)"),
        (k[:, :, :2], v[:, :, :2].astype(mx.float16), TypeError, r"keys and values must share a dtype"),
        (k[:, :, :0], v[:, :, :0], ValueError, r"keys must hold at least one token \(L >= 1\)"),
        (np.array(k[:, :, :2]), v[:, :, :2], TypeError, r"keys must be an mx.array, got ndarray"),
        (k[:, :, :2], np.array(v[:, :, :2]), TypeError, r"^values must be an mx.array, got ndarray"),
        (k[:, :, :2], v[0, :, :2], ValueError, r"^values must be \[B, H_kv, L, D\], got shape \(2, 2, 16\)"),
        (k[:, :, :2], v[:, :, :2].astype(mx.int32), TypeError, r"^values must be a floating dtype"),
    ]
    for bk, bv, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            c.update_and_fetch(bk, bv)
        assert (c.offset, c.size()) == snap[:2]
    np.testing.assert_array_equal(np.array(c.keys[:, :, :10]), snap[2])
    c.update_and_fetch(k[:, :, 10:11], v[:, :, 10:11])  # still usable
    assert c.offset == 11


def test_right_sign_beats_random_under_paper_geometry():
    """Important tokens carry a large projection on the shared axis u and probe queries align
    with +u: the +1 cache's attention output is far closer to full attention than random's."""
    rng = np.random.default_rng(19)
    H, T, D, budget = 4, 512, 64, 64
    u = rng.standard_normal((H, D))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    coef = 1.0 + 3.0 * rng.standard_normal((1, H, T, 1))
    keys = coef * u[None, :, None] + rng.standard_normal((1, H, T, D))
    vals = rng.standard_normal((1, H, T, D))
    q = 4.0 * u[None, :, None] + 0.5 * rng.standard_normal((1, H, 8, D))
    full = np_attention(q, keys, vals)

    def perturbation(method, sign=1):
        c = make(method=method, budget=budget, n_sink=4, recent=0, calib=128, sign=sign,
                 qfilters_seed=1)
        c.update_and_fetch(mx.array(keys.astype(np.float32)), mx.array(vals.astype(np.float32)))
        out = np_attention(q, np.array(c.keys[:, :, :budget]), np.array(c.values[:, :, :budget]))
        cos = np.sum(out * full, -1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(full, axis=-1))
        return float(np.mean(1 - cos))

    probe = make(budget=budget, calib=128)
    probe.update_and_fetch(mx.array(keys.astype(np.float32)), mx.array(vals.astype(np.float32)))
    # the keys' mean projection is positive (coef has mean +1), so the filter is oriented to +u
    assert np.all(np.sum(np.array(probe.filter) * u, -1) > 0.95)
    good, wrong, rand = perturbation("qfilters", 1), perturbation("qfilters", -1), perturbation("random")
    print(f"perturbation: right sign {good:.4f}, wrong sign {wrong:.4f}, random {rand:.4f}")
    assert good < 0.25 * rand, (good, rand)
    assert wrong > rand, (wrong, rand)


# ------------------------------------------------------------------------------------------------
# QFiltersKVCache's documented behaviour pinned exactly: constructor checks, the default
# layer, the query-observation contract, buffer growth and ``nbytes``, exact rewinds against
# an uninterrupted run, path independence with the C++ backend, and the compress-once
# ``prompt_end`` trigger (behaviour the mutation check of ``cache/kv_cache.py`` needs pinned:
# ``tools/mutation.py``, bench/results/mutation.md).
#
# References: the numpy model of the cache (``tests/helpers/cache_model.py``), the random arm's hash
# in numpy (``tests/cache/test_properties.py``), a cache that never saw the rewound tokens, and the
# buffer rule of ``QFiltersKVCache._append`` written out (``cap_rows``).
# ------------------------------------------------------------------------------------------------


H, D = 2, 8
STEP = 256  # QFiltersKVCache.step: buffers grow in blocks of 256 rows (as mlx-lm's KVCache)
COMPRESSED_STEP = 32  # QFiltersKVCache.compressed_step: ... of 32 rows after a compression


def int_data(T, seed=0, H=H, D=D):
    """Small-integer keys/values (exact float32 sums: numpy and MLX scores agree bit for bit)
    and a filter of small integers: ``(k, v [1, H, T, D], f [H, D])`` float32 numpy."""
    rng = np.random.default_rng(seed)
    k = rng.integers(-4, 5, size=(1, H, T, D)).astype(np.float32)
    v = rng.integers(-4, 5, size=(1, H, T, D)).astype(np.float32)
    f = rng.integers(-2, 3, size=(H, D)).astype(np.float32)
    return k, v, f


def fixed_cache(f, budget=12, n_sink=2, recent=2, depth=0, backend="reference", **kw):
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=budget, qfilters_n_sink=n_sink,
                        qfilters_recent=recent, **kw)
    return QFiltersKVCache(cfg, filters=mx.array(f), max_rewind=depth, backend=backend)


def observed_query_cache(seed, T, Tq, max_rewind=None, **kw):
    """A query-calibrating cache (reference backend, ``max_rewind``, config ``kw``) as inside an
    ``observe_queries`` block, with Gaussian keys ``[1, H, T, D]`` and GQA queries
    ``[1, 2 H, Tq, D]`` (float32 MLX): ``(cache, keys, queries)``."""
    cfg = KVCacheConfig(method="qfilters", qfilters_filter_source="queries", **kw)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, H, T, D)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 2 * H, Tq, D)).astype(np.float32))
    c = QFiltersKVCache(cfg, backend="reference", max_rewind=max_rewind)
    c.queries_observed = True  # as inside observe_queries
    return c, k, q


def test_a_query_calibrated_cache_outside_observe_queries_says_how_to_run_it():
    """Fed without ``observe_queries`` (``queries_observed`` unset), a cache estimating its
    filter from queries refuses the update, naming the options and the context manager."""
    c, k, _ = observed_query_cache(0, 8, 8, qfilters_calib_tokens=4)
    c.queries_observed = False
    with pytest.raises(ValueError, match=r"^this cache estimates its filter from queries \(qfilters_sign='auto' "
                                         r"or qfilters_filter_source='queries'\): run the model inside "
                                         r"`with qfilters_mlx.observe_queries\(model, caches\):`$"):
        c.update_and_fetch(k[:, :, :2], k[:, :, :2])
    assert c.empty() and c.offset == 0


def feed_cache(cache, k, v, chunks, start=0):
    for L in chunks:
        cache.update_and_fetch(mx.array(k[:, :, start:start + L]), mx.array(v[:, :, start:start + L]))
        start += L
    return start


def observable(c):
    """state arrays (temporal order) and meta, offset, size, bytes: what a caller sees."""
    st = c.state
    arrays = [None if a is None else np.array(a) for a in st[:6]]
    return arrays, st[6], c.offset, c.size(), c.nbytes, c.journal_nbytes


def assert_same(a, b):
    assert_same_view(observable(a), observable(b))


def assert_same_view(va, vb):
    """Two :func:`observable` snapshots are equal (arrays bit for bit, dtypes included)."""
    (xa, ma, *sa), (xb, mb, *sb) = va, vb
    for x, y in zip(xa, xb):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y)
    assert ma == mb and sa == sb


def cap_rows(rows, budget=None, step=STEP):
    """Buffer rows after ``rows`` no longer fit: the smallest multiple of ``step`` holding them;
    for a cache evicting to ``budget``, at most ``max(rows, budget + 1)`` (budget + the chunk)."""
    step = step * math.ceil(rows / step)
    return step if budget is None else min(step, max(rows, budget + 1))


def bytes_at(cap, B=1, itemsize=4, filter_=True):
    """nbytes of a cache whose K, V, scores (float32) and positions (int64) buffers hold ``cap``
    rows, plus the float32 filter ``[H, D]`` (journal empty)."""
    return B * H * cap * (2 * D * itemsize + 4 + 8) + (H * D * 4 if filter_ else 0)


# --------------------------------------------------------------- constructor
def test_constructor_rejects_each_bad_filters_naming_the_argument():
    cfg = KVCacheConfig(method="qfilters", head_dim=D, qfilters_budget=8)
    shape_err = r"^filters must be an mx.array \[H_kv, D\], got "
    with pytest.raises(ValueError, match=shape_err + r"\(2, 8\)$"):
        QFiltersKVCache(cfg, filters=np.ones((H, D), np.float32))  # numpy, right shape
    with pytest.raises(ValueError, match=shape_err + r"list$"):
        QFiltersKVCache(cfg, filters=[[1.0] * D] * H, backend="reference")
    with pytest.raises(ValueError, match=shape_err + r"\(1, 2, 8\)$"):
        QFiltersKVCache(cfg, filters=mx.ones((1, H, D)))  # an mx.array of the wrong rank
    with pytest.raises(TypeError, match=r"^filters must be floating point, got mlx.core.int32$"):
        QFiltersKVCache(cfg, filters=mx.ones((H, D), mx.int32), backend="reference")
    with pytest.raises(ValueError, match=r"^filters head_dim 4 != config.head_dim 8$"):
        QFiltersKVCache(cfg, filters=mx.ones((H, 4)), backend="reference")
    # The right shape is accepted (with and without head_dim), stored as float32, unscaled.
    f = np.arange(H * D, dtype=np.float32).reshape(H, D) / 8
    for config in (cfg, KVCacheConfig(method="qfilters", qfilters_budget=8)):
        c = QFiltersKVCache(config, filters=mx.array(f).astype(mx.float16), backend="reference")
        assert c.filter.dtype == mx.float32 and c.filter_fixed and c.scoring_ready
        np.testing.assert_array_equal(np.array(c.filter), f)
    # No filters: refused where the config scores with the calibrated filter (the default
    # source), accepted for the online sources and for the methods that need no filter.
    with pytest.raises(ValueError, match="qfilters_filter_source='calibrated' .* pass filters="):
        QFiltersKVCache(cfg, backend="reference")
    for ok in (replace(cfg, qfilters_filter_source="keys", qfilters_sign=None),
               replace(cfg, method="l2norm"), replace(cfg, method="streaming_llm")):
        assert QFiltersKVCache(ok, backend="reference").filter is None


def test_default_layer_is_layer_zero_for_the_random_arm():
    """Built without ``layer_idx`` a cache is layer 0: the random arm scores with the hash of
    (seed, layer 0, head, position) (the random arm, docs/configuration.md "Eviction methods";
    numpy hash of test_properties)."""
    T, seed = 40, 9
    k, v, _ = int_data(T, seed=1)
    cfg = KVCacheConfig(method="random", qfilters_budget=10, qfilters_n_sink=1, qfilters_recent=2,
                        qfilters_seed=seed)
    c = QFiltersKVCache(cfg, backend="reference")
    feed_cache(c, k, v, [25, 15])
    assert c.layer_idx == 0
    expected = np_random_scores(H, T, seed, 0)
    pos = np.array(c.kept_positions())
    np.testing.assert_array_equal(np.array(c.scores[:, :, :c.size()]),
                                  np.take_along_axis(expected[None], pos, axis=2).astype(np.float32))
    kept = np.stack([model_keep(expected[h].astype(np.float32), 10, 1, 2) for h in range(H)])
    np.testing.assert_array_equal(pos[0], kept)


def test_a_trim_back_into_calibration_waits_for_the_next_calls_queries_only():
    """Once calibrated, observe_queries owes nothing; a trim back below ``calib_tokens`` drops
    the filter (docs/method.md), and the next update goes ahead (no queries are owed from
    before the trim) and re-estimates the filter exactly as a cache that never saw the
    trimmed tokens (both fed the same kept queries and the same new call)."""
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=16, qfilters_calib_tokens=8,
                        qfilters_filter_source="queries")
    rng = np.random.default_rng(41)
    k = mx.array(rng.integers(-4, 5, size=(1, H, 16, D)).astype(np.float32))
    q = mx.array(rng.integers(-4, 5, size=(1, 2 * H, 16, D)).astype(np.float32))
    c, fresh = QFiltersKVCache(cfg, backend="reference"), QFiltersKVCache(cfg, backend="reference")
    c.queries_observed = fresh.queries_observed = True  # as inside observe_queries
    for a, b in ((0, 10), (10, 11)):  # calibrates at 10 tokens, then a call owing nothing
        c.update_and_fetch(k[:, :, a:b], k[:, :, a:b])
        c.observe_queries(q[:, :, : b - a])
    assert c.filter is not None and not c.needs_queries
    assert c.trim(5) == 5 and c.filter is None and c.needs_queries
    fresh.update_and_fetch(k[:, :, :6], k[:, :, :6])
    fresh.observe_queries(q[:, :, :6])
    for x in (c, fresh):
        x.update_and_fetch(k[:, :, 11:14], k[:, :, 11:14])
        x.observe_queries(q[:, :, 11:14])
    assert c.filter is not None
    np.testing.assert_array_equal(np.array(c.filter), np.array(fresh.filter))
    np.testing.assert_array_equal(np.array(c.state[5]), np.array(fresh.state[5]))


def test_queries_of_no_tokens_after_a_trim_to_nothing_keep_nothing():
    """A query-calibrated cache trimmed back to no tokens before any queries arrived, then
    shown an empty block of queries: it keeps no queries (``None``, as a new cache), not an
    empty array, and calibrates from the next calls' queries as a new cache does."""
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=16, qfilters_calib_tokens=4,
                        qfilters_filter_source="queries")
    rng = np.random.default_rng(43)
    k = mx.array(rng.standard_normal((1, H, 6, D)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 2 * H, 6, D)).astype(np.float32))
    c, fresh = QFiltersKVCache(cfg, backend="reference"), QFiltersKVCache(cfg, backend="reference")
    c.queries_observed = fresh.queries_observed = True  # as inside observe_queries
    c.update_and_fetch(k[:, :, :3], k[:, :, :3])
    assert c.trim(3) == 3 and c.offset == 0
    c.observe_queries(q[:, :, :0])
    assert c.state[5] is None
    for x in (c, fresh):
        x.update_and_fetch(k, k)
        x.observe_queries(q)
    np.testing.assert_array_equal(np.array(c.filter), np.array(fresh.filter))


def test_query_calibrated_cache_refuses_updates_outside_observe_queries():
    """docs/method.md: a cache estimating its filter from queries must run inside observe_queries;
    a fresh one (never observed) raises before storing anything."""
    cfg = KVCacheConfig(method="qfilters", qfilters_budget=8, qfilters_calib_tokens=4,
                        qfilters_filter_source="queries")
    c = QFiltersKVCache(cfg, backend="reference")
    k = mx.ones((1, H, 3, D))
    with pytest.raises(ValueError, match=r"observe_queries\(model, caches\)"):
        c.update_and_fetch(k, k)
    assert c.empty() and c.offset == 0 and c.size() == 0


# ------------------------------------------------------------ buffers, bytes
def test_buffers_grow_in_step_blocks_and_nbytes_counts_them(tmp_path):
    """K/V/scores/positions are written after the live rows in place while they fit, else the
    buffers grow to the smallest multiple of 256 rows holding them (as mlx-lm's KVCache), at
    most ``max(rows, budget + 1)`` (``cap_rows``; budget 600 here); an eviction leaves exactly the kept rows; ``nbytes`` counts every buffer at capacity."""
    k, v, f = int_data(400, seed=2)
    c = fixed_cache(f, budget=600)
    feed_cache(c, k, v, [3])
    assert c.nbytes == bytes_at(cap_rows(3, 600))
    feed_cache(c, k, v, [300], start=3)
    assert c.nbytes == bytes_at(cap_rows(303, 600))
    # A reloaded cache holds exactly its rows; a trim keeps the buffers; rows that fit again
    # are written in place (capacity unchanged), one more row grows to 256.
    small = fixed_cache(f, budget=600)
    feed_cache(small, k, v, [10])
    save_prompt_cache(str(tmp_path / "c.safetensors"), [small])
    r = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
    assert r.nbytes == bytes_at(10)
    assert r.trim(3) == 3
    feed_cache(r, k, v, [3], start=7)
    assert r.nbytes == bytes_at(10) and r.offset == 10
    for x, y in zip(r.state, small.state):  # the rows, scores, positions of the uninterrupted cache
        assert (x is None and y is None) or (np.array(x).tolist() == np.array(y).tolist())
    feed_cache(r, k, v, [1], start=10)
    assert r.nbytes == bytes_at(cap_rows(11, 600))


@pytest.mark.parametrize("chunks", [[45], [44] + [1] * 30, [10] * 9, [100, 1, 1], [3, 200, 1, 60, 1]])
def test_a_budgeted_cache_never_holds_more_than_the_budget_plus_the_chunk(chunks):
    """After every call the buffers hold at most ``max(budget + 1, rows before + L)`` rows
    (``budget + 1``: the budget and the decode step that first evicts; ``rows before + L``:
    the chunk being processed, evicted at the end of the call), for any chunking; a
    conversation shorter than the budget holds ``budget + 1`` rows, not a 256-row block."""
    budget = 64
    k, v, f = int_data(sum(chunks), seed=21)
    c = fixed_cache(f, budget=budget, n_sink=4, recent=8)
    start = 0
    for L in chunks:
        before = c.size()
        start = feed_cache(c, k, v, [L], start)
        assert c.keys.shape[2] <= max(budget + 1, before + L)
        assert c.nbytes == bytes_at(c.keys.shape[2])
    if sum(chunks) <= budget:
        assert c.keys.shape[2] == budget + 1


def test_compress_once_growth_appends_into_step_blocks():
    """Compress-once: the compression keeps exactly K rows; later tokens are appended (no
    eviction without ``CompressOnce.growth``) into buffers grown in 32-row blocks (256 before it)."""
    k, v, f = int_data(40, seed=3)
    cfg = KVCacheConfig(method="qfilters", mode=CompressOnce(at="manual"), qfilters_budget=8,
                        qfilters_n_sink=2, qfilters_recent=2)
    c = QFiltersKVCache(cfg, filters=mx.array(f), backend="reference")
    feed_cache(c, k, v, [20])
    assert c.compress() == 8 and c.nbytes == bytes_at(8)
    feed_cache(c, k, v, [5, 1], start=20)
    assert c.size() == 14 and c.nbytes == bytes_at(cap_rows(14, step=COMPRESSED_STEP))
    s = model_scores("qfilters", k, f, 1)[0]
    kept = np.stack([np.concatenate([model_keep(s[h, :20], 8, 2, 2), np.arange(20, 26)]) for h in range(H)])
    np.testing.assert_array_equal(np.array(c.kept_positions())[0], kept)


# ---------------------------------------------------------------- rewinds
def test_rewind_of_the_first_eviction_restores_capacity_and_bytes():
    """docs/mlx-lm.md: a rewind leaves the cache as one that never saw the removed tokens, here down
    to its buffers' capacity and ``nbytes``; both then continue identically (numpy model)."""
    k, v, f = int_data(60, seed=4)
    a, b = fixed_cache(f, depth=6), fixed_cache(f, depth=6)
    feed_cache(a, k, v, [10, 5])  # the second call evicts (15 > 12)
    assert a.evicted and a.size() == 12
    assert a.trim(5) == 5
    feed_cache(b, k, v, [10])
    assert not a.evicted and a.keys.shape == b.keys.shape == (1, H, cap_rows(10, 12), D)
    assert_same(a, b)
    model = CacheModel("qfilters", 12, 2, 2, filters=f)
    model.update(k[:, :, :10], v[:, :, :10])
    start = 10
    for L in [4, 1, 1, 3, 1]:
        for c in (a, b):
            feed_cache(c, k, v, [L], start=start)
        model.update(k[:, :, start:start + L], v[:, :, start:start + L])
        start += L
        assert_same(a, b)
        np.testing.assert_array_equal(np.array(a.state[3]), model.kept())  # (state keeps the layout)


def test_rewind_after_eviction_keeps_the_eviction_flag_and_the_journal_reach():
    """After a rewind the cache is still evicted: ``trim`` goes on through the journal, whose
    reach is what the rewind left (fewer right after a rewind); deeper raises."""
    k, v, f = int_data(40, seed=5)
    a, b = fixed_cache(f, depth=6), fixed_cache(f, depth=6)
    feed_cache(a, k, v, [16, 3, 3])  # the journal covers the newest calls holding >= 6 tokens: 3 + 3
    assert a.rewindable_tokens == 6
    assert a.trim(3) == 3
    feed_cache(b, k, v, [16, 3])
    assert a.evicted is True and a.is_trimmable()
    assert a.rewindable_tokens == 3  # the one record left (3 tokens)
    before = observable(a)
    with pytest.raises(ValueError, match=r"cannot rewind 4 tokens after an eviction.*max_rewind=6"):
        a.trim(4)
    after = observable(a)
    assert after[1:] == before[1:]
    assert all(np.array_equal(x, y) for x, y in zip(after[0][:4], before[0][:4]))
    # the same kept rows, meta (eviction flag) and offset as the uninterrupted cache
    assert [np.array(x).tolist() for x in a.state[:4]] == [np.array(x).tolist() for x in b.state[:4]]
    assert a.state[6] == b.state[6]
    model = CacheModel("qfilters", 12, 2, 2, filters=f)
    for s, L in [(0, 16), (16, 3)]:
        model.update(k[:, :, s:s + L], v[:, :, s:s + L])
    np.testing.assert_array_equal(np.array(a.kept_positions()), model.kept())


def test_state_after_eviction_holds_no_queries_and_round_trips(tmp_path):
    """docs/method.md / state: the first queries are kept only until the first eviction (``None`` after);
    the saved cache reloads and continues bit for bit."""
    k, v, f = int_data(40, seed=6)
    c = fixed_cache(f, budget=10, depth=4)
    feed_cache(c, k, v, [14, 2])
    assert c.evicted and c.state[5] is None
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    r = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
    assert r.state[5] is None
    feed_cache(r, k, v, [3, 1], start=16)
    feed_cache(c, k, v, [3, 1], start=16)
    assert [np.array(x).tolist() for x in r.state[:4]] == [np.array(x).tolist() for x in c.state[:4]]


# ----------------------------------------------------------- backends, modes
def test_cpp_backend_scores_do_not_depend_on_chunking():
    """docs/method.md: the kept set, K/V and scores are a pure function of the tokens fed, bit for bit,
    whatever the chunking: prefill calls and slot-mode decode steps score a key alike with the
    configured backend (cpp here, whose float32 sums differ from the reference's in the last
    bits, so a call scored by another backend would show)."""
    from qfilters_mlx.backends.dispatch import get_backend

    try:
        get_backend("cpp")
    except (ValueError, ImportError):
        pytest.skip("the C++ extension is not built")
    rng = np.random.default_rng(7)
    T = 48
    k = rng.standard_normal((2, H, T, 16)).astype(np.float32)
    v = rng.standard_normal((2, H, T, 16)).astype(np.float32)
    f = rng.standard_normal((H, 16)).astype(np.float32)
    f /= np.linalg.norm(f, axis=-1, keepdims=True)
    runs = []
    for chunks in ([T], [20] + [1] * 28, [13, 1, 1, 33], [30, 18]):
        c = fixed_cache(f, budget=12, n_sink=2, recent=3, backend="cpp")
        feed_cache(c, k, v, chunks)
        runs.append([np.array(a) for a in c.state[:4]])
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert x.dtype == y.dtype and np.array_equal(x, y)


def test_prompt_end_trigger_compresses_before_the_first_single_token_call():
    """compression.py: with ``CompressOnce(at="prompt_end")`` (the default) the first
    single-token call after a multi-token one compresses the stored tokens (not itself), then
    the token is appended; single-token calls before any chunk never compress."""
    k, v, f = int_data(30, seed=8)
    cfg = KVCacheConfig(method="qfilters", mode=CompressOnce(), qfilters_budget=8,
                        qfilters_n_sink=2, qfilters_recent=2)
    c = QFiltersKVCache(cfg, filters=mx.array(f), backend="reference")
    feed_cache(c, k, v, [1, 1])  # no chunk yet: kept as they come
    assert not c.compressed and c.size() == 2
    feed_cache(c, k, v, [13], start=2)
    assert not c.compressed and c.size() == 15
    feed_cache(c, k, v, [1, 1], start=15)
    assert c.compressed and c.size() == 10 and c.offset == 17
    s = model_scores("qfilters", k, f, 1)[0]
    kept = np.stack([np.concatenate([model_keep(s[h, :15], 8, 2, 2), [15, 16]]) for h in range(H)])
    np.testing.assert_array_equal(np.array(c.kept_positions())[0], kept)


def test_full_cache_never_evicts_its_window_mask_is_mlx_lms_and_an_evicted_state_is_refused():
    """method="full" stores every token (no eviction past the budget): it stays trimmable,
    its window mask is mlx-lm's ``create_causal_mask`` over all stored tokens, and a saved
    state whose meta claims an eviction is refused naming the method, before state changes."""
    from mlx_lm.models.base import create_causal_mask
    import json

    k, v, _ = int_data(40, seed=5)
    c = QFiltersKVCache(KVCacheConfig(method="full", qfilters_budget=8), backend="reference")
    feed_cache(c, k, v, [20, 1, 1, 1])
    assert c.size() == c.offset == 23 and not c.evicted and c.is_trimmable()
    np.testing.assert_array_equal(np.array(c.state[0]), k[:, :, :23])
    for N, w in [(1, 5), (3, 4)]:
        np.testing.assert_array_equal(np.array(c.make_mask(N, window_size=w)),
                                      np.array(create_causal_mask(N, 23, window_size=w)))
    before = observable(c)
    meta = json.loads(c.state[6])
    meta["evicted"] = True
    with pytest.raises(ValueError, match=r"evicted=True for method='full'"):
        c.state = c.state[:6] + (json.dumps(meta),)
    after = observable(c)
    assert before[1:] == after[1:] and all(np.array_equal(x, y) for x, y in zip(before[0], after[0])
                                           if x is not None)


def test_per_head_recent_windows_equal_one_cache_per_head_and_must_match_the_heads():
    """``qfilters_recent=[r_0, r_1]``: head ``h`` keeps what a cache with the one window
    ``r_h`` keeps fed that head alone; a window count other than ``H_kv`` is refused
    before anything is stored (naming both counts)."""
    k, v = rand_kv(21, H=2, T=40)
    chunks = [7, 13, 1, 1, 3, 1, 14]
    c = make("l2norm", budget=12, n_sink=2, recent=[3, 5])
    feed(c, k, v, chunks)
    for h, r in enumerate((3, 5)):
        alone = make("l2norm", budget=12, n_sink=2, recent=r)
        feed(alone, k[:, h:h + 1], v[:, h:h + 1], chunks)
        assert c.kept_positions()[:, h:h + 1].tolist() == alone.kept_positions().tolist()
    wrong = make("l2norm", budget=12, n_sink=2, recent=[3, 5, 4])
    with pytest.raises(ValueError, match=r"qfilters_recent has 3 per-head windows, the keys have H_kv = 2 heads"):
        wrong.update_and_fetch(k[:, :, :3], v[:, :, :3])
    assert wrong.empty() and wrong.offset == 0


def test_keys_of_another_head_dim_than_the_config_are_refused():
    c = make("l2norm", head_dim=16)
    k, v = rand_kv(22, D=8, T=4)
    with pytest.raises(ValueError, match=r"^keys head_dim 8 does not match config.head_dim 16$"):
        c.update_and_fetch(k, v)
    assert c.empty() and c.offset == 0


@pytest.mark.parametrize("max_rewind", [0, 4])
def test_keys_and_values_refuses_after_a_trim(max_rewind):
    """``keys_and_values`` returns the last update's output (stored ++ new rows) until a trim
    removes tokens (before an eviction: a plain trim; after one: a journal rewind)."""
    k, v = rand_kv(23, T=30)
    c = QFiltersKVCache(make("l2norm", budget=16).config, max_rewind=max_rewind)
    c.keep_last_kv = True
    with pytest.raises(ValueError, match="before any update_and_fetch since the cache was built"):
        c.keys_and_values()  # a new cache has returned nothing yet
    feed(c, k[:, :, :10], v[:, :, :10], [6, 4])
    keys, values = c.keys_and_values()
    np.testing.assert_array_equal(np.array(keys), np.array(k[:, :, :10]))
    np.testing.assert_array_equal(np.array(values), np.array(v[:, :, :10]))
    assert c.trim(2) == 2
    with pytest.raises(ValueError, match="before any update_and_fetch since the cache was built, loaded or trimmed"):
        c.keys_and_values()
    if max_rewind:
        feed(c, k[:, :, 8:28], v[:, :, 8:28], [20])  # evicts
        c.keys_and_values()
        assert c.evicted and c.trim(3) == 3
        with pytest.raises(ValueError, match="since the cache was built, loaded or trimmed"):
            c.keys_and_values()


def test_query_calibration_at_exactly_the_budget_evicts_nothing():
    """A query-calibrated cache holding exactly ``qfilters_budget`` tokens when its queries
    complete the calibration drops nothing: it is not evicted (so with no rewind journal it
    can still be trimmed, as a cache that never evicted), and keeps every position."""
    c, k, q = observed_query_cache(44, 12, 12, qfilters_budget=12, qfilters_calib_tokens=12,
                                   qfilters_n_sink=1, qfilters_recent=2)
    c.update_and_fetch(k, k)
    c.observe_queries(q)
    assert c.filter is not None and not c.evicted and c.size() == 12
    assert c.kept_positions().tolist() == [[list(range(12))] * H]
    assert c.is_trimmable() and c.trim(3) == 3 and c.offset == 9


def test_arrays_nbytes_sums_arrays_in_any_nesting_and_skips_none():
    from qfilters_mlx.cache.accounting import arrays_nbytes

    a, b = mx.zeros((2, 3), mx.float32), mx.zeros((5,), mx.int64)
    c, d = mx.zeros((4, 4), mx.float16), mx.zeros((1,), mx.uint8)
    assert arrays_nbytes() == 0 and arrays_nbytes(None) == 0
    assert arrays_nbytes(a, (b, None, [c]), d) == 24 + 40 + 32 + 1
    assert arrays_nbytes([a], b, (c, d)) == 24 + 40 + 32 + 1


def test_a_cache_restored_from_an_empty_state_continues_as_a_new_cache():
    cfg = KVCacheConfig(method="l2norm", qfilters_budget=6, qfilters_n_sink=1, qfilters_recent=2)
    restored, fresh = QFiltersKVCache.from_state(QFiltersKVCache(cfg).state), QFiltersKVCache(cfg)
    assert restored.size() == 0 and restored.offset == 0
    rng = np.random.default_rng(45)
    for L in (4, 5, 1, 1):
        k = mx.array(rng.standard_normal((1, H, L, D)).astype(np.float32))
        for c in (restored, fresh):
            out = c.update_and_fetch(k, k)
        assert restored.size() == fresh.size()
        np.testing.assert_array_equal(np.array(restored.kept_positions()), np.array(fresh.kept_positions()))
