"""QFiltersKVCache: data flow, invariants and protocol members (docs/method.md, "How the cache evicts")."""

import mlx.core as mx
import numpy as np
import pytest

from oracle import np_attention, np_keep_rows
from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.backends.dispatch import get_backend


def make(method="qfilters", budget=16, n_sink=2, recent=4, calib=8, sign=1, source="keys", **kw):
    cfg = KVCacheConfig(method=method, qfilters_budget=budget, qfilters_n_sink=n_sink,
                        qfilters_recent=recent, qfilters_calib_tokens=calib, qfilters_sign=sign,
                        qfilters_filter_source=source, qfilters_backend="reference", **kw)
    return QFiltersKVCache(cfg)


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
    c = make(budget=8, n_sink=2, recent=2, calib=4, qfilters_max_rewind=4)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert c.evicted and c.is_trimmable()  # rewinds within qfilters_max_rewind are exact
    snap = (c.offset, c.size(), kept(c).copy())
    assert c.trim(-5) == 0 and (c.offset, c.size()) == snap[:2]
    with pytest.raises(ValueError, match="cannot rewind 5 tokens"):  # deeper than the journal
        c.trim(5)
    assert (c.offset, c.size()) == snap[:2] and np.array_equal(kept(c), snap[2])
    assert c.trim(3) == 3 and c.offset == 17  # as if only 17 tokens had been fed
    ref = make(budget=8, n_sink=2, recent=2, calib=4, qfilters_max_rewind=4)
    ref.update_and_fetch(k[:, :, :17], v[:, :, :17])
    np.testing.assert_array_equal(kept(c), kept(ref))

    c = make(budget=64, calib=4)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert not c.is_trimmable()  # qfilters_max_rewind=0: mlx-lm never trims it (see test_no_silent_rewind)
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
        (k[:, :1, :2], v[:, :1, :2], ValueError, r"filters shape \(2, 16\) does not match keys"),
        (k[..., :8][:, :, :2], v[..., :8][:, :, :2], ValueError, r"filters shape \(2, 16\) does not match keys"),
        (k[:, :, :2].astype(mx.float16), v[:, :, :2].astype(mx.float16), TypeError,
         r"keys dtype (mlx\.core\.)?float16 does not match the cache \((mlx\.core\.)?float32\)"),
        (k[:, :, :2], v[:, :, :2].astype(mx.float16), TypeError, r"keys and values must share a dtype"),
        (k[:, :, :0], v[:, :, :0], ValueError, r"keys must hold at least one token \(L >= 1\)"),
        (np.array(k[:, :, :2]), v[:, :, :2], TypeError, r"keys must be an mx.array, got ndarray"),
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
