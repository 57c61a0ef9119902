"""Compress-once holds what a streaming cache with the same kept rows holds, within one block
of ``compressed_step`` rows (the room a growing answer appends into).

Guards against quantized storage keeping the full-precision prompt keys of an online filter
after the compression (2.97x the streaming cache at a 400-token prompt with ``kv_bits=4``)
and a compressed cache growing in 256-row blocks (1.25x at 400 tokens in float32). Reference: a
streaming cache of the same model dimensions fed the same tokens, whose budget is the rows
the compressed one keeps (slot mode holds ``budget + 1`` rows, all of them live)."""

import mlx.core as mx
import numpy as np
import pytest

from qfilters_mlx import KVCacheConfig
from qfilters_mlx.cache.kv_cache import build_cache
from qfilters_mlx.config import CompressOnce

H, D = 3, 64


def fed(config, k, v, steps, bits):
    c = build_cache(config, 0, None, bits=bits, group_size=64 if bits else None)
    T = k.shape[2] - steps
    for s in range(0, T - 1, 128):
        e = min(s + 128, T - 1)
        c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
    for t in range(T - 1, k.shape[2]):  # the last prompt token alone, then the answer
        c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    return c


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("T", [400, 1000])
def test_compress_once_holds_what_streaming_holds_with_the_same_rows(T, bits):
    rng = np.random.default_rng(T)
    k = mx.array(rng.standard_normal((1, H, T + 3, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, H, T + 3, D)).astype(np.float32))
    once = fed(KVCacheConfig(mode=CompressOnce(ratio=0.5), head_dim=D,
                             qfilters_filter_source="keys"), k, v, 3, bits)
    rows = once.size()  # K kept + 3 answer tokens (the compression ran at the last prompt token)
    assert rows == (T - 1) // 2 + 4 and once.storage.nbytes == 0  # no prompt keys kept
    stream = fed(KVCacheConfig(qfilters_budget=rows - 1, head_dim=D, qfilters_filter_source="keys"),
                 k, v, 3, bits)
    assert stream.size() == rows - 1
    per_row = stream.nbytes / rows  # (slot mode: budget + 1 rows, nothing else held)
    assert once.nbytes <= stream.nbytes + 32 * per_row, (  # (compressed_step = 32)
        once.nbytes, stream.nbytes, once.nbytes / stream.nbytes)
